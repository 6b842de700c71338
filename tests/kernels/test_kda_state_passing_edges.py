"""KDA state passing with decays weak enough that a piece's initial state still matters at its end.

Legend: B batch, T time, H heads, K key width, V value width.
test_kda_state_passing.py draws decays up to -2 per step: over a piece of 30+ tokens the transition A is below
1e-13, so a wrong composition of the pieces (a transposed A, a state from the wrong piece) stays inside its
tolerance. Here decays are at most -0.02 per step (A of order 1), with pieces of one token (the recurrent path)
and pieces inside one chunk.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.kda import kda_chunk, l2norm
from glm53.kernels.kda.state_passing import kda_pieces, kda_transition


def _weak_inputs(T: int, B: int = 2, H: int = 2, K: int = 8, V: int = 6):
    g = torch.Generator().manual_seed(T)
    q = l2norm(torch.randn(B, T, H, K, generator=g, dtype=torch.float64))
    k = l2norm(torch.randn(B, T, H, K, generator=g, dtype=torch.float64))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    gate = -torch.rand(B, T, H, K, generator=g, dtype=torch.float64) * 0.02
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, gate, beta, S0)]


@pytest.mark.parametrize("T,pieces", [(5, 5), (37, 4), (70, 3)], ids=["one-token-pieces", "in-one-chunk", "T70-cp3"])
def test_pieces_with_weak_decay_equal_whole_sequence(T, pieces):
    leaves = _weak_inputs(T)
    q, k, v, gate, beta, S0 = leaves
    A, _ = kda_transition(*(x[:, : T // pieces] for x in (q, k, v, gate, beta)))
    assert A.detach().abs().amax() > 0.1  # the initial state survives a piece
    gen = torch.Generator().manual_seed(0)
    cot = torch.randn(2, T, 2, 6, generator=gen, dtype=torch.float64)
    cot_S = torch.randn(2, 2, 8, 6, generator=gen, dtype=torch.float64)

    def run(fn):
        o, S = fn()
        return (o, S, *torch.autograd.grad((o * cot).sum() + (S * cot_S).sum(), leaves))

    whole = run(lambda: kda_chunk(q, k, v, gate, beta, initial_state=S0, output_final_state=True))
    split = run(lambda: kda_pieces(q, k, v, gate, beta, pieces=pieces, initial_state=S0))
    for name, a, b in zip(["o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"], split, whole):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)
