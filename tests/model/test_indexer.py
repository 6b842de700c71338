"""One tie rule for the indexer's pool choice: exactly tied scores go to the earliest pool, everywhere (full
forward with the fused top-k kernel and with the materialised scores, packed documents, batched rows, cached
prefill, decode and verify steps, compiled or eager). ReLU scores tie exactly at 0 often (few indexer heads), and
torch.topk's order among ties is unspecified and depends on the number of pools ranked.

Legend: B batch, T time, P pools, L tokens per pool, J selected key slots.

The indexer's differentiable scores (`Indexer.score_and_select(..., grad=True)`, what the indexer KL loss
trains on) against transformers' index scores, and where their gradient goes.

Legend: B batch, T time, P pools, L tokens per pool.
The top-k tests in test_blocks.py compare selections only, which a positive rescaling of the scores (a dropped
K^-0.5 or H^-0.5) leaves unchanged; the KL loss reads the values. The oracle is built from transformers' own
projections and `get_pooled_states`, over its pool axis (pools complete in some row).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.models.glm5_next.modeling_glm5_next as hf

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.generation import GenerationCache, step
from glm53.kernels import use_backend
from glm53.kernels.indexer_topk import indexer_topk_pools, indexer_topk_pools_reference, rank_pools
from glm53.model.indexer import Indexer, select_pools
from tests.helpers.oracle import randomize
from tests.model.test_blocks import padding, pair

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rank_pools_breaks_ties_toward_the_earliest_pool(dtype):
    scores = torch.tensor([[0.0, 2.0, 0.0, 2.0, 1.0, 0.0, 0.0]], dtype=DTYPES[dtype])
    assert rank_pools(scores, 4).tolist() == [[1, 3, 4, 0]]
    assert rank_pools(torch.zeros(1, 9, dtype=DTYPES[dtype]), 3).tolist() == [[0, 1, 2]]


def test_fused_and_reference_kernels_pick_the_earliest_tied_pools():
    """All scores tie (zero queries): both kernels pick each query's earliest visible complete pools."""
    B, T, H, K, P, select = 2, 12, 2, 4, 6, 2
    q = torch.zeros(B, T, H, K)
    w = torch.randn(B, T, H)
    keys = torch.randn(B, P, K)
    pool_end = torch.arange(P).repeat(B, 1) * 2 + 1  # pools of 2 tokens
    complete = torch.ones(B, P, dtype=torch.bool)
    for kernel in (indexer_topk_pools, indexer_topk_pools_reference):
        chosen, ok = kernel(q, w, keys, 0.5, pool_end, complete, 0, select)
        for t in range(T):
            visible = [p for p in range(P) if 2 * p + 1 <= t][:select]
            assert chosen[0, t][ok[0, t]].tolist() == visible


def tie_model(seed: int, dtype: torch.dtype = torch.float32, zero_queries: bool = False) -> Glm53ForCausalLM:
    """Two indexer heads (ReLU sums tie at 0 often); `zero_queries`: every score is exactly 0 (all pools tie)."""
    config = Glm53Config.tiny(
        index_n_heads=2,
        index_topk=8,
        index_kpool=2,
        layer_types=["indexed_attention", "linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse", "dense"],
        indexer_types=["full", "full", "shared"],
        num_hidden_layers=3,
    )
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(config).eval()
    randomize(model, seed)
    if zero_queries:
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "wq_b") and hasattr(m, "kpool"):
                    m.wq_b.weight.zero_()
    return model.to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# fp32: the forwards compute the same sums in different groupings (chunked vs recurrent KDA, fused vs materialised
# scores): ~1e-6 relative on the logits after 3 layers (fp32 eps 1.2e-7 x ~10 rounding steps); a different key
# choice moves the logits by O(1e-1). bf16: 8 mantissa bits, eps 3.9e-3, a few roundings -> 5e-2, still below it.
TOL = {"fp32": 2e-5, "bf16": 5e-2}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("zero", [False, True], ids=["relu-ties", "all-tied"])
def test_cached_decode_and_verify_equal_the_full_forward_with_ties(dtype, zero):
    """Prefill + decode steps + a verify step read the same keys as one full forward, over seeds where 2-head ReLU
    scores tie (the issue: 2 of 6 seeds disagreed under torch.topk)."""
    for seed in range(6):
        model = tie_model(seed, DTYPES[dtype], zero)
        ids = torch.randint(1, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        with torch.inference_mode():
            full = model(ids, attention_mask=mask).logits
            cache = GenerationCache(model)
            got = [model.lm_head(step(model, cache, ids[:, :11], mask[:, :11].bool()))]
            got += [model.lm_head(step(model, cache, ids[:, t : t + 1])) for t in range(11, 17)]
            got.append(model.lm_head(step(model, cache, ids[:, 17:])))
        got = torch.cat(got, dim=1)
        valid = mask.bool()
        assert _rel(got[valid], full[valid]) <= TOL[dtype], seed


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("zero", [False, True], ids=["relu-ties", "all-tied"])
def test_packed_equals_documents_alone_with_ties(dtype, zero):
    """model(ids, cu_seqlens) equals each document alone (and a batch of them) when scores tie; the fused top-k
    kernel and the materialised scores ("reference" backend) agree too."""
    lengths = [13, 9, 17]
    for seed in range(4):
        model = tie_model(seed, DTYPES[dtype], zero)
        docs = [
            torch.randint(1, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed + n))
            for n in lengths
        ]
        cu = torch.tensor([0, 13, 22, 39])
        with torch.inference_mode():
            packed = model(torch.cat(docs, dim=1), cu_seqlens=cu).logits[0]
            alone = torch.cat([model(d).logits[0] for d in docs])
            with use_backend("reference", ["indexer_topk_pools"]):
                alone_ref = torch.cat([model(d).logits[0] for d in docs])
            padded = torch.zeros(3, 17, dtype=torch.long)
            pmask = torch.zeros(3, 17, dtype=torch.long)
            for i, d in enumerate(docs):
                padded[i, 17 - d.shape[1] :], pmask[i, 17 - d.shape[1] :] = d[0], 1
            batched = model(padded, attention_mask=pmask).logits[pmask.bool()]
        assert _rel(packed, alone) <= TOL[dtype], seed
        assert _rel(alone_ref, alone) <= TOL[dtype], seed
        assert _rel(batched, alone) <= TOL[dtype], seed


def test_select_pools_ties_do_not_depend_on_the_pool_count():
    """The same query row with more (never-candidate) pools after it picks the same pools (torch.topk did not)."""
    scores = torch.zeros(1, 1, 40)
    scores[0, 0, :6] = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    L, topk = 2, 8  # 4 pools per query
    for P in (6, 40):
        positions = (torch.arange(P)[:, None] * L + torch.arange(L)).unsqueeze(0)  # [1, P, L]
        complete = torch.ones(1, P, dtype=torch.bool)
        valid = torch.ones(1, 2 * P, dtype=torch.bool)
        chosen = select_pools(scores[..., :P], positions, complete, valid, None, 11, topk, L, False)[0]
        # the query at position 11 sees pools 0..5: scores 1 at pools 1, 4, then the earliest zeros 0, 2
        assert sorted(chosen[0, 0].tolist()) == [0, 1, 2, 3, 4, 5, 8, 9], P


# ----------------------------------------------------------------------------- differentiable scores and their gradient
def _transformers_scores(theirs, x, q_resid, mask):
    """[B, T, P'] index scores before any masking, as Glm5NextTextIndexer.forward computes them."""
    B, T = x.shape[:2]
    q = theirs.wq_b(q_resid).view(B, T, -1, theirs.head_dim)
    k = theirs.k_norm(theirs.wk(x))
    packed = torch.cat([k, F.linear(x, theirs.index_kpool_compress_gate), mask.to(k.dtype)[..., None]], dim=-1)
    pool_keys, _, _ = theirs.get_pooled_states(packed_states=packed)
    logits = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * theirs.softmax_scale)
    weights = theirs.weights_proj(x).float() * theirs.n_heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), logits).squeeze(-2)


@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_scores_with_gradient_equal_transformers_and_train_the_indexer_only(pad):
    T = 19  # pools of 4: the last one incomplete in every row
    config = Glm53Config.tiny(index_topk=8)
    ours, theirs = pair(config, hf.Glm5NextTextIndexer, Indexer, 3)
    x = torch.randn(2, T, config.hidden_size, requires_grad=True)
    q_resid = torch.randn(2, T, config.q_lora_rank, requires_grad=True)
    mask = padding(2, T, pad)
    _, scores, candidate, _ = ours.score_and_select(x, q_resid, mask, grad=True)
    _, _, complete = ours.pools(x, mask)
    keep = complete.any(0)
    with torch.no_grad():
        expected = _transformers_scores(theirs, x, q_resid, mask)
    assert scores.shape == (2, T, keep.numel()) and expected.shape == (2, T, int(keep.sum()))
    torch.testing.assert_close(scores[..., keep], expected, rtol=1e-5, atol=1e-6)
    assert candidate[..., ~keep].sum() == 0
    # the KL loss's gradient reaches the indexer's parameters and nothing upstream of it
    scores[candidate].sum().backward()
    assert x.grad is None and q_resid.grad is None
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_packed_selection_breaks_ties_to_the_lowest_pool():
    """All scores tied (ReLU scores are 0 often): a packed query picks its document's lowest candidate pools, so
    its choice does not depend on the other rows' pool counts (torch.topk's order among ties does)."""
    from glm53.model.indexer import kept_pools, select_pools

    kpool, topk, T = 2, 4, 24  # 2 pools per query
    valid = torch.ones(2, T, dtype=torch.bool)
    cu = torch.tensor([0, 13, 24, 48])  # row 0: documents of 13 and 11 tokens; row 1: one document of 24
    positions, complete = kept_pools(valid, kpool, cu)
    scores = torch.zeros(2, T, positions.shape[1])
    chosen, candidate, _ = select_pools(scores, positions, complete, valid, cu, 0, topk, kpool, False)
    for b, t in [(0, 12), (0, 23), (1, 23), (1, 9)]:
        doc_start = 13 if (b, t) == (0, 23) else 0
        first = sorted(i for i in chosen[b, t].tolist() if i >= 0)
        assert first == list(range(doc_start, doc_start + topk)), (b, t, first)


# ------------------------------------------------------------------------------------ when a pool becomes a candidate
@pytest.mark.parametrize("offset", [0, 5])
def test_a_pool_becomes_a_candidate_at_its_last_token(offset):
    """Pool p (tokens p*L .. p*L + L-1) is a candidate from query p*L + L-1 on: not one token early (its last key not
    yet visible) nor one late. Checked on the model's selection (select_pools) and on both top-k kernels, at query
    offset 0 (prefill) and 5 (a cache's later rows). Left padding shifts the pools of the padded row."""
    from glm53.model.indexer import kept_pools

    L, S, pad = 4, 19, 2
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[1, :pad] = False
    positions, complete = kept_pools(valid, L, None)
    P, T = positions.shape[1], S - offset
    t = torch.arange(offset, S)[:, None]
    first = torch.tensor([0, pad])[:, None, None]  # each row's first valid token
    last_token = first + (torch.arange(P)[None, None] + 1) * L - 1  # [B, 1, P]
    expected = (last_token <= t[None]) & (last_token < S)
    scores = torch.zeros(2, T, P)
    _, candidate, _ = select_pools(scores, positions, complete, valid, None, offset, 4 * L, L, False)
    assert torch.equal(candidate, expected)
    q, w = torch.randn(2, T, 2, 8), torch.randn(2, T, 2)
    pool_keys = torch.randn(2, P, 8)
    pool_end = positions[..., -1].clamp(0, S - 1)
    for topk in (indexer_topk_pools_reference, indexer_topk_pools):
        chosen, ok = topk(q, w, pool_keys, 8**-0.5, pool_end, complete, offset, P)
        assert torch.equal(torch.zeros_like(expected).scatter_(-1, chosen, ok), expected), topk.__name__
