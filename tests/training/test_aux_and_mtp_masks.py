"""The router aux loss and the MTP layer's masks, checked against computations written out here from what the
routers and layers recorded: the balance loss and z-loss of every MoE layer (MTP depths included) averaged over
layers with their coefficients, on left-padded batches; the MTP layer's validity at depth d (position i counts
only if tokens i and i + d are real), its expert loads and its indexer KL rows.

Legend: B batch, T time, E experts, k experts per token.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.losses import indexer_kl_terms, normalized_target, pool_kl
from tests.helpers.oracle import randomize

B, T, PAD = 2, 19, 5  # row 1 is left-padded by PAD tokens
BALANCE, Z = 0.5, 0.25


def padded_batch(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :PAD] = False
    return ids.masked_fill(~mask, 0), mask


def depth_valid(mask: torch.Tensor, d: int) -> torch.Tensor:
    """Position i at MTP depth d is real when tokens i and i + d both are (written element by element)."""
    out = torch.zeros_like(mask)
    for b in range(B):
        for i in range(T):
            out[b, i] = bool(mask[b, i]) and i + d < T and bool(mask[b, i + d])
    return out


def record_router_logits(model) -> list:
    """Every router call of the next forward, in call order: (router, logits [B*T, E], indices [B*T, k])."""
    calls = []
    for router in model.routers():
        router.register_forward_hook(lambda mod, args, out: calls.append((mod, out[0].detach(), out[2])))
    return calls


def balance_by_hand(logits: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 per sequence (valid tokens only), mean over sequences that have any."""
    E, k = logits.shape[-1], indices.shape[-1]
    per_seq = []
    for b in range(B):
        rows = [b * T + t for t in range(T) if valid[b, t]]
        if not rows:
            continue
        s = logits[rows].double().sigmoid()
        P = (s / s.sum(-1, keepdim=True)).mean(0)
        counts = torch.tensor([sum(int(e in indices[r].tolist()) for r in rows) for e in range(E)], dtype=torch.float64)
        per_seq.append((counts * E / (k * len(rows)) * P).sum())
    return torch.stack(per_seq).mean()


def z_by_hand(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    rows = [b * T + t for b in range(B) for t in range(T) if valid[b, t]]
    return torch.stack([torch.logsumexp(logits[r].double(), 0) ** 2 for r in rows]).mean()


@pytest.mark.parametrize("mtp_depth", [1, 2])
def test_aux_loss_value_from_recorded_router_logits(mtp_depth):
    config = Glm53Config.tiny(
        router_aux_loss_coef=BALANCE, router_z_loss_coef=Z, num_nextn_predict_layers=1, mtp_depth=mtp_depth
    )
    model = Glm53ForCausalLM(config)
    randomize(model, 3)  # peaked router logits: every layer's balance and z terms differ
    calls = record_router_logits(model)
    ids, mask = padded_batch(config.vocab_size)
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(~mask, -100))
    mtp_router = model.mtp.layers[0].mlp.gate
    main = [c for c in calls if c[0] is not mtp_router]
    mtp = [c for c in calls if c[0] is mtp_router]
    assert len(main) == 3 and len(mtp) == mtp_depth
    records = [(logits, idx, mask) for _, logits, idx in main]
    records += [(logits, idx, depth_valid(mask, d)) for d, (_, logits, idx) in enumerate(mtp, start=1)]
    terms = [BALANCE * balance_by_hand(lg, idx, v) + Z * z_by_hand(lg, v) for lg, idx, v in records]
    expected = torch.stack(terms).mean()  # averaged over MoE layers (MTP depths included), not summed
    torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-5, atol=0)
    assert torch.stack(terms).std() > 1e-3 * expected  # the layers really differ, so the average is observable


def test_mtp_validity_loads_and_indexer_rows_follow_the_depth_shifted_mask():
    config = Glm53Config.tiny(
        num_nextn_predict_layers=1, mtp_depth=2, indexer_loss_weight=1.0, router_aux_loss_coef=0.0
    )
    model = Glm53ForCausalLM(config)
    randomize(model, 4)
    model.set_numerics(indexer_kl_recompute=False)  # the [B, T, P] record this test reads by hand
    seen = []  # (layer, its ForwardContext) per block / MTP-depth call, in order
    for layer in [*model.model.layers, model.mtp.layers[0]]:
        layer.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[-1])))
    ids, mask = padded_batch(config.vocab_size, seed=1)
    model.train()
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(~mask, -100))
    mtp_ctx = [ctx for mod, ctx in seen if mod is model.mtp.layers[0]]
    assert len(mtp_ctx) == 2
    k = config.num_experts_per_tok
    for d, ctx in enumerate(mtp_ctx, start=1):
        assert torch.equal(ctx.valid, depth_valid(mask, d)), f"depth {d}"
    # MTP loads: every real position of every depth, k experts each; the main layers: the real tokens
    mtp_load = model.mtp.layers[0].mlp.gate.counted_load
    assert mtp_load.sum() == k * sum(int(depth_valid(mask, d).sum()) for d in (1, 2))
    for layer in model.model.layers[1:]:
        assert layer.mlp.gate.counted_load.sum() == k * int(mask.sum())
    # the indexer loss: main full layers on the padding mask, each MTP depth on its own mask (rows past the end or
    # reading padding do not count)
    main_stats = [ctx.stats for mod, ctx in seen if mod is not model.mtp.layers[0]]
    terms = indexer_kl_terms(main_stats, mask, "dense")
    for d, ctx in enumerate(mtp_ctx, start=1):
        s = ctx.stats
        target = normalized_target(s.pool_mass, s.candidate)
        terms.append(pool_kl(s.index_scores, target, s.candidate, depth_valid(mask, d)))
    assert len(terms) == 3
    torch.testing.assert_close(out.indexer_loss, torch.stack(terms).mean(), rtol=1e-5, atol=1e-7)


def test_balance_and_z_loss_of_sequences_with_one_or_no_real_token():
    """Sequence 0 has one real token, sequence 1 none: it is left out of the mean, not counted as empty."""
    from glm53.losses import balance_loss, z_loss

    gen = torch.Generator().manual_seed(0)
    E, k = 6, 2
    logits = 2 * torch.randn(2 * 3, E, generator=gen)
    indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(6)])
    valid = torch.tensor([[False, False, True], [False, False, False]])
    s = logits[2].double().sigmoid()
    counts = torch.zeros(E, dtype=torch.float64).index_fill(0, indices[2], 1.0)
    expected = (counts * E / k * s / s.sum()).sum()
    torch.testing.assert_close(balance_loss(logits, indices, valid).double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        z_loss(logits, valid).double(), torch.logsumexp(logits[2].double(), 0) ** 2, rtol=1e-6, atol=0
    )
