"""Packed sparse attention at the document edges: a slot on the NEXT document's first token or the PREVIOUS
document's last token is empty; a slot on the query's own first or last token is read.

Mutation audit (issue #34): letting a packed query attend the next document's first token (`<= end` in the
document filter) passed every test, which drew only causal slots (never at or past the query's own document end).
Here every query's slots are placed on purpose at start - 1, start, end - 1 and end of its document, and the
fast and reference forms of both the per-head and the absorbed (MQA) kernel are compared with each document run
alone on indices the test filters itself. The fast forms compute in fp32 whatever the input; the inputs are fp32
N(0, 1): a score is a length-K dot product whose fp32 error is at most K * eps * sum|q_i k_i| (<= 4 * 1.2e-7 * 16),
and the softmax over <= 4 slots times |v| <= 4 carries it to the output: atol = K * eps * 16 * 4 = 3.1e-5,
far below what reading one wrong token changes (O(0.1)).
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.sparse_attention import (
    sparse_attention,
    sparse_attention_reference,
    sparse_mqa_attention,
    sparse_mqa_attention_reference,
)

B, T, H, K = 1, 12, 2, 4
CU = torch.tensor([0, 5, 9, 12])  # documents [0, 5), [5, 9), [9, 12)
FP32 = dict(rtol=0.0, atol=K * torch.finfo(torch.float32).eps * 16 * 4)


def edge_slots() -> torch.Tensor:
    """[B, T, 4]: per query, its document's start - 1, start, end - 1 and end (-1 where that is off the row)."""
    idx = torch.full((B, T, 4), -1, dtype=torch.long)
    for s, e in zip(CU[:-1].tolist(), CU[1:].tolist()):
        for t in range(s, e):
            idx[0, t] = torch.tensor([s - 1, s, e - 1, e if e < T else -1])
    return idx


def alone(attend, q, kvs, idx):
    """Each document run alone, with only its own slots (filtered here, independently of the kernels)."""
    out = []
    for s, e in zip(CU[:-1].tolist(), CU[1:].tolist()):
        local = idx[:, s:e] - s
        local = torch.where((local >= 0) & (local < e - s), local, torch.full_like(local, -1))
        out.append(attend(q[:, s:e], *(x[:, s:e] for x in kvs), local, 0.5))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kernel", [sparse_attention, sparse_attention_reference], ids=["fast", "reference"])
def test_per_head_kernel_reads_only_the_own_documents_edge_tokens(kernel):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, generator=g, dtype=torch.float32) for _ in range(3))
    idx = edge_slots()
    got = kernel(q, k, v, idx, 0.5, cu_seqlens=CU)
    torch.testing.assert_close(got, alone(sparse_attention_reference, q, (k, v), idx), **FP32)
    # the next document's first token really is read when the slot is not filtered (the test can fail)
    assert not torch.allclose(got, sparse_attention_reference(q, k, v, idx, 0.5))


@pytest.mark.parametrize("kernel", [sparse_mqa_attention, sparse_mqa_attention_reference], ids=["fast", "reference"])
def test_absorbed_kernel_reads_only_the_own_documents_edge_tokens(kernel):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float32)
    kv = torch.randn(B, T, K, generator=g, dtype=torch.float32)
    idx = edge_slots()
    got = kernel(q, kv, idx, 0.5, cu_seqlens=CU)
    torch.testing.assert_close(got, alone(sparse_mqa_attention_reference, q, (kv,), idx), **FP32)
    assert not torch.allclose(got, sparse_mqa_attention_reference(q, kv, idx, 0.5))
