"""KDA decay layouts the random gates of test_kda.py do not reach: the fast kernel (kda/fast.py with the
decay products of kda/decay.py) against the recurrent reference, forward and every gradient, in fp64.

Legend: B batch, T time, H heads, K key width, V value width, C fast chunk length (32), s rebasing sub-block (16).
- A saturated bounded gate (g = -5 at every step, the -5 * sigmoid gate's limit): a sub-block spans 75, the
  largest span the rebased path is built for, and the decay from an earlier sub-block to the end of a chunk
  reaches -155, below the exp() floor. The rebasing reference point must be each sub-block's FIRST token: with
  any later one a row factor exp(75) meets a floored column factor and their product is far from exp(-80).
- A sub-block whose span crosses REBASE_MAX_EXP only at its last step, reaching twice the limit: the range check
  must read the whole sub-block against the limit itself, or that step's row takes a factor floored at exp(-80)
  against a column factor of exp(79), a product of exp(-1) where the true decay is exp(-81).

The fast KDA kernel decides its rebased path without reading the device when the gate's bound proves it safe
(`gate_floor`, decay.rebase_is_static), and otherwise with one reduction per call, never one per block.

Legend: B batch, T time, H heads, K key width, V value width. Counts: glm53.profiling.HostSyncs.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.kda import decay, kda_chunk, kda_recurrent_reference
from glm53.profiling import HostSyncs
from tests.helpers.kernel_checks import FP32_TOL, assert_all_close, chunks_per_block, grads, kda_inputs

NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dS0"]


def _check(xs) -> None:
    ref = kda_recurrent_reference(*xs[:5], initial_state=xs[5], output_final_state=True)
    got = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert_all_close(got, ref, FP32_TOL, NAMES[:2])
    assert_all_close(grads(got, xs), grads(ref, xs), FP32_TOL, NAMES[2:])


def test_saturated_bounded_gate_matches_recurrent():
    B, T, H, K, V = 1, 70, 2, 8, 6  # two full chunks and a partial one
    xs = kda_inputs(B, T, H, K, V, "bounded")
    xs[3] = torch.full((B, T, H, K), -5.0, dtype=torch.float64, requires_grad=True)
    G = xs[3].detach()[:, :32].transpose(1, 2).cumsum(2)  # one chunk: the rebased path must be the one taken
    assert decay._rebase_is_safe(G)
    _check(xs)


def test_span_crossing_the_limit_at_a_sub_blocks_last_step_matches_recurrent():
    B, T, H, K, V = 1, 40, 1, 8, 6
    xs = kda_inputs(B, T, H, K, V, "bounded")
    g = torch.zeros(B, T, H, K, dtype=torch.float64)
    # the second sub-block of chunk 0 (tokens 16..31) spans just under the limit up to token 30 ...
    g[:, 17:31] = -(decay.REBASE_MAX_EXP - 1) / 14
    g[:, 31] = -decay.REBASE_MAX_EXP - 1  # ... and twice the limit with its last step
    xs[3] = g.requires_grad_()
    G = g[:, :32].transpose(1, 2).cumsum(2)
    assert not decay._rebase_is_safe(G)
    _check(xs)


# ------------------------------------------------------------------------- the rebased path decided without a host read
def test_static_rule_is_the_span_bound():
    # (SUB_CHUNK - 1) steps of |floor| must stay <= REBASE_MAX_EXP = 80: 15 * 5 = 75 yes, 15 * 5.4 = 81 no
    assert decay.SUB_CHUNK == 16 and decay.REBASE_MAX_EXP == 80.0
    assert decay.rebase_is_static(-5.0)
    assert decay.rebase_is_static(-80 / 15)
    assert not decay.rebase_is_static(-5.4)
    assert not decay.rebase_is_static(None)


def _fwd_bwd_syncs(xs, gate_floor):
    with HostSyncs() as syncs:
        o, _ = kda_chunk(*xs[:5], gate_floor=gate_floor)
        o.square().sum().backward()
    return syncs, o.detach(), [x.grad.clone() for x in xs[:5]]


@pytest.mark.parametrize("T", [100, 300])
def test_bounded_gate_reads_nothing_and_unbounded_reads_once_per_call(T, monkeypatch):
    """Blocks of one 32-token chunk: T = 100 is 4 blocks, 300 is 10; the count does not grow with them."""
    B, H, K, V = 1, 2, 16, 8
    chunks_per_block(monkeypatch, 1, B, H, K, V)
    xs = kda_inputs(B, T, H, K, V, "bounded", dtype=torch.float32)
    static, o_static, g_static = _fwd_bwd_syncs(xs, -5.0)
    for x in xs:
        x.grad = None
    checked, o_checked, g_checked = _fwd_bwd_syncs(xs, None)
    assert static.total == 0, static.counts
    assert dict(checked.counts) == {"item": 2}  # one forward, one backward
    assert torch.equal(o_static, o_checked)  # the same (rebased) path either way
    assert all(torch.equal(a, b) for a, b in zip(g_static, g_checked))


def test_floor_too_steep_for_a_static_decision_still_checks(monkeypatch):
    B, T, H, K, V = 1, 64, 2, 8, 8
    xs = kda_inputs(B, T, H, K, V, "bounded", dtype=torch.float32)
    syncs, _, _ = _fwd_bwd_syncs(xs, -6.0)
    assert dict(syncs.counts) == {"item": 2}
