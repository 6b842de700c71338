"""Balance loss, z-loss, router bias update, indexer KL loss (dense/sparse/shared), gradients of all losses.

Edges of glm53/losses/parts.py the model-level tests leave open.

Legend: B_EDGES batch, T_EDGES time, P k-pools, E experts, k experts per token, M = B_EDGES * T_EDGES tokens, D model width.
Given denominators below 1 (a global count divided by the data-parallel degree), the chunked indexer KL on a
query whose candidate pools hold no attention mass (zero loss and zero gradient there), a shared indexer layer
before any full one, and the head losses' input checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.losses import (
    IGNORE_INDEX,
    balance_loss,
    causal_lm_head_loss,
    causal_lm_loss,
    chunked_pool_kl,
    head_target_loss,
    indexer_kl_terms,
    normalized_target,
    pool_kl,
    z_loss,
)
from glm53.model.balancing import expert_load
from glm53.model.context import LayerStats
from tests.helpers.oracle import randomize

KDA, MLA = "linear_attention", "indexed_attention"
B, T = 2, 18  # 4 complete pools of 4, plus a 2-token tail


# ------------------------------------------------------------------------------------------------- balance
def test_balance_loss_values():
    # uniform scores, perfectly balanced choice: sum_i f_i P_i = 1
    logits = torch.zeros(2, 4)
    indices = torch.tensor([[0, 1], [2, 3]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    torch.testing.assert_close(balance_loss(logits, indices, valid), torch.tensor(1.0))
    # a hand-written sequence-wise computation (DeepSeek-V3 eq. 17-20), with a padded token in row 1
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * 3, 5, generator=gen)
    indices = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(6)])
    valid = torch.tensor([[True, True, True], [False, True, True]])
    expected = []
    for b in range(2):
        rows = [b * 3 + t for t in range(3) if valid[b, t]]
        s = logits[rows].sigmoid()
        P = (s / s.sum(-1, keepdim=True)).mean(0)
        f = torch.tensor([sum(int(e in indices[r].tolist()) for r in rows) for e in range(5)]) * 5 / (2 * len(rows))
        expected.append((f * P).sum())
    torch.testing.assert_close(balance_loss(logits, indices, valid), torch.stack(expected).mean())
    torch.testing.assert_close(expert_load(indices, valid, 5).sum(), torch.tensor(5.0 * 2))


def test_z_loss_value():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    expected = (math.log(2) ** 2 + math.log(math.e + math.e**2) ** 2) / 2
    torch.testing.assert_close(z_loss(logits, valid), torch.tensor(expected))


def test_aux_loss_weighting_in_output():
    config = Glm53Config.tiny(router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    model = Glm53ForCausalLM(config)
    ids = torch.randint(1, 320, (B, T))
    stats_out = model(ids, labels=ids)
    none = Glm53ForCausalLM(config.replace(router_aux_loss_coef=0.0, router_z_loss_coef=0.0))
    none.load_state_dict(model.state_dict())
    plain = none(ids, labels=ids)
    assert plain.aux_loss is None and torch.equal(plain.loss, plain.lm_loss)
    torch.testing.assert_close(stats_out.loss, stats_out.lm_loss + stats_out.aux_loss)
    assert stats_out.aux_loss > 0.5  # the balance loss is >= 1 for any routing; mean over layers x 0.5


def test_router_bias_update_direction_and_reduce_hook():
    model = Glm53ForCausalLM(Glm53Config.tiny())
    routers = model.routers()
    with torch.no_grad():
        for r in routers:
            r.e_score_correction_bias.copy_(torch.tensor([1.0, 1.0, 0, 0, 0, 0, 0, 0]))  # experts 0, 1 win
    ids = torch.randint(1, 320, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :3] = 0
    model.train()
    model(ids, attention_mask=mask)  # a training forward counts loads, labels or not
    calls = []
    model.expert_load_reduce = lambda loads: calls.append(loads.shape) or loads * 2
    loads = [r.counted_load for r in routers]
    model.update_router_bias(rate=0.01)
    assert calls == [torch.Size([3, 8])]
    for r, load in zip(routers, loads):
        assert torch.equal(load, torch.tensor([float(mask.sum())] * 2 + [0.0] * 6))  # padding not counted
        torch.testing.assert_close(r.e_score_correction_bias, torch.tensor([0.99, 0.99] + [0.01] * 6))
    model.eval()
    model(ids, labels=ids)  # evaluation forwards do not count, and the update consumed the counts
    with pytest.raises(RuntimeError, match="training forward"):
        model.update_router_bias()


# ---------------------------------------------------------------------------------------------- indexer KL
def shared_config(**kw):
    base = dict(
        layer_types=[KDA, MLA, KDA, MLA], indexer_types=["full", "full", "full", "shared"], router_aux_loss_coef=0.0
    )
    return Glm53Config.tiny(**{**base, **kw})


def capture_attention_inputs(model):
    """Record the (normed) input x of every MLA layer during the next forward."""
    seen = {}
    for i, layer in enumerate(model.model.layers):
        if not layer.is_linear:
            layer.self_attn.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0].detach()))
    return seen


def dense_pool_target(attn, x, L):
    """Per query: main attention summed over heads and within each complete pool, plus candidacy (no padding)."""
    E = attn.qk_head_dim
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).unflatten(-1, (-1, E))  # [B, T, H, E]
    k = attn.kv_b_proj(attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x))).unflatten(-1, (-1, E + attn.v_head_dim))
    k = k[..., :E]
    Bq, Tq, H, _ = q.shape
    P = Tq // L
    mass = torch.zeros(Bq, Tq, P)
    for b in range(Bq):
        for t in range(Tq):
            probs = sum(torch.softmax(k[b, : t + 1, h] @ q[b, t, h] * E**-0.5, dim=0) for h in range(H))
            for p in range(P):
                mass[b, t, p] = probs[p * L : (p + 1) * L].sum()  # positions past t have no probability
    candidate = torch.tensor([[p * L + L - 1 <= t for p in range(P)] for t in range(Tq)]).expand(Bq, Tq, P)
    return mass, candidate


def direct_index_scores(attn, x, L):
    """score(t, p) = sum_h w_h relu(q_h . key_p / sqrt(E)), with softmax-gated pool keys, written out."""
    ind = attn.indexer
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = ind.wq_b(q_resid).unflatten(-1, (ind.n_heads, ind.head_dim))
    w = ind.weights_proj(x) * ind.n_heads**-0.5
    keys = ind.k_norm(ind.wk(x))
    gate = x @ ind.index_kpool_compress_gate.T
    P = x.shape[1] // L
    pool_keys = []
    for p in range(P):
        g = gate[:, p * L : (p + 1) * L] + ind.index_kpool_compress_ape
        pool_keys.append((g.softmax(dim=1) * keys[:, p * L : (p + 1) * L]).sum(1))
    pool_keys = torch.stack(pool_keys, dim=1)  # [B, P, E]
    dots = torch.einsum("bthe,bpe->bthp", q, pool_keys) * ind.head_dim**-0.5
    return torch.einsum("bth,bthp->btp", w, dots.relu())


def direct_kl(target_masses, candidate, scores, select=None):
    mask = candidate.clone()
    if select is not None:  # sparse: the top `select` candidates by score
        masked = scores.masked_fill(~candidate, -1e30)
        top = masked.topk(select, dim=-1).indices
        mask = torch.zeros_like(candidate).scatter(-1, top, True) & candidate
    rows = []
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            m = mask[b, t]
            if not m.any():
                continue
            target = torch.stack([tm[b, t][m] / tm[b, t][m].sum() for tm in target_masses]).mean(0)
            logp = scores[b, t][m].log_softmax(0)
            rows.append((target * (target.log() - logp)).sum())
    return torch.stack(rows).mean()


@pytest.mark.parametrize("mode", ["dense", "sparse"])
@pytest.mark.parametrize("shared", [False, True], ids=["one-layer", "full+shared"])
def test_indexer_loss_matches_direct_dense_computation(mode, shared):
    kw = dict(indexer_loss_weight=0.5, indexer_loss_mode=mode)
    config = shared_config(**kw) if shared else Glm53Config.tiny(router_aux_loss_coef=0.0, **kw)
    model = Glm53ForCausalLM(config)
    randomize(model)  # peaked attention: each layer's target differs from uniform and from the others'
    seen = capture_attention_inputs(model)
    ids = torch.randint(1, 320, (B, T))
    out = model(ids, labels=ids)
    L = config.index_kpool
    full = 1 if shared else 3
    with torch.no_grad():
        masses = [dense_pool_target(model.model.layers[i].self_attn, seen[i], L)[0] for i in sorted(seen)]
        candidate = dense_pool_target(model.model.layers[full].self_attn, seen[full], L)[1]
        scores = direct_index_scores(model.model.layers[full].self_attn, seen[full], L)
        select = config.index_topk // L if mode == "sparse" else None
        expected = direct_kl(masses, candidate, scores, select)
    assert len(masses) == (2 if shared else 1)
    torch.testing.assert_close(out.indexer_loss, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.loss, out.lm_loss + 0.5 * out.indexer_loss)


def test_indexer_loss_trains_only_the_indexer_and_nothing_else_trains_it():
    config = shared_config(indexer_loss_weight=1.0, num_nextn_predict_layers=1, router_aux_loss_coef=1e-3)
    model = Glm53ForCausalLM(config)
    with torch.no_grad():  # a trained-looking indexer, so its KL is far from zero
        for name, p in model.named_parameters():
            if "indexer" in name:
                p.normal_(0, 0.5)
    ids = torch.randint(1, 320, (B, T))
    out = model(ids, labels=ids)
    assert out.indexer_loss > 1e-3
    out.indexer_loss.backward(retain_graph=True)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None or not g.any() for n, g in grads.items() if ".indexer." not in n)
    assert all(g is not None and g.any() for n, g in grads.items() if ".indexer." in n)
    model.zero_grad(set_to_none=True)
    (out.lm_loss + out.mtp_loss + out.aux_loss).backward()
    assert all(p.grad is None or not p.grad.any() for n, p in model.named_parameters() if ".indexer." in n)


def test_every_parameter_gets_a_gradient_with_all_losses_on():
    config = shared_config(indexer_loss_weight=1.0, num_nextn_predict_layers=1, mtp_depth=2, router_z_loss_coef=1e-3)
    model = Glm53ForCausalLM(config)
    model.train()
    ids = torch.randint(1, 320, (B, T))
    out = model(ids, labels=ids)
    out.loss.backward()
    for part in ("lm_loss", "mtp_loss", "aux_loss", "indexer_loss"):
        assert torch.isfinite(getattr(out, part)), part
    without = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert without == []
    torch.testing.assert_close(
        out.loss, out.lm_loss + 0.1 * out.mtp_loss + out.aux_loss + 1.0 * out.indexer_loss, rtol=1e-6, atol=0
    )


def test_training_config_validation():
    for bad, match in (
        (dict(indexer_loss_mode="topk"), "indexer_loss_mode"),
        (dict(mtp_depth=0), "mtp_depth"),
        (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers"),
        (dict(router_z_loss_coef=-1.0), "router_z_loss_coef"),
    ):
        with pytest.raises(ValueError, match=match):
            Glm53Config.tiny(**bad)


def test_attention_target_is_the_same_in_query_chunks(monkeypatch):
    import glm53.model.attention_mass as losses

    q, k = torch.randn(2, 37, 3, 8), torch.randn(2, 37, 3, 8)
    valid = torch.ones(2, 37, dtype=torch.bool)
    valid[1, :5] = False
    whole = losses.attention_pool_mass(q, k, valid, 4, 0.3)
    monkeypatch.setattr(losses, "QUERY_CHUNK", 5)
    torch.testing.assert_close(losses.attention_pool_mass(q, k, valid, 4, 0.3), whole)
    # one unit of probability per head, all of it in pools: every pool of the layout is there (ceil(37 / 4)),
    # also pool 9 (token 36 alone), incomplete in every row, which holds some of the last query's mass
    assert whole.shape == (2, 37, 10)
    torch.testing.assert_close(whole[0].sum(-1), torch.full((37,), 3.0))
    assert whole[0, 36, :9].sum() < 3.0 - 1e-3 and (whole.sum(-1) <= 3.0 + 1e-5).all()


@pytest.mark.parametrize("chunk", [3, 256], ids=["chunks-of-3", "one-chunk"])
@pytest.mark.parametrize("num_rows", [None, 7.5], ids=["own-mean", "given-count"])
def test_chunked_indexer_kl_equals_plain(chunk, num_rows, monkeypatch):
    """The chunked KL (targets and gradient one block of queries at a time) equals pool_kl on the whole
    normalised, averaged target: value and gradient of the scores."""
    import glm53.losses.parts as losses

    monkeypatch.setattr(losses, "KL_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    B, T, P = 2, 11, 5
    scores = torch.randn(B, T, P, generator=g, dtype=torch.float64).requires_grad_()
    masses = [torch.rand(B, T, P, generator=g, dtype=torch.float64) for _ in range(2)]
    mask = torch.rand(B, T, P, generator=g) < 0.6
    mask[0, 3] = False  # a query without pools
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :2] = False
    den = None if num_rows is None else torch.tensor(num_rows)
    target = torch.stack([losses.normalized_target(m, mask) for m in masses]).mean(0)
    ref = losses.pool_kl(scores, target, mask, valid, den)
    got = losses.chunked_pool_kl(scores, masses, mask, valid, den)
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=1e-7)
    cot = torch.tensor(1.7, dtype=torch.float64)
    (g_ref,), (g_got,) = torch.autograd.grad(ref, scores, cot), torch.autograd.grad(got, scores, cot)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-7)
    assert g_ref.abs().max() > 1e-3


# ----------------------------------------------------------------------------------------- losses/parts.py at its edges
B_EDGES, T_EDGES, E, K = 2, 5, 6, 2


def router_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B_EDGES * T_EDGES, E, generator=g)
    valid = torch.ones(B_EDGES, T_EDGES, dtype=torch.bool)
    valid[1, :2] = False
    return logits, logits.topk(K, dim=-1).indices, valid


@pytest.mark.parametrize("denominator", [0.25, 3.5])
def test_given_denominators_below_and_above_one_divide_exactly(denominator):
    """sum / denominator for any positive denominator (a fractional one under data parallelism), not its mean."""
    logits, indices, valid = router_case()
    den = torch.tensor(denominator)
    z_sum = z_loss(logits, valid) * valid.sum()  # the default mean times its count
    torch.testing.assert_close(z_loss(logits, valid, den), z_sum / denominator)
    balance_sum = balance_loss(logits, indices, valid) * B_EDGES  # both sequences have a valid token
    torch.testing.assert_close(balance_loss(logits, indices, valid, den), balance_sum / denominator)
    hidden = torch.randn(B_EDGES, T_EDGES, 4, generator=torch.Generator().manual_seed(1))
    head = torch.nn.Linear(4, 9, bias=False)
    labels = torch.randint(0, 9, (B_EDGES, T_EDGES), generator=torch.Generator().manual_seed(2))
    ce_sum = causal_lm_head_loss(hidden, head, labels) * B_EDGES * (T_EDGES - 1)
    torch.testing.assert_close(causal_lm_head_loss(hidden, head, labels, den), ce_sum / denominator)


def kl_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    Bk, Tk, P = 2, 7, 5
    scores = torch.randn(Bk, Tk, P, generator=g, dtype=torch.float64)
    masses = [torch.rand(Bk, Tk, P, generator=g, dtype=torch.float64) for _ in range(2)]
    mask = torch.rand(Bk, Tk, P, generator=g) < 0.7
    mask[:, :, 0] = True  # every query has a candidate pool
    for m in masses:  # query (0, 4) sees candidate pools without any attention mass
        m[0, 4] = m[0, 4].masked_fill(mask[0, 4], 0.0)
    valid = torch.ones(Bk, Tk, dtype=torch.bool)
    return scores, masses, mask, valid


def test_chunked_kl_row_without_mass_has_zero_loss_and_zero_gradient():
    scores, masses, mask, valid = kl_case()
    target = torch.stack([normalized_target(m, mask) for m in masses]).mean(0)
    assert target[0, 4].sum() == 0 and mask[0, 4].sum() >= 2
    s_ref, s_got = scores.clone().requires_grad_(), scores.clone().requires_grad_()
    ref = pool_kl(s_ref, target, mask, valid)
    got = chunked_pool_kl(s_got, masses, mask, valid)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-8)
    (g_ref,) = torch.autograd.grad(ref, s_ref)
    (g_got,) = torch.autograd.grad(got, s_got)
    assert not g_ref[0, 4].any() and not g_got[0, 4].any()
    torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-8)


def test_shared_indexer_layer_before_any_full_one_raises():
    shared = LayerStats()
    shared.pool_mass = torch.rand(1, 3, 2)
    with pytest.raises(ValueError, match="shared indexer layer recorded attention mass before any full indexer"):
        indexer_kl_terms([shared], torch.ones(1, 3, dtype=torch.bool), "dense")


def test_head_losses_check_their_inputs():
    hidden, labels = torch.randn(B_EDGES, T_EDGES, 4), torch.randint(0, 9, (B_EDGES, T_EDGES))
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 5\) like input_ids, got \(2, 4\)"):
        causal_lm_head_loss(hidden, torch.nn.Linear(4, 9, bias=False), labels[:, :4])
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 5\) like input_ids, got \(5, 2\)"):
        causal_lm_loss(torch.randn(B_EDGES, T_EDGES, 9), labels.t())
    with pytest.raises(ValueError, match="lm_head.bias"):
        head_target_loss(hidden, torch.nn.Linear(4, 9), labels)
    assert IGNORE_INDEX == -100


def test_causal_lm_loss_is_the_mean_over_kept_next_tokens():
    """Written out: position t predicts labels[t + 1]; ignored labels and the last position count nowhere."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B_EDGES, T_EDGES, 9, generator=g)
    labels = torch.randint(0, 9, (B_EDGES, T_EDGES), generator=g)
    labels[0, 2] = labels[1, 4] = IGNORE_INDEX
    terms = [
        torch.logsumexp(logits[b, t], 0) - logits[b, t, labels[b, t + 1]]
        for b in range(B_EDGES)
        for t in range(T_EDGES - 1)
        if labels[b, t + 1] != IGNORE_INDEX
    ]
    assert len(terms) == B_EDGES * (T_EDGES - 1) - 2
    torch.testing.assert_close(causal_lm_loss(logits, labels), torch.stack(terms).mean())


@pytest.mark.parametrize("bad", [-1, -5, 7, 1000])
def test_every_head_loss_rejects_a_label_outside_the_vocabulary(bad):
    """A target outside [0, vocab) that is not IGNORE_INDEX is an error naming the value and where it is, in all
    three public losses (the chunked kernel would drop it from the sum but count it; the vocab-parallel one add its
    log-sum-exp); IGNORE_INDEX and the vocabulary's edges pass."""
    from glm53.errors import InputError
    from glm53.losses import IGNORE_INDEX, causal_lm_head_loss, causal_lm_loss, head_target_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(4, 7, bias=False)
    hidden = torch.randn(2, 5, 4)
    labels = torch.tensor([[0, 6, IGNORE_INDEX, 3, 1], [2, 2, 5, IGNORE_INDEX, 6]])
    good = [
        causal_lm_loss(head(hidden), labels),
        causal_lm_head_loss(hidden, head, labels),
        head_target_loss(hidden, head, labels),
    ]
    assert all(torch.isfinite(x) and x > 0 for x in good)
    labels[1, 2] = bad
    match = rf"labels holds {bad}, outside \[0, vocab_size=7\) or -100 \(at index \(1, 2\)\)"
    with pytest.raises(InputError, match=match):
        causal_lm_loss(head(hidden), labels)
    with pytest.raises(InputError, match=match):
        causal_lm_head_loss(hidden, head, labels)
    with pytest.raises(InputError, match=match.replace("labels", "targets")):
        head_target_loss(hidden, head, labels)
    assert torch.isfinite(causal_lm_head_loss(hidden, head, labels.clamp(0, 6), check=False))
