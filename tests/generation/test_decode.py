"""The T = 1 decode step (glm53/generation/decode.py) against one full forward and against the generic cached path.

Prefill P tokens through `model.model(..., cache=cache)`, then `decode_step` N tokens: the logits equal one full
forward over P + N tokens at the same tolerances as test_incremental.py (same cases: sparse regime, pool
boundaries, past index_topk, left padding with rows at different pool phases, shared top-k across KDA, softplus
gate, KDA only). After the steps the cache is the generic path's cache: a generic step can follow a fast one.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import CacheError, GenerationCache
from glm53.generation.decode import decode_step
from tests.generation.test_incremental import CASES, REL_TOL, REL_TOL_RANDOM
from tests.helpers.generation import assert_matches_full, case_inputs, left_padded, tiny_model


def _prefilled(model, ids, mask, P):
    cache = GenerationCache(model)
    first = model.lm_head(model.model(ids[:, :P], mask[:, :P], cache=cache))
    return cache, first


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_decode_step_equals_full_forward(case):
    spec = CASES[case]
    model, ids, mask, P, N = case_inputs(spec, shorter_by=5)
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache, first = _prefilled(model, ids, mask, P)
        steps = [first] + [model.lm_head(decode_step(model, cache, ids[:, t]))[:, None] for t in range(P, P + N)]
    assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL_RANDOM if spec.get("random") else REL_TOL)
    assert cache.seq_len == P + N


def test_generic_step_continues_a_fast_one():
    """Fast steps leave the cache exactly as the generic path would (lengths, host counts, pools, conv history):
    alternating the two paths still equals the full forward, and the cache holds the same bytes."""
    model = tiny_model(random_weights=False)
    P, N = 9, 10
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 2, P + N - 7])
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache, first = _prefilled(model, ids, mask, P)
        generic, _ = _prefilled(model, ids, mask, P)
        steps = [first]
        for t in range(P, P + N):
            if t % 2:
                steps.append(model.lm_head(decode_step(model, cache, ids[:, t]))[:, None])
            else:
                steps.append(model.lm_head(model.model(ids[:, t : t + 1], cache=cache)))
            model.model(ids[:, t : t + 1], cache=generic)
    got = torch.cat(steps, dim=1)
    valid = mask.bool()
    assert (got - full)[valid].abs().max().item() <= REL_TOL * full[valid].abs().max().item()
    assert cache.nbytes() == generic.nbytes()
    for ours, ref in zip(cache._layers.values(), generic._layers.values()):
        assert ours.length == ref.length
        if hasattr(ours, "counts_host"):
            assert ours.counts_host == ref.counts_host == ref.count.tolist()
            assert torch.equal(ours.pools.count, ref.pools.count)
            assert torch.equal(ours.pools.partial_count, ref.pools.partial_count)
        else:
            torch.testing.assert_close(ours.conv, ref.conv, rtol=1e-5, atol=1e-6)  # inputs differ by rounding


def test_decode_step_bad_cache():
    model, other = tiny_model(), tiny_model(seed=2)
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    with torch.inference_mode():
        with pytest.raises(CacheError, match="prefilled"):
            decode_step(model, GenerationCache(model), ids[:, 0])
        cache, _ = _prefilled(model, ids, mask, 6)
        with pytest.raises(CacheError, match="another model"):
            decode_step(other, cache, ids[:, 0])
        with pytest.raises(CacheError, match=r"ids of shape \(2,\)"):
            decode_step(model, cache, ids[:1, 0])
        cache.mark()
        with pytest.raises(CacheError, match="marked"):
            decode_step(model, cache, ids[:, 0])


# latent_dtype -> (bytes saved per latent row of width Z against fp32, the largest logit change relative to the
# logits' scale): bf16 rounds to 8 mantissa bits, int8 to 1/254 of each row's absmax
NARROW = {torch.bfloat16: (lambda Z: 2 * Z, 5e-3), torch.int8: (lambda Z: 3 * Z - 4, 1e-2)}


@pytest.mark.parametrize("dtype", list(NARROW), ids=["bf16", "int8"])
def test_narrow_latent_cache(dtype):
    """latent_dtype on an fp32 model: fewer bytes per latent row, logits moved by the rounding only (not exact: well
    above fp32 rounding, well below the logits' scale)."""
    model = tiny_model(random_weights=False)
    cfg = model.config
    P, N = 12, 8
    ids, mask = left_padded(cfg.vocab_size, [P + N, P + N - 3])
    caches, logits = {}, {}
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        for key in (None, dtype):
            cache = caches[key] = GenerationCache(model, latent_dtype=key)
            model.model(ids[:, :P], mask[:, :P], cache=cache)
            logits[key] = torch.stack([model.lm_head(decode_step(model, cache, ids[:, t])) for t in range(P, P + N)], 1)
        generic = GenerationCache(model, latent_dtype=dtype)  # the generic cached path reads the same rows
        model.model(ids[:, :P], mask[:, :P], cache=generic)
        generic_logits = torch.cat([model.lm_head(model.model(ids[:, t : t + 1], cache=generic))
                                    for t in range(P, P + N)], 1)  # fmt: skip
    saved, bound = NARROW[dtype]
    n_mla = len(cfg.attention_layers)
    assert caches[None].nbytes() - caches[dtype].nbytes() == n_mla * ids.shape[0] * (P + N) * saved(cfg.kv_lora_rank)
    scale = full.abs().max().item()
    exact = (logits[None] - full[:, P:]).abs().max().item()
    rounded = (logits[dtype] - full[:, P:]).abs().max().item()
    assert exact <= REL_TOL * scale < rounded <= bound * scale
    assert (generic_logits - logits[dtype]).abs().max().item() <= REL_TOL * scale


def test_bad_latent_dtype():
    with pytest.raises(CacheError, match="latent_dtype"):
        GenerationCache(tiny_model(), latent_dtype=torch.int16)


def test_decode_after_weights_change_in_place_uses_the_new_weights():
    """Derived decode constants (stacked projections, norm scales) are kept per module across caches: an optimizer
    step or load_state_dict between two generations changes the weights in place, and the next decode must read
    the new ones, not the stacked copies of the old."""
    model = tiny_model(random_weights=False)
    P, N = 9, 4
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 3])
    with torch.inference_mode():
        cache, _ = _prefilled(model, ids, mask, P)
        decode_step(model, cache, ids[:, P])  # builds the derived weights from the current parameters
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i % 2:
                p.mul_(1.0 + 0.01 * (i % 7))
            else:  # new storage, as `param.data = ...` or assigning loads do
                p.data = p.data * (1.0 + 0.01 * (i % 5))
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache, first = _prefilled(model, ids, mask, P)
        steps = [first] + [model.lm_head(decode_step(model, cache, ids[:, t]))[:, None] for t in range(P, P + N)]
    assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL)
