"""MTP speculative decoding through the compiled verify step (glm53/generation/verify_compiled.py) and the compiled
MTP draft step (mtp_compiled.py): the same tokens as plain greedy decoding, acceptance 1.0 with an exact draft, a
cache rewound after a partial acceptance that continues as the full forward, the draft step equal to the MTP
layer's own forward.

The cases trace with backend="aot_eager" (the graphs run as traced, no code generation: seconds); one compiles the
verify step with inductor and its C++ wrapper (what generate(compile=True) runs; two graphs, tens of seconds).
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import GenerationCache, GenerationError
from glm53.generation.decode import decode_step
from glm53.generation.decode_compiled import compiled_decode_step
from glm53.generation.mtp_compiled import compiled_mtp_tokens
from glm53.generation.verify import build_mtp_plan
from glm53.generation.verify_compiled import _PLANS, compiled_verify_step
from glm53.model.context import ForwardContext
from tests.generation.test_decode_compiled import INDUCTOR_CASE
from tests.generation.test_incremental import REL_TOL
from tests.generation.test_speculative import NEW, greedy_run, oracle_mtp_model  # noqa: F401 (greedy_run: fixture)
from tests.helpers.generation import assert_matches_full, left_padded, tiny_model, verify_rewind_decode

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit")

BACKEND = "aot_eager"


@pytest.mark.parametrize("k", [1, 2, 3])
def test_compiled_speculative_equals_greedy(greedy_run, k):  # noqa: F811
    """Sparse regime (prompt and continuation past index_topk 8, across k-pool boundaries), a left-padded batch, a
    per-row EOS: the compiled speculative output equals plain greedy (as the eager one does: test_speculative.py)."""
    model, ids, mask, eos, plain = greedy_run
    fast, stats = model.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, speculative="mtp",
                                 num_speculative_tokens=k, return_stats=True, compile=BACKEND)  # fmt: skip
    assert torch.equal(fast, plain)
    assert stats.drafted > 0 and 0.0 <= stats.acceptance_rate <= 1.0


@pytest.mark.parametrize("k", [1, 3])
def test_compiled_acceptance_is_one_with_an_exact_draft_model(k):
    model = oracle_mtp_model(index_topk=8)  # greedy_run's config: the graphs traced above serve it
    ids, mask = left_padded(model.config.vocab_size, [9, 5], seed=3)
    plain = model.generate(ids, mask, max_new_tokens=NEW)
    fast, stats = model.generate(ids, mask, max_new_tokens=NEW, speculative="mtp", num_speculative_tokens=k,
                                 return_stats=True, compile=BACKEND)  # fmt: skip
    assert torch.equal(fast, plain)
    assert stats.acceptance_rate == 1.0
    assert stats.verify_forwards == -(-(NEW - 1) // (k + 1))


def test_compiled_speculative_per_head_attention():
    """The per-head (not absorbed) attention in the verify and draft steps (their eager MLA parts differ)."""
    model = tiny_model(num_nextn_predict_layers=1)
    model.set_numerics(mla_absorb=False)
    ids, mask = left_padded(model.config.vocab_size, [9, 6], seed=5)
    plain = model.generate(ids, mask, max_new_tokens=NEW)
    fast = model.generate(ids, mask, max_new_tokens=NEW, speculative="mtp", num_speculative_tokens=2, compile=BACKEND)
    assert torch.equal(fast, plain)


def _verify_rewind_decode(model, decode, **backend) -> GenerationCache:
    """mark, verify (compiled) the true next tokens followed by wrong ones, rewind to the true ones (T = 3: one set
    of graphs), then `decode` the rest one token at a time: the logits equal the full forward's -> the cache."""
    plan = [(1, 2), (3, 0), (2, 1), (1, 2), (2, 1)]  # T = 3 throughout: one set of graphs
    verify = lambda c, chunk: compiled_verify_step(model, c, chunk, **backend)  # noqa: E731
    cache, got, full, mask = verify_rewind_decode(model, verify, lambda c, ids: decode(model, c, ids), plan, P=9, N=14)
    assert_matches_full(got, full, mask, REL_TOL)
    assert cache.seq_len == 9 + 14
    return cache


def test_rewind_after_a_compiled_verify_with_wrong_tokens():
    """The cache after compiled verifies and partial rewinds continues as the full forward (KDA states and conv
    histories from the graphs' outputs, pools, host counts), through compiled decode steps, across pool boundaries;
    every segment runs its bound graph."""
    model = tiny_model(random_weights=False)
    cache = _verify_rewind_decode(model, lambda *a: compiled_decode_step(*a, backend=BACKEND), backend=BACKEND)
    assert all(b is not None for bound in _PLANS[cache][2].values() for b in bound)


def test_inductor_verify_and_rewind():
    """Inductor's code (C++ wrapper, what generate(compile=True) runs) for the verify step, one KDA and one MLA
    layer (test_decode_compiled.py's inductor config), with partial rewinds, then eager decode steps."""
    model = tiny_model(random_weights=False, **INDUCTOR_CASE["config"])
    _verify_rewind_decode(model, decode_step, backend="inductor", cpp_wrapper=True)


def test_compiled_mtp_step_equals_the_layer_forward():
    """The compiled MTP step (the output at the last position, its draft) equals MTPLayer.forward there and the
    argmax of lm_head(shared_head.norm(.)), for T = 1, 2, 3 in turn (its own indexer past index_topk and across pool
    boundaries), marked and rewound like a draft."""
    model = tiny_model(random_weights=False, num_nextn_predict_layers=1, index_topk=4)
    layer = model.mtp.layer_for(1)
    P, N = 10, 12
    ids, mask = left_padded(model.config.vocab_size, [P + N + 1, P + N - 2])
    hidden = torch.randn(2, P + N, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    valid = mask.bool()[:, : P + N]
    with torch.inference_mode():
        full = layer(hidden, model.model.embed_tokens(ids[:, 1:]), ForwardContext(valid=valid))
        cache = GenerationCache(model, part="mtp")
        layer(hidden[:, :P], model.model.embed_tokens(ids[:, 1 : P + 1]), ForwardContext(valid=valid[:, :P],
                                                                                         cache=cache))  # fmt: skip
        plan = build_mtp_plan(model, layer, cache)
        got, drafts, want, t = [], [], [], P
        for T in (1, 2, 3, 1, 2, 3):
            cache.mark()
            h, d = compiled_mtp_tokens(model, layer, plan, hidden[:, t : t + T], ids[:, t + 1 : t + T + 1],
                                       backend=BACKEND)  # fmt: skip
            got.append(h)
            drafts.append(d)
            cache.rewind(T)
            t += T
            want.append(full[:, t - 1 : t])
        got, want = torch.cat(got, dim=1), torch.cat(want, dim=1)
        picks = model.lm_head(layer.shared_head.norm(want)).argmax(-1)
    assert t == P + N
    err = (got - want).abs().max().item()
    assert err <= REL_TOL * want.abs().max().item(), f"max abs error {err:.3e}"
    assert torch.equal(torch.stack(drafts, dim=1), picks)
    first, second = plan.compiled["first"], plan.compiled["second"]
    assert sorted(first) == [1, 2, 3] and all(b[0] is not None for b in [*first.values(), second])


def test_compiled_speculative_bad_compile_option():
    model = tiny_model(num_nextn_predict_layers=1)
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    with pytest.raises(GenerationError, match="compile must be"):
        model.generate(ids, mask, max_new_tokens=2, speculative="mtp", compile="no-such-backend")
