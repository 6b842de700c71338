"""The compiled decode step (glm53/generation/decode_compiled.py) against one full forward, the eager step and
greedy generation.

Most cases trace with backend="aot_eager" (the graphs run as traced, no code generation: seconds); one case compiles
with inductor and its C++ wrapper (what generate(compile=True) runs: tens of seconds, once per test session) and
then generates with it. Same cases and tolerances as test_decode.py: pool boundaries, past index_topk, left
padding with rows at different pool phases, a shared top-k across KDA layers, softplus gate, KDA only.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from glm53.generation import CacheError, GenerationCache, GenerationError
from glm53.generation.decode import decode_step
from glm53.generation.decode_compiled import _PLANS, compiled_decode_step
from tests.generation.test_incremental import CASES, REL_TOL
from tests.helpers.generation import assert_matches_full, case_inputs, left_padded, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit")  # raised inside inductor's imports

# kpool 1 without the tail changes only decode.py's eager indexer code (tested in test_decode.py)
TRACED = ["sparse-P13-N12", "prompt-past-kda-chunk-P70", "per-head-attention", "shared-across-kda", "softplus-gate",
          "kda-only"]  # fmt: skip


def _prefilled(model, ids, mask, P):
    cache = GenerationCache(model)
    first = model.lm_head(model.model(ids[:, :P], mask[:, :P], cache=cache))
    return cache, first


# the inductor case: one KDA and one MLA layer (every segment kind; a C++ compile of the tiny config's four layers
# costs about twice as long on 2 cores)
INDUCTOR_CASE = dict(CASES["sparse-P13-N12"], config=dict(num_hidden_layers=2, mlp_layer_types=["sparse", "sparse"],
                                                          layer_types=["linear_attention", "indexed_attention"]))


def _compiled_logits(case: str | dict, **backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, GenerationCache]:
    """-> (the prefill's and the compiled steps' logits [B, P + N, vocab], the full forward's, mask, cache)."""
    model, ids, mask, P, N = case_inputs(CASES[case] if isinstance(case, str) else case, shorter_by=5)
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache, first = _prefilled(model, ids, mask, P)
        steps = [first] + [model.lm_head(compiled_decode_step(model, cache, ids[:, t], **backend))[:, None]
                           for t in range(P, P + N)]  # fmt: skip
    return torch.cat(steps, dim=1), full, mask, cache


@pytest.mark.parametrize("case", TRACED, ids=TRACED)
def test_traced_step_equals_full_forward(case):
    got, full, mask, cache = _compiled_logits(case, backend="aot_eager")
    assert_matches_full(got, full, mask, REL_TOL)
    assert all(bound is not None for bound in _PLANS[cache][2])  # later steps ran the graphs without dynamo


def test_inductor_step_and_generate():
    """Inductor's code (C++ wrapper) equals the full forward; generate(compile=True) picks the same greedy tokens
    as eager decoding (same model and batch: the graphs compiled above are reused, none is compiled again)."""
    got, full, mask, _ = _compiled_logits(INDUCTOR_CASE, backend="inductor", cpp_wrapper=True)
    assert_matches_full(got, full, mask, REL_TOL)
    model = case_inputs(INDUCTOR_CASE, shorter_by=5)[0]
    ids, mask = left_padded(model.config.vocab_size, [7, 5], seed=3)
    graphs = counters["stats"]["unique_graphs"]
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=12, compile=True)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(compiled, model.generate(ids, attention_mask=mask, max_new_tokens=12))


def test_eager_and_compiled_steps_interleave():
    """An eager step leaves its conv history as a view of a wider tensor and a compiled one writes its own copy in
    place: alternating them still equals the full forward, and no step after the first compiles a graph."""
    model = tiny_model(random_weights=False)  # the config and batch of the cases above: their graphs
    P, N = 9, 10
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 7])
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache, first = _prefilled(model, ids, mask, P)
        steps = [first]
        for t in range(P, P + N):
            step = decode_step if t % 3 == 1 else lambda *a: compiled_decode_step(*a, backend="aot_eager")
            steps.append(model.lm_head(step(model, cache, ids[:, t]))[:, None])
            if t == P:
                graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL)
    assert cache.seq_len == P + N


def test_compiled_step_bad_input():
    model = tiny_model()
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    with torch.inference_mode():
        with pytest.raises(CacheError, match="prefilled"):
            compiled_decode_step(model, GenerationCache(model), ids[:, 0], backend="aot_eager")
        cache, _ = _prefilled(model, ids, mask, 6)
        with pytest.raises(CacheError, match=r"ids of shape \(2,\)"):
            compiled_decode_step(model, cache, ids[:1, 0], backend="aot_eager")
        cache.mark()
        with pytest.raises(CacheError, match="marked"):
            compiled_decode_step(model, cache, ids[:, 0], backend="aot_eager")
    with pytest.raises(GenerationError, match="compile must be"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, compile="no-such-backend")
    with torch.inference_mode():
        cache = GenerationCache(model)
        model.model(ids, mask, cache=cache)
    with pytest.raises(GenerationError, match="backend must be a torch.compile backend name.*'nonsense'"):
        compiled_decode_step(model, cache, ids[:, -1], backend="nonsense")


def test_compile_without_a_cpp_compiler_decodes_eagerly(monkeypatch):
    """generate(compile=True) where inductor finds no C++ compiler warns and decodes with the eager step."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-c++-compiler",))
    model = tiny_model()
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, compile=True)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=3))


def test_compiled_step_after_weights_change_uses_the_new_weights():
    """The bound graphs read the plan's weights: after an in-place update or a replaced storage between two
    generations (an optimizer step, load_state_dict, `param.data = ...`), a new cache decodes with the new weights."""
    model = tiny_model(random_weights=False)
    P, N = 9, 4
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 3])

    def check():
        with torch.inference_mode():
            full = model(ids, attention_mask=mask).logits
            cache, first = _prefilled(model, ids, mask, P)
            steps = [first] + [model.lm_head(compiled_decode_step(model, cache, ids[:, t], backend="aot_eager"))[:, None]
                               for t in range(P, P + N)]  # fmt: skip
        assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL)

    check()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i % 2:
                p.mul_(1.0 + 0.01 * (i % 7))
            else:
                p.data = p.data * (1.0 + 0.01 * (i % 5))
    check()
