"""The T-token verify step (glm53/generation/verify.py) against one full forward, with marks and rewinds, and the
MTP layer's T-token step against its own cached forward.

Prefill P tokens through `model.model(..., cache=cache)`, then `verify_step` chunks of T tokens: the logits equal
one full forward over P + N at test_incremental.py's tolerances, on its cases (sparse regime past index_topk, k-pool
boundaries, left padding with rows at different pool phases, shared top-k across KDA, softplus gate, KDA only).
With k-pool 4 and T = 2, 3, 4 some pool completes strictly inside a chunk (checked), so a pool filled mid-verify must
be a candidate for the later queries of the chunk only.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import CacheError, GenerationCache
from glm53.generation.decode import decode_step
from glm53.generation.verify import build_mtp_plan, mtp_tokens, verify_step
from glm53.model.context import ForwardContext
from tests.generation.test_incremental import CASES, GLM_SHARED, KDA_ONLY, REL_TOL, REL_TOL_RANDOM
from tests.helpers.generation import assert_matches_full, case_inputs, left_padded, tiny_model, verify_rewind_decode

VERIFY_CASES = {f"{case}-T{T}": (case, T) for case in CASES for T in (2, 3)}
VERIFY_CASES["sparse-P13-N12-T4"] = ("sparse-P13-N12", 4)


def _pool_ends_inside_a_chunk(mask: torch.Tensor, L: int, P: int, N: int, T: int) -> bool:
    """Some row completes a k-pool at a position that is neither the first nor the last of its chunk."""
    for first in (mask.shape[1] - mask.sum(-1)).tolist():
        for t in range(P, P + N):
            inside = (t - P) % T not in (0, T - 1) and t + 1 < P + N
            if inside and (t - first + 1) % L == 0:
                return True
    return False


@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=list(VERIFY_CASES))
def test_verify_step_equals_full_forward(case):
    name, T = VERIFY_CASES[case]
    spec = CASES[name]
    model, ids, mask, P, N = case_inputs(spec, shorter_by=5)
    if name.startswith("sparse") and T > 2:
        assert _pool_ends_inside_a_chunk(mask, model.config.index_kpool, P, N, T)
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache = GenerationCache(model)
        steps = [model.lm_head(model.model(ids[:, :P], mask[:, :P], cache=cache))]
        steps += [model.lm_head(verify_step(model, cache, ids[:, t : min(t + T, P + N)])) for t in range(P, P + N, T)]
    assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL_RANDOM if spec.get("random") else REL_TOL)
    assert cache.seq_len == P + N


@pytest.mark.parametrize("config", [{}, KDA_ONLY, GLM_SHARED], ids=["sparse", "kda-only", "shared-across-kda"])
def test_rewind_after_a_verify_with_wrong_tokens(config):
    """mark, verify the true next tokens followed by wrong ones, rewind to the true ones: the cache continues as if
    the wrong tokens were never seen (KDA states, conv history, pools and host counts), through later verify and
    decode steps, across pool boundaries; the logits of the kept tokens equal the full forward."""
    model = tiny_model(random_weights=False, **config)
    plan = [(1, 2), (3, 0), (2, 1), (1, 3), (4, 0), (2, 2)]  # kept true tokens, then wrong ones (none: keep all)
    cache, got, full, mask = verify_rewind_decode(model, lambda c, chunk: verify_step(model, c, chunk),
                                                  lambda c, ids: decode_step(model, c, ids), plan, P=9, N=14)
    assert_matches_full(got, full, mask, REL_TOL)
    assert cache.seq_len == 9 + 14


def test_mtp_tokens_equal_the_layer_forward():
    """The MTP layer's T-token step (the output at its last position) equals MTPLayer.forward there, for T = 1, 2, 3
    in turn (its own indexer past index_topk and across pool boundaries), marked and rewound like a draft."""
    model = tiny_model(random_weights=False, num_nextn_predict_layers=1, index_topk=4)
    layer = model.mtp.layer_for(1)
    P, N = 10, 12
    ids, mask = left_padded(model.config.vocab_size, [P + N + 1, P + N - 2])
    D = model.config.hidden_size
    hidden = torch.randn(2, P + N, D, generator=torch.Generator().manual_seed(3))
    valid = mask.bool()[:, : P + N]
    with torch.inference_mode():
        full = layer(hidden, model.model.embed_tokens(ids[:, 1:]), ForwardContext(valid=valid))
        cache = GenerationCache(model, part="mtp")
        prompt = ForwardContext(valid=valid[:, :P], cache=cache)
        layer(hidden[:, :P], model.model.embed_tokens(ids[:, 1 : P + 1]), prompt)
        plan = build_mtp_plan(model, layer, cache)
        got, want, t = [], [], P
        for T in (1, 2, 3, 1, 2, 3):
            cache.mark()
            got.append(mtp_tokens(plan, hidden[:, t : t + T], ids[:, t + 1 : t + T + 1]))
            cache.rewind(T)
            t += T
            want.append(full[:, t - 1 : t])
    assert t == P + N
    got, want = torch.cat(got, dim=1), torch.cat(want, dim=1)
    err = (got - want).abs().max().item()
    assert err <= REL_TOL * want.abs().max().item(), f"max abs error {err:.3e}"


def test_verify_step_bad_ids():
    model = tiny_model()
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    with torch.inference_mode():
        cache = GenerationCache(model)
        model.model(ids, mask, cache=cache)
        for bad in (ids[:1, :2], ids[:, :0], ids[:, 0]):
            with pytest.raises(CacheError, match=r"ids of shape \(2, T\)"):
                verify_step(model, cache, bad)
        with pytest.raises(CacheError, match="prefilled"):
            verify_step(model, GenerationCache(model), ids[:, :2])
