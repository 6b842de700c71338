"""The compiled part of the decode step (opt-in: `decode_step(..., compile=True)`, `generate(..., compile=True)`):
each mHC site's block input, from the streams to the normalised collapse, as one torch.compile'd graph.

Legend (glm53/model/__init__.py): B batch, N mHC streams, D model width.
In eager mode a site is ~90 tiny ops (the projection, the gates, the softmax and Sinkhorn's 2 * iters - 1
normalisations of an N x N matrix, the collapse and the block's input norm); at one token per row their cost is
per-op dispatch, not arithmetic. Compiled, the site is one call into one generated kernel. Every site of every
block has the same shapes, so one graph serves all of them (weights are inputs, not constants); a new batch size,
model width or dtype compiles a new graph (static shapes).
The formulas are decode.py's eager ones (HyperConnection.coefficients, kernels/hc_collapse.py, kernels/rms_norm.py),
in the same dtypes; Sinkhorn runs in its scaling form (kernels/sinkhorn.py sinkhorn_scaling: the same iterations on
two length-N vectors). The generated code may reorder fp32 sums: results agree up to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.sinkhorn import sinkhorn_scaling

BACKENDS = ("inductor", "aot_eager", "eager")  # as model/compile.py: inductor generates kernels, the others trace


@dataclass(frozen=True)
class Compiled:
    """The compiled helpers of one backend (site_input)."""

    backend: str
    site: object


_COMPILED: dict[str, Compiled] = {}  # one torch.compile wrapper per function and backend, made once per process


def site_input(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
               norm_weight: torch.Tensor, n: int, eps: float, norm_eps: float, iters: int,
               block_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """streams [B, N, D] -> (the block input [B, D] in streams' dtype, post [B, N], comb [B, N, N] fp32).

    fn / scale / base: decode._Site's ((2+N)*N rows, per-coefficient scale); norm_weight and block_eps: the block's
    input RMSNorm."""
    B, dtype = streams.shape[0], streams.dtype
    flat = streams.reshape(B, -1).float()  # [B, N*D]
    mixed = F.linear(F.rms_norm(flat, (flat.shape[-1],), None, norm_eps), fn)  # [B, (2+N)*N]
    z = torch.addcmul(base, mixed, scale)
    gates = torch.sigmoid(z[:, : 2 * n])
    pre = gates[:, :n] + eps
    post = 2 * gates[:, n:]
    comb = sinkhorn_scaling(torch.softmax(z[:, 2 * n :].view(B, n, n), dim=-1) + eps, iters, eps)
    collapsed = torch.bmm(pre[:, None, :], streams.float()).view(B, -1).to(dtype)  # [B, D]
    normed = F.rms_norm(collapsed.float(), (collapsed.shape[-1],), None, block_eps).to(dtype)
    return norm_weight * normed, post, comb


def compiled(backend: str) -> Compiled:
    """The torch.compile'd helpers for `backend` (made once per process and backend, then reused)."""
    if backend not in BACKENDS:
        raise ValueError(f"decode compile backend must be one of {BACKENDS} (or compile=True for inductor), "
                         f"got {backend!r}")  # fmt: skip
    if backend not in _COMPILED:
        make = lambda fn: torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)  # noqa: E731
        _COMPILED[backend] = Compiled(backend, make(site_input))
    return _COMPILED[backend]


def backend_name(compile: bool | str) -> str | None:
    """decode_step's `compile` argument -> a backend name (None: eager)."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str):
        compiled(compile)  # validates the name
        return compile
    raise ValueError(f"compile must be a bool or one of {BACKENDS}, got {compile!r}")


__all__ = ["BACKENDS", "Compiled", "backend_name", "compiled", "site_input"]
