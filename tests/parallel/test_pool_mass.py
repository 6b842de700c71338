"""The indexer KL target under TP: the sparse mode sums only the selected pools' mass over the ranks.

Legend: B batch, T queries, P k-pools, J selected key slots per query.

`sum_selected_pool_mass` (glm53/parallel/pool_mass.py) reduces exactly the pools of the selected slots.

Legend: B batch, T queries, P k-pools, L tokens per pool, J selected key slots per query.
The reduction is faked by doubling (two ranks holding the same partial sums): every entry at a pool holding one of
the query's selected keys doubles, every other entry, the empty slots' included, stays as it was; with padding and
with packed documents, whose pools start at each document's start (kept_pools), not at multiples of L.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.losses import normalized_target
from glm53.model.indexer import Indexer, kept_pools
from glm53.parallel.pool_mass import slot_pools, sum_selected_pool_mass
from tests.helpers.parallel_jobs import parallel_step, reference_step
from tests.parallel.test_parallel_gloo import BATCH, SEQ, TRAINING, check_parity, config_dict


def test_sparse_reduction_sums_every_selected_pool_and_sends_only_the_slots():
    config = Glm53Config.tiny(index_topk=8, index_kpool=4)
    torch.manual_seed(0)
    indexer = Indexer(config)
    for p in indexer.parameters():
        torch.nn.init.normal_(p)
    B, T = 2, 29
    x, q_resid = torch.randn(B, T, config.hidden_size), torch.randn(B, T, config.q_lora_rank)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :6] = False
    topk, _, candidate, selected = indexer.score_and_select(x, q_resid, valid)
    mass = torch.rand(*candidate.shape)
    sent = []

    def all_reduce(t):  # two ranks holding the same partial sum
        sent.append(t.shape)
        t.mul_(2)

    got = sum_selected_pool_mass(mass, topk, valid, config.index_kpool, None, all_reduce)
    assert sent == [topk.shape]  # [B, T, J], never [B, T, P]
    assert selected.sum() > 20 and torch.equal(got[selected], 2 * mass[selected])
    untouched = ~selected & (got == mass)
    assert untouched.sum() > 0.5 * (~selected).sum()  # pools outside the slots stay partial sums
    torch.testing.assert_close(normalized_target(got, selected), normalized_target(2 * mass, selected))


def test_sparse_indexer_loss_tp2_matches_one_process(pool2):
    """tp2 (with activation checkpointing: the hook runs again on recompute) in the sparse KL mode: every loss
    part and gradient equals one process."""
    config = config_dict(**TRAINING, indexer_loss_mode="sparse")
    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config(**config))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():  # index scores far from the target (test_parallel_gloo.py)
            if ".indexer." in name and p.dim() == 2:
                p.normal_(std=0.3, generator=g)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    results = pool2.run(parallel_step, config=config, state=state, ids=ids, dp=1, tp=2, checkpointing=True)
    reference = reference_step(config, state, ids, dp=1)
    assert reference["parts"]["indexer_loss"] > 1e-2
    check_parity(results, reference)


def test_reduction_over_a_layout_of_another_width_raises():
    """The mass and the layout rebuilt for its reduction must agree on P (a compiled packed layout is narrower than
    the eager one): a mismatch raises instead of scattering into other pools."""
    config = Glm53Config.tiny(index_topk=8, index_kpool=4)
    B, T = 1, 16
    valid = torch.ones(B, T, dtype=torch.bool)
    topk = torch.arange(8).expand(B, T, 8).contiguous()
    mass = torch.rand(B, T, T // config.index_kpool + 1)  # one pool too many
    with pytest.raises(RuntimeError, match="pool layout mismatch: the indexer's mass has 5 pools per row"):
        sum_selected_pool_mass(mass, topk, valid, config.index_kpool, None, lambda t: None)
    got = sum_selected_pool_mass(mass[..., :-1], topk, valid, config.index_kpool, None, lambda t: t.mul_(2))
    assert got.shape == (B, T, 4) and torch.equal(got[..., :2], 2 * mass[..., :2])


def test_reduction_of_a_narrower_mass_than_its_layout_raises():
    """The other way round: a mass narrower than the rebuilt layout (a compiled packed mass, an eager layout with
    every short last pool) raises too, rather than leaving the layout's last pools unreduced."""
    B, T, kpool = 1, 16, 4
    valid = torch.ones(B, T, dtype=torch.bool)
    topk = torch.arange(8).expand(B, T, 8).contiguous()
    mass = torch.rand(B, T, T // kpool - 1)
    with pytest.raises(RuntimeError, match="mass has 3 pools per row, the layout rebuilt for its reduction 4"):
        sum_selected_pool_mass(mass, topk, valid, kpool, None, lambda t: None)


# ----------------------------------------------------------------------------------------------- pool mass at its edges
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
