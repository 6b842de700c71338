"""Chunk budgets per device (kernels/budgets.py): the CPU keeps the module constants, CUDA takes GPU-sized chunks,
and the kernels agree with their references under either (the budget splits work, never changes a formula).
The CUDA budgets are simulated on CPU tensors (budgets.simulate_device).

Legend: B batch, T time, H heads, K/V widths, J selected slots, P pools, C KDA chunk length.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels import budgets
from glm53.kernels import indexer_scores as idx_mod
from glm53.kernels import sparse_attention as sa_mod
from glm53.kernels.kda import fast, kda_chunk, kda_recurrent_reference
from glm53.kernels.sparse_attention import sparse_attention, sparse_attention_reference
from tests.helpers.kernel_checks import FP32_TOL, assert_all_close, grads, kda_inputs, sparse_inputs


def test_budget_rule(monkeypatch):
    assert budgets.budget("gather", "cpu", 123) == 123
    assert budgets.budget("gather", torch.device("cuda", 1), 123) == budgets.CUDA_BUDGETS["gather"]
    with budgets.simulate_device("cuda"):
        assert budgets.budget("state", "cpu", 5) == 1 << 28
        assert budgets.budget("state", "meta", 5) == 1 << 28
        with budgets.simulate_device("cpu"):
            assert budgets.budget("state", "cpu", 5) == 5
    assert budgets.budget("state", "cpu", 5) == 5
    with pytest.raises(KeyError, match="unknown chunk budget 'gathr'"):
        budgets.budget("gathr", "cpu", 1)
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        with budgets.simulate_device("tpu"):
            pass


def test_cuda_budgets_give_fewer_larger_chunks():
    # released KDA widths: 64 heads x 128 x 128 -> 4 chunks of 32 per block on the CPU, 256 of 64 on CUDA
    assert fast._chunks_per_block(1, 64, 128, 128) == 4 and fast._chunk_size(4096) == 32
    assert fast.n_blocks(1, 4096, 64, 128, 128) == 32
    with budgets.simulate_device("cuda"):
        assert fast._chunks_per_block(1, 64, 128, 128, "cpu") == 256 and fast._chunk_size(4096, "cpu") == 64
        assert fast.n_blocks(1, 4096, 64, 128, 128, "cpu") == 1
        # the per-head sparse attention at one TP rank's 8 released heads: 64-query chunks (16 on the CPU)
        assert sa_mod._query_chunk(1, 8, 2051, 256, "cpu") == 64
        assert idx_mod._score_chunk(1, 32, 1024, "cpu") == 8192
    assert sa_mod._query_chunk(1, 8, 2051, 256, "cpu") == 16


@pytest.mark.parametrize("gate", ["bounded", "softplus-large"])
def test_kda_with_cuda_budgets_matches_recurrent(gate):
    """64-token chunks, every chunk in one block (fp64: the tolerance is the fp32 one, far above fp64 rounding)."""
    xs = kda_inputs(2, 150, 2, 16, 12, gate)
    ref = kda_recurrent_reference(*xs[:5], initial_state=xs[5], output_final_state=True)
    with budgets.simulate_device("cuda"):
        got = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
        got_grads = grads(got, xs)
    assert_all_close(got, ref, FP32_TOL, ["o", "final_state"])
    assert_all_close(got_grads, grads(ref, xs), FP32_TOL, ["dq", "dk", "dv", "dg", "dbeta", "dS0"])


@pytest.mark.parametrize("span_ratio", [-1, 1 << 30], ids=["gather", "masked-dense"])
def test_sparse_attention_with_cuda_budgets_matches_reference(span_ratio, monkeypatch):
    monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", span_ratio)
    (q, k, v), idx = sparse_inputs(1, 150, 150, 2, 8, 8, 9)  # 150 queries: chunks of 64, 64, 22
    ref = sparse_attention_reference(q, k, v, idx, 0.3)
    with budgets.simulate_device("cuda"):
        got = sparse_attention(q, k, v, idx, 0.3)
        got_grads = grads(got, [q, k, v])
    assert_all_close((got,), (ref,), FP32_TOL, ["o"])
    assert_all_close(got_grads, grads(ref, [q, k, v]), FP32_TOL, ["dq", "dk", "dv"])
