"""mHC pieces the parity tests leave loose: the fast collapse is bit-equal to the reference in bf16 (its backward
upcasts like autograd through the reference's upcast), the final stream collapse is transformers' unweighted
mean, and HyperConnection.init_weights is transformers' initialisation.

Legend: B batch, T time, N streams, D model width.
"""

from __future__ import annotations

import torch
from transformers.models.glm5_next import modeling_glm5_next as hf

from glm53.config import Glm53Config
from glm53.kernels.hc_collapse import hc_collapse, hc_collapse_reference
from glm53.model.hyper_connection import HyperConnection, collapse_streams, expand_streams


def test_hc_collapse_bf16_is_bit_equal_to_reference():
    torch.manual_seed(0)
    pre = torch.rand(2, 5, 4, requires_grad=True)  # [B, T, N] fp32
    streams = torch.randn(2, 5, 4, 16, dtype=torch.bfloat16, requires_grad=True)  # [B, T, N, D]
    grad = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    outs = []
    for fn in (hc_collapse_reference, hc_collapse):
        out = fn(pre, streams)
        outs.append((out, *torch.autograd.grad(out, (pre, streams), grad)))
    for ref, got in zip(*outs):
        assert ref.dtype == got.dtype
        assert torch.equal(ref, got)


def test_stream_collapse_is_transformers_mean():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)  # [B, T, D]
    streams = expand_streams(x, 4) + torch.randn(2, 3, 4, 8)  # [B, T, N, D]
    head = hf.Glm5NextTextHyperHead()
    assert torch.equal(collapse_streams(streams), head(streams))
    assert torch.allclose(collapse_streams(expand_streams(x, 4)), x)


def test_init_weights_is_transformers_init():
    config = Glm53Config.tiny(hc_mult=4)
    hc = HyperConnection(config)
    torch.manual_seed(0)
    hc.init_weights()
    assert torch.equal(hc.scale, torch.ones(3)) and torch.equal(hc.base, torch.zeros(hc.base.shape))
    assert abs(hc.fn.std().item() - 0.02) < 0.002 and abs(hc.fn.mean().item()) < 0.002
