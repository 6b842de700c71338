"""segment_attention (length-grouped padded SDPA) == segment_attention_reference (a loop over segments),
forward and the gradients of q, k and v; segments never see each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53.kernels.vision_attention import GROUP_RATIO, length_groups, segment_attention, segment_attention_reference

# fp32: one softmax over <= 100 keys and one weighted sum, both accumulated in fp32 (eps 1.2e-7): a relative error
# of ~100 * eps ~ 1e-5 bounds either; fp64 reference vs fp32 fast is the same bound.
RTOL = 1e-5
CASES = {
    "one-segment-L9": [9],
    "equal-lengths-no-mask": [16, 16, 16],
    "mixed-groups": [100, 7, 30, 1, 32, 64, 80],  # 100 and 80 share a group (80 >= 0.75 * 100), 1 alone
    "with-empty-segment": [5, 0, 12],  # every group a run of back-to-back segments: views, concatenated
    "equal-lengths-apart": [16, 5, 16],  # 0 and 2 share a group but are not back to back: gathered
}


def inputs(lengths, H=3, hd=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = sum(lengths)
    q, k, v = (torch.randn(N, H, hd, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, cu


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fast_equals_reference_forward_and_gradients(case):
    q, k, v, cu = inputs(CASES[case])
    gen = torch.Generator().manual_seed(1)
    cot = torch.randn(q.shape, generator=gen)
    ref = segment_attention_reference(q, k, v, cu, 0.35)
    ref_grads = torch.autograd.grad(ref, (q, k, v), cot)
    got = segment_attention(q, k, v, cu, 0.35)
    got_grads = torch.autograd.grad(got, (q, k, v), cot)
    assert rel(got, ref) < RTOL
    for name, g, r in zip("qkv", got_grads, ref_grads):
        assert rel(g, r) < RTOL, name


def test_fp64_reference_is_ground_truth_for_fp32_fast():
    q, k, v, cu = inputs(CASES["mixed-groups"], dtype=torch.float64)
    ref = segment_attention_reference(q, k, v, cu, 0.35)
    got = segment_attention(q.float(), k.float(), v.float(), cu, 0.35)
    assert ref.dtype == torch.float64 and rel(got, ref) < RTOL


def _bf16_flash_attention_runs() -> bool:
    """torch 2.13's bf16 CPU flash attention (L > 64) packs with VNNI when the CPU has AMX / AVX-512 bf16, and
    raises "pack_vnni2 is only supported when avx512 is supported" when ATen's kernels are forced to the portable
    set (ATEN_CPU_CAPABILITY=default, .ci/run's numerics pass) on such a CPU: a torch limitation, not glm53's."""
    q = torch.zeros(1, 1, 100, 8, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q)
    except RuntimeError as e:
        if "pack_vnni2" in str(e):
            return False
        raise
    return True


@pytest.mark.skipif(
    not _bf16_flash_attention_runs(), reason="torch's bf16 CPU flash attention under forced portable kernels"
)
def test_bf16_within_bf16_rounding():
    q, k, v, cu = inputs(CASES["mixed-groups"])
    ref = segment_attention_reference(q, k, v, cu, 0.35)
    got = segment_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, 0.35)
    # bf16 inputs (8 mantissa bits: 2^-9 relative each) and output rounding: a few 2^-9
    assert got.dtype == torch.bfloat16 and rel(got, ref) < 4 * 2**-9


def test_segments_do_not_see_each_other():
    q, k, v, cu = inputs([6, 10, 4])
    base = segment_attention(q, k, v, cu, 0.5).detach()
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[6:16] += 3.0
    v2[6:16] -= 2.0
    moved = segment_attention(q.detach(), k2, v2, cu, 0.5)
    assert torch.equal(moved[:6], base[:6]) and torch.equal(moved[16:], base[16:])
    assert (moved[6:16] - base[6:16]).abs().max() > 0.1
    # and one segment is plain full attention over its own rows
    alone = segment_attention_reference(q[6:16], k[6:16], v[6:16], torch.tensor([0, 10]), 0.5)
    assert rel(base[6:16], alone) < RTOL


def test_length_groups_bound_padding_and_cover_every_segment():
    lengths = [100, 7, 30, 1, 32, 64, 80, 0, 75]
    groups = length_groups(lengths)
    flat = sorted(i for g in groups for i in g)
    assert flat == [i for i, n in enumerate(lengths) if n > 0]
    for g in groups:
        assert all(lengths[i] >= GROUP_RATIO * lengths[g[0]] for i in g) and lengths[g[0]] == max(lengths[i] for i in g)
    assert [sorted(g) for g in groups] == [[0, 6, 8], [5], [2, 4], [1], [3]]


def test_cu_seqlens_must_cover_the_rows():
    q = torch.randn(6, 2, 4)
    for bad in ([0, 3, 5], [1, 3, 6], [0, 3, 7]):
        with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the 6 rows"):
            segment_attention(q, q, q, torch.tensor(bad), 0.5)
