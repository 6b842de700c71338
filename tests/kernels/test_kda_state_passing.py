"""KDA state passing: a sequence run as 2, 3 or 4 pieces composed through their (A, Bs) transitions equals the
chunk kernel on the whole sequence, forward and every gradient (the initial state's included).

KDA state passing with decays weak enough that a piece's initial state still matters at its end.

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

T = 4 * 32 + 7  # four fast-kernel chunks and an odd remainder


def _inputs(
    seed: int,
    B: int = 2,
    H: int = 2,
    K: int = 8,
    V: int = 6,
    dtype=torch.float64,
    length: int = T,
    max_decay: float = 2.0,
):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, length, H, K, generator=g, dtype=dtype))
    k = l2norm(torch.randn(B, length, H, K, generator=g, dtype=dtype))
    v = torch.randn(B, length, H, V, generator=g, dtype=dtype)
    gate = -torch.rand(B, length, H, K, generator=g, dtype=dtype) * max_decay
    beta = torch.rand(B, length, H, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, gate, beta, S0)]


def assert_pieces_equal_whole(leaves: list[torch.Tensor], pieces: int, cot_seed: int | None = None) -> None:
    """kda_pieces over `pieces` pieces equals kda_chunk on the whole sequence: output, final state and the
    gradients of q, k, v, gate, beta and the initial state (fp64, random cotangents)."""
    q, k, v, gate, beta, S0 = leaves
    gen = None if cot_seed is None else torch.Generator().manual_seed(cot_seed)
    cot = torch.randn(*v.shape, generator=gen, dtype=torch.float64)
    cot_S = torch.randn(*S0.shape, generator=gen, dtype=torch.float64)

    def grads(fn):
        o, S = fn()
        return (o, S, *torch.autograd.grad((o * cot).sum() + (S * cot_S).sum(), leaves))

    whole = grads(lambda: kda_chunk(q, k, v, gate, beta, initial_state=S0, output_final_state=True))
    split = grads(lambda: kda_pieces(q, k, v, gate, beta, pieces=pieces, initial_state=S0))
    for name, a, b in zip(["o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"], split, whole):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


def test_transition_is_affine_in_the_initial_state():
    q, k, v, gate, beta, _ = _inputs(0)
    A, Bs = kda_transition(q, k, v, gate, beta)
    S_in = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    _, S_out = kda_chunk(q, k, v, gate, beta, initial_state=S_in, output_final_state=True)
    torch.testing.assert_close(A @ S_in + Bs, S_out, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pieces", [2, 3, 4], ids=lambda n: f"cp{n}")
def test_pieces_equal_whole_sequence_forward_and_gradients(pieces):
    assert_pieces_equal_whole(_inputs(pieces), pieces)


# ------------------------------------------------------------------------------------------- state passing at its edges
def _weak_inputs(T: int):
    return _inputs(T, length=T, max_decay=0.02)


@pytest.mark.parametrize("T,pieces", [(5, 5), (37, 4), (70, 3)], ids=["one-token-pieces", "in-one-chunk", "T70-cp3"])
def test_pieces_with_weak_decay_equal_whole_sequence(T, pieces):
    leaves = _weak_inputs(T)
    A, _ = kda_transition(*(x[:, : T // pieces] for x in leaves[:5]))
    assert A.detach().abs().amax() > 0.1  # the initial state survives a piece
    assert_pieces_equal_whole(leaves, pieces, cot_seed=0)
