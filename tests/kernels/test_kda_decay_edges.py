"""KDA decay layouts the random gates of test_kernels_fast.py do not reach: the fast kernel (kda/fast.py with the
decay products of kda/decay.py) against the recurrent reference, forward and every gradient, in fp64.

Legend: B batch, T time, H heads, K key width, V value width, C fast chunk length (32), s rebasing sub-block (16).
- A saturated bounded gate (g = -5 at every step, the -5 * sigmoid gate's limit): a sub-block spans 75, the
  largest span the rebased path is built for, and the decay from an earlier sub-block to the end of a chunk
  reaches -155, below the exp() floor. The rebasing reference point must be each sub-block's FIRST token: with
  any later one a row factor exp(75) meets a floored column factor and their product is far from exp(-80).
- A sub-block whose span crosses REBASE_MAX_EXP only at its last step, reaching twice the limit: the range check
  must read the whole sub-block against the limit itself, or that step's row takes a factor floored at exp(-80)
  against a column factor of exp(79), a product of exp(-1) where the true decay is exp(-81).
"""

from __future__ import annotations

import torch

from glm53.kernels.kda import decay, kda_chunk, kda_recurrent_reference
from tests.kernels.test_kernels_fast import FP32_TOL, assert_all_close, grads, kda_inputs

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
