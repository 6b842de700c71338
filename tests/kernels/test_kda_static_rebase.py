"""The fast KDA kernel decides its rebased path without reading the device when the gate's bound proves it safe
(`gate_floor`, decay.rebase_is_static), and otherwise with one reduction per call, never one per block.

Legend: B batch, T time, H heads, K key width, V value width. Counts: glm53.profiling.HostSyncs.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.kda import decay, kda_chunk
from glm53.profiling import HostSyncs
from tests.kernels.test_kda_blocked import chunks_per_block
from tests.kernels.test_kernels_fast import kda_inputs


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
