"""bf16 accuracy of the sparse attention kernels, bounded by the rounding of the exact answer itself.

Legend: B batch, T queries, S keys, H heads, D q/k width, E value width, C latent width, J selected slots.
The inputs are rounded to bf16 once; the fp32 reference on those same (upcast) inputs is the exact answer up
to fp32 noise. A kernel that computes in fp32 and rounds once on exit is within one bf16 rounding of it, so its
error is bounded by a small multiple of "the fp32 reference rounded to bf16" minus the reference. A kernel that
skips the fp32 upcast (bf16 scores, softmax or accumulation) is several roundings off and fails.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels import sparse_attention as sa_mod
from glm53.kernels.sparse_attention import (
    sparse_attention,
    sparse_attention_reference,
    sparse_mqa_attention,
    sparse_mqa_attention_reference,
)
from tests.kernels.test_kernels_fast import sparse_inputs

MAX_ROUNDINGS = 1.5  # the largest error over the largest rounding of the reference (ties may round the other way)
MEAN_ROUNDINGS = 1.25  # the mean error over the mean rounding


def assert_within_bf16_rounding(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.bfloat16, what
    rounding = (ref.to(torch.bfloat16).float() - ref).abs()
    err = (got.float() - ref).abs()
    assert rounding.max() > 0, what
    assert err.max() <= MAX_ROUNDINGS * rounding.max(), (
        f"{what}: max error {err.max():.3e} vs rounding {rounding.max():.3e}"
    )
    assert err.mean() <= MEAN_ROUNDINGS * rounding.mean(), (
        f"{what}: mean error {err.mean():.3e} vs rounding {rounding.mean():.3e}"
    )


def bf16_leaves(*xs: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(bf16 leaves, fp32 leaves holding the same values) for the kernel and the reference."""
    low = [x.detach().to(torch.bfloat16).requires_grad_() for x in xs]
    return low, [x.detach().float().requires_grad_() for x in low]


def backward(out: torch.Tensor, inputs: list[torch.Tensor], cot: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, inputs, cot.to(out.dtype))


CASES = {"B2-T40-S40-H4-J9": (2, 40, 40, 4, 32, 32, 9), "B1-T33-S50-H2-J40": (1, 33, 50, 2, 64, 16, 40)}


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_mqa_attention_bf16_within_rounding(case):
    B, T, S, H, D, _, J = CASES[case]
    (q, k, _), idx = sparse_inputs(B, T, S, H, D, D, J, dtype=torch.float32)
    (q16, kv16), (q32, kv32) = bf16_leaves(3 * q, k[:, :, 0])  # [B, T, H, C], [B, S, C]: one shared latent
    scale = D**-0.5
    got = sparse_mqa_attention(q16, kv16, idx, scale)
    ref = sparse_mqa_attention_reference(q32, kv32, idx, scale)
    assert_within_bf16_rounding(got, ref.detach(), "o")
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).float()
    for name, g, r in zip(("dq", "dkv"), backward(got, [q16, kv16], cot), backward(ref, [q32, kv32], cot)):
        assert_within_bf16_rounding(g, r, name)


@pytest.mark.parametrize("span_ratio", [-1, None], ids=["gather", "default-ratio"])
@pytest.mark.parametrize("case", list(CASES))
def test_sparse_attention_bf16_within_rounding(case, span_ratio, monkeypatch):
    if span_ratio is not None:  # the default ratio sends every chunk of these short sequences dense
        monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", span_ratio)
    B, T, S, H, D, E, J = CASES[case]
    (q, k, v), idx = sparse_inputs(B, T, S, H, D, E, J, dtype=torch.float32)
    (q16, k16, v16), (q32, k32, v32) = bf16_leaves(3 * q, k, v)
    scale = D**-0.5
    got = sparse_attention(q16, k16, v16, idx, scale)
    ref = sparse_attention_reference(q32, k32, v32, idx, scale)
    assert_within_bf16_rounding(got, ref.detach(), "o")
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).float()
    grads = zip(("dq", "dk", "dv"), backward(got, [q16, k16, v16], cot), backward(ref, [q32, k32, v32], cot))
    for name, g, r in grads:
        assert_within_bf16_rounding(g, r, name)
