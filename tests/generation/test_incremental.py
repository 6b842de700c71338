"""Prefill P tokens into a GenerationCache, decode N one at a time: the logits equal one full forward over P + N.

fp32, 1e-5 relative to the largest logit, on the model's own initialisation. The default tiny config is sparse
(index_topk 8, k-pool 4), so the decode steps cross pool boundaries and run past index_topk; the prompt is not a
multiple of the pool or the KDA chunk, and one row is left-padded. With unit-gain random weights (oracle.randomize)
the model amplifies fp32 rounding about 50x (the decode's recurrent KDA steps round differently from the chunked
form: ~5e-7 relative on one KDA layer's output becomes ~1e-5 on the logits), so that stress case gets 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import GenerationCache
from tests.helpers.generation import assert_matches_full, case_inputs, greedy_by_full_forward, left_padded, tiny_model

REL_TOL = 1e-5
REL_TOL_RANDOM = 1e-4  # unit-gain random weights (see the module docstring)
GLM_SHARED = dict(
    num_hidden_layers=4,
    layer_types=["indexed_attention", "linear_attention", "indexed_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "dense"],
    indexer_types=["full", "full", "shared", "full"],
)
KDA_ONLY = dict(num_hidden_layers=2, layer_types=["linear_attention"] * 2, mlp_layer_types=["dense", "sparse"])
CASES = {
    "sparse-P13-N12": dict(config={}, P=13, N=12),
    "sparse-P13-N12-random-weights": dict(config={}, P=13, N=12, random=True),
    "per-head-attention": dict(config={}, P=13, N=12, absorb=False),
    "kpool1-no-tail": dict(config=dict(index_kpool=1, index_topk=6, index_kpool_always_select_tail=False), P=9, N=10),
    # a shared layer reusing the top-k of a full layer across a KDA layer (glm53 carries it; transformers cannot)
    "shared-across-kda": dict(config=GLM_SHARED, P=11, N=9),
    "prompt-past-kda-chunk-P70": dict(config={}, P=70, N=5),
    "softplus-gate": dict(config=dict(linear_lower_bound=None), P=10, N=6),
    "kda-only": dict(config=KDA_ONLY, P=9, N=7),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_prefill_then_decode_equals_full_forward(case):
    spec = CASES[case]
    model, ids, mask, P, N = case_inputs(spec, shorter_by=4)
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache = GenerationCache(model)
        steps = [model.lm_head(model.model(ids[:, :P], mask[:, :P], cache=cache))]
        for t in range(P, P + N):
            steps.append(model.lm_head(model.model(ids[:, t : t + 1], cache=cache)))
    assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL_RANDOM if spec.get("random") else REL_TOL)
    assert cache.seq_len == P + N


def test_cache_bytes_grow_with_mla_latent_and_pools_only():
    """nbytes: KDA state is fixed, MLA adds latent (+ pooled keys) per position; per-token bytes as documented."""
    model = tiny_model()
    cfg = model.config
    ids, mask = left_padded(cfg.vocab_size, [20])
    with torch.inference_mode():
        cache = GenerationCache(model)
        model.model(ids[:, :16], mask[:, :16], cache=cache)
        before = cache.nbytes()
        for t in range(16, 20):
            model.model(ids[:, t : t + 1], cache=cache)
    n_mla = len(cfg.attention_layers)
    # per position: latent C fp32; every L positions one more pooled key E fp32 (4 steps, k-pool 4: one pool)
    expected = n_mla * 4 * cfg.kv_lora_rank * 4 + n_mla * (4 // cfg.index_kpool) * cfg.index_head_dim * 4
    assert cache.nbytes() - before == expected
    kda_state = cfg.linear_num_heads * cfg.linear_head_dim**2 * 4
    assert before > (cfg.num_hidden_layers - n_mla) * kda_state


@pytest.mark.parametrize("config", [{}, KDA_ONLY], ids=["sparse-regime", "kda-only"])
def test_generate_equals_greedy_by_full_forwards(config):
    """generate() (cache) picks the same tokens as a full forward per step: sparse regime (index_topk 8) and a model
    with only KDA layers (which transformers' generate cannot run)."""
    model = tiny_model(random_weights=False, **config)
    ids, mask = left_padded(model.config.vocab_size, [10, 7])
    assert torch.equal(model.generate(ids, mask, max_new_tokens=8), greedy_by_full_forward(model, ids, mask, 8))


def test_prefill_selects_in_query_blocks_without_a_query_by_pool_tensor(monkeypatch):
    """The prefill's top-k is the blocked kernel (3 queries per block here: many blocks over the P = 70 prompt), no
    [B, T, P] scores (Indexer.scores never runs in it); decode steps score their query against every cached pool.
    Prefill + decode still equal the full forward."""
    import glm53.kernels.indexer_topk as topk_mod
    from glm53.model.indexer import Indexer

    monkeypatch.setattr(topk_mod, "TOPK_BUDGET", 1)
    monkeypatch.setattr(topk_mod, "MIN_TOPK_CHUNK", 3)
    calls = []
    scores = Indexer.scores
    monkeypatch.setattr(
        Indexer, "scores", lambda self, x, *a, **k: calls.append(x.shape[1]) or scores(self, x, *a, **k)
    )
    spec = CASES["prompt-past-kda-chunk-P70"]
    model, ids, mask, P, N = case_inputs(spec, shorter_by=4)
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        calls.clear()
        cache = GenerationCache(model)
        steps = [model.lm_head(model.model(ids[:, :P], mask[:, :P], cache=cache))]
        assert calls == []  # the prefill made no [B, T, P] scores
        for t in range(P, P + N):
            steps.append(model.lm_head(model.model(ids[:, t : t + 1], cache=cache)))
    assert calls and set(calls) == {1}  # each decode step scores its one query
    assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL)
