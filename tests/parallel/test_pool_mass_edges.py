"""`sum_selected_pool_mass` (glm53/parallel/pool_mass.py) reduces exactly the pools of the selected slots.

Legend: B batch, T queries, P k-pools, L tokens per pool, J selected key slots per query.
The reduction is faked by doubling (two ranks holding the same partial sums): every entry at a pool holding one of
the query's selected keys doubles, every other entry, the empty slots' included, stays as it was; with padding and
with packed documents, whose pools start at each document's start (kept_pools), not at multiples of L.
"""

from __future__ import annotations

import pytest
import torch

from glm53.model.indexer import kept_pools
from glm53.parallel.pool_mass import slot_pools, sum_selected_pool_mass

B, T, L, J = 2, 19, 4, 6


def layout(kind: str):
    valid = torch.ones(B, T, dtype=torch.bool)
    cu = None
    if kind == "padded":
        valid[1, :3] = False
    elif kind == "packed":  # documents of 5, 14 (row 0) and 6, 13 (row 1): pools restart at 5 and 25
        cu = torch.tensor([0, 5, 19, 25, 38])
    return valid, cu


def random_topk(valid: torch.Tensor, seed: int) -> torch.Tensor:
    """Causal distinct keys among the valid tokens, a few slots empty (-1)."""
    g = torch.Generator().manual_seed(seed)
    topk = torch.full((B, T, J), -1, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            keys = torch.nonzero(valid[b, : t + 1]).flatten()
            keys = keys[torch.randperm(keys.numel(), generator=g)][: J - 1]  # at least one empty slot
            topk[b, t, : keys.numel()] = keys
    return topk


@pytest.mark.parametrize("kind", ["plain", "padded", "packed"])
def test_exactly_the_selected_pools_are_reduced(kind):
    valid, cu = layout(kind)
    topk = random_topk(valid, seed=len(kind))
    positions, _ = kept_pools(valid, L, cu)  # [B, P, L], the pools' tokens
    P = positions.shape[1]
    mass = torch.rand(B, T, P, generator=torch.Generator().manual_seed(1)) + 0.5
    reduced = torch.zeros(B, T, P, dtype=torch.bool)
    want_pools = torch.full((B, T, J), P)
    for b in range(B):
        for t in range(T):
            for j in range(J):
                key = int(topk[b, t, j])
                if key < 0:
                    continue
                p = int(torch.nonzero((positions[b] == key).any(-1)).flatten()[0])
                want_pools[b, t, j] = p
                reduced[b, t, p] = True
    assert torch.equal(slot_pools(topk, valid, L, cu), want_pools)
    sent = []

    def all_reduce(x):
        sent.append(x.clone())
        x.mul_(2)

    got = sum_selected_pool_mass(mass, topk, valid, L, cu, all_reduce)
    assert got.shape == (B, T, P) and len(sent) == 1 and sent[0].shape == (B, T, J)
    assert reduced.sum() > 50 and (~reduced).sum() > 50
    torch.testing.assert_close(got, torch.where(reduced, 2 * mass, mass), rtol=0, atol=0)
    # what is sent: the mass at each slot's pool, zero for an empty slot
    padded = torch.cat([mass, torch.zeros(B, T, 1)], -1)
    torch.testing.assert_close(sent[0], padded.gather(-1, want_pools), rtol=0, atol=0)
