"""KDA state passing with decays weak enough that a piece's initial state still matters at its end.

Legend: B batch, T time, H heads, K key width, V value width.
test_kda_state_passing.py draws decays up to -2 per step: over a piece of 30+ tokens the transition A is below
1e-13, so a wrong composition of the pieces (a transposed A, a state from the wrong piece) stays inside its
tolerance. Here decays are at most -0.02 per step (A of order 1), with pieces of one token (the recurrent path)
and pieces inside one chunk.
"""

from __future__ import annotations

import pytest

from glm53.kernels.kda.state_passing import kda_transition
from tests.kernels.test_kda_state_passing import _inputs, assert_pieces_equal_whole


def _weak_inputs(T: int):
    return _inputs(T, length=T, max_decay=0.02)


@pytest.mark.parametrize("T,pieces", [(5, 5), (37, 4), (70, 3)], ids=["one-token-pieces", "in-one-chunk", "T70-cp3"])
def test_pieces_with_weak_decay_equal_whole_sequence(T, pieces):
    leaves = _weak_inputs(T)
    A, _ = kda_transition(*(x[:, : T // pieces] for x in leaves[:5]))
    assert A.detach().abs().amax() > 0.1  # the initial state survives a piece
    assert_pieces_equal_whole(leaves, pieces, cot_seed=0)
