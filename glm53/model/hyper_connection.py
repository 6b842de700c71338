"""Manifold-constrained hyper-connections (mHC): N residual streams mixed around each attention/MLP block.

Legend: B batch, T time, N streams (hc_mult), D model width.
At each site the N streams [B, T, N, D] are flattened, RMS-normalised without weight and projected (fp32) to
pre (N), post (N) and comb (N x N):
    pre  = sigmoid(scale_0 * pre_logits + base_pre) + eps            (collapses the streams into the block input)
    post = 2 * sigmoid(scale_1 * post_logits + base_post)            (spreads the block output over the streams)
    comb = sinkhorn(softmax(scale_2 * comb_logits + base_comb) + eps) (mixes the residual streams)
and the site computes  out_i = post_i * block(sum_j pre_j x_j) + sum_j comb_ji x_j
(transformers' Glm5NextTextHyperConnection and decoder layer), in two explicit halves around the block:
    x, mix = site.enter(streams)     # a module call (hooks run): x = sum_j pre_j x_j [B, T, D], mix = (post, comb)
    streams = site.exit(streams, block(x), mix)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..config import Glm53Config
from ..hooks import as_local
from ..kernels import kernel_op

# kernels resolved once; use_backend keeps them current (kernels/dispatch.py)
hc_project, sinkhorn = kernel_op("hc_project"), kernel_op("sinkhorn")
hc_collapse, hc_mix = kernel_op("hc_collapse"), kernel_op("hc_mix")

FN_INIT_STD = 0.02  # transformers initialises `fn` with std 0.02 regardless of initializer_range


class Mix(NamedTuple):
    """What a site's `exit` needs from its `enter`: the coefficients that spread the block output and mix the
    streams (fp32)."""

    post: torch.Tensor  # [B, T, N]
    comb: torch.Tensor  # [B, T, N, N]


class HyperConnection(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        self.n = config.hc_mult
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps  # the input norm uses the model's RMS eps, not hc_eps
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        width = (2 + self.n) * self.n
        self.fn = nn.Parameter(torch.empty(width, self.n * config.hidden_size))  # [(2+N)N, N*D]
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))
        # Numerics setting: recompute the coefficients in backward (True), store them (False), or None: recompute
        # only for non-fp32 streams. For bf16 streams the fp32 flattened copy would otherwise be kept for the
        # projection's gradient; for fp32 streams that copy is the streams' own storage, so storing is free.
        self.recompute: bool | None = None

    def coefficients(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, T, N, D] -> pre [B, T, N], post [B, T, N], comb [B, T, N, N], all fp32."""
        n = self.n
        flat = streams.flatten(-2).float()  # [B, T, N*D]
        mixed = hc_project(flat, as_local(self, "fn").float(), self.norm_eps)  # [B, T, (2+N)N]
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = as_local(self, "base").float().split([n, n, n * n])
        scale = as_local(self, "scale").float()
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb_logits = (comb_w * scale[2] + comb_b).view(*comb_w.shape[:-1], n, n)
        comb = sinkhorn(torch.softmax(comb_logits, dim=-1) + self.eps, self.sinkhorn_iters, self.eps)
        return pre, post, comb

    def enter(self, streams: torch.Tensor) -> tuple[torch.Tensor, Mix]:
        """The site's first half: streams [B, T, N, D] -> (the block input sum_j pre_j x_j [B, T, D], the mix
        coefficients `exit` needs). It is this module's forward, called through the module so that hooks on it
        run (FSDP gathers the site's fp32 parameters there; `exit` reads no parameter)."""
        return self(streams)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, Mix]:
        """`enter`: the coefficients, recomputed in backward when `recompute` says so, and the collapsed input."""
        recompute = streams.dtype != torch.float32 if self.recompute is None else self.recompute
        if torch.is_grad_enabled() and streams.requires_grad and recompute:
            pre, post, comb = checkpoint(self.coefficients, streams, use_reentrant=False)
        else:
            pre, post, comb = self.coefficients(streams)
        return hc_collapse(pre, streams), Mix(post, comb)

    def exit(self, streams: torch.Tensor, output: torch.Tensor, mix: Mix) -> torch.Tensor:
        """The site's second half: out_i = post_i * output + sum_j comb_ji x_j -> new streams [B, T, N, D]."""
        return hc_mix(streams, mix.comb, mix.post, output)

    def init_weights(self) -> None:
        nn.init.normal_(self.fn, std=FN_INIT_STD)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, D] -> [B, T, N, D]: the embedding copied to every stream."""
    return x[:, :, None, :].expand(-1, -1, n, -1).contiguous()


def collapse_streams(streams: torch.Tensor) -> torch.Tensor:
    """[B, T, N, D] -> [B, T, D]: the unweighted mean GLM-5.3 ends with (DeepSeek-V4 weighs it; GLM does not)."""
    return streams.mean(dim=2)
