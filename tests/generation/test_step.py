"""The generation step (glm53/generation/step.py) against one full forward: decode (T = 1), verify (T = k + 1) with
marks and rewinds, the MTP draft step, and the compiled step.

Prefill P tokens, then steps: the logits equal one full forward over P + N at test_incremental.py's tolerances, on
its cases (sparse regime past index_topk, k-pool boundaries, left padding with rows at different pool phases, shared
top-k across KDA, softplus gate, KDA only). With k-pool 4 and T = 3, 4 some pool completes strictly inside a chunk
(checked), so a pool filled mid-verify must be a candidate for the later queries of the chunk only.

Edges of the T = 1 decode step (generation/step.py) the main cases do not reach: a bf16 model (the KDA gate
adds dt_bias outside the f_b linear when the weights are not fp32) and an indexer that does not always select the
tail of the pool being filled (k-pool 4).

Legend (glm53/model/__init__.py): B batch, P prompt tokens, N new tokens.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import CacheError, GenerationCache, Stepper, step
from glm53.generation.step import CAPACITY_BUCKET
from glm53.model.context import ForwardContext
from tests.generation.test_incremental import CASES, GLM_SHARED, KDA_ONLY, REL_TOL, REL_TOL_RANDOM
from tests.helpers.generation import assert_matches_full, case_inputs, left_padded, tiny_model, verify_rewind_decode

VERIFY_CASES = {f"{case}-T{T}": (case, T) for case in CASES for T in (1, 3)}
VERIFY_CASES["sparse-P13-N12-T4"] = ("sparse-P13-N12", 4)


def _pool_ends_inside_a_chunk(mask: torch.Tensor, L: int, P: int, N: int, T: int) -> bool:
    """Some row completes a k-pool at a position that is neither the first nor the last of its chunk."""
    for first in (mask.shape[1] - mask.sum(-1)).tolist():
        for t in range(P, P + N):
            inside = (t - P) % T not in (0, T - 1) and t + 1 < P + N
            if inside and (t - first + 1) % L == 0:
                return True
    return False


def _steps(model, ids, mask, P, N, T, stepper=step, max_length=None):
    cache = GenerationCache(model, max_length=max_length)
    out = [model.lm_head(stepper(model, cache, ids[:, :P], mask[:, :P].bool()))]
    out += [model.lm_head(stepper(model, cache, ids[:, t : min(t + T, P + N)])) for t in range(P, P + N, T)]
    return cache, torch.cat(out, dim=1)


@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=list(VERIFY_CASES))
def test_steps_equal_full_forward(case):
    name, T = VERIFY_CASES[case]
    spec = CASES[name]
    model, ids, mask, P, N = case_inputs(spec, shorter_by=5)
    if name.startswith("sparse") and T > 2:
        assert _pool_ends_inside_a_chunk(mask, model.config.index_kpool, P, N, T)
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache, got = _steps(model, ids, mask, P, N, T)
    assert_matches_full(got, full, mask, REL_TOL_RANDOM if spec.get("random") else REL_TOL)
    assert cache.seq_len == P + N


@pytest.mark.parametrize("config", [{}, KDA_ONLY, GLM_SHARED], ids=["sparse", "kda-only", "shared-across-kda"])
def test_rewind_after_a_verify_with_wrong_tokens(config):
    """mark, verify the true next tokens followed by wrong ones, rewind to the true ones: the cache continues as if
    the wrong tokens were never seen (KDA states, conv history, pools and the indexer's ring), through later verify
    and decode steps, across pool boundaries; the logits of the kept tokens equal the full forward."""
    model = tiny_model(random_weights=False, **config)
    plan = [(1, 2), (3, 0), (2, 1), (1, 3), (4, 0), (2, 2)]  # kept true tokens, then wrong ones (none: keep all)
    cache, got, full, mask = verify_rewind_decode(
        model, lambda c, chunk: step(model, c, chunk), lambda c, ids: step(model, c, ids[:, None]), plan, P=9, N=14
    )
    assert_matches_full(got, full, mask, REL_TOL)
    assert cache.seq_len == 9 + 14


def test_mtp_steps_equal_the_layer_forward():
    """The MTP layer's steps of T = 1, 2, 3 tokens on its own cache equal MTPLayer.forward over the whole sequence
    (its own indexer past index_topk and across pool boundaries), marked and rewound like drafts."""
    model = tiny_model(random_weights=False, num_nextn_predict_layers=1, index_topk=4)
    layer = model.mtp.layer_for(1)
    P, N = 10, 12
    ids, mask = left_padded(model.config.vocab_size, [P + N + 1, P + N - 2])
    hidden = torch.randn(2, P + N, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    valid = mask.bool()[:, : P + N]
    with torch.inference_mode():
        full = layer(hidden, model.model.embed_tokens(ids[:, 1:]), ForwardContext(valid=valid))
        cache = GenerationCache(model, part="mtp")
        got = [step(model, cache, ids[:, 1 : P + 1], valid[:, :P], hidden[:, :P])]
        t = P
        for T in (1, 2, 3, 1, 2, 3):
            cache.mark()
            got.append(step(model, cache, ids[:, t + 1 : t + T + 1], None, hidden[:, t : t + T]))
            wrong = step(model, cache, ids[:, :1], None, hidden[:, :1])  # a draft-only position, rewound below
            assert wrong.shape == (2, 1, hidden.shape[-1])
            cache.rewind(T)
            t += T
    assert t == P + N
    got = torch.cat(got, dim=1)
    err = (got - full)[valid].abs().max().item()
    assert err <= REL_TOL * full[valid].abs().max().item(), f"max abs error {err:.3e}"


def test_step_bad_input():
    model, other = tiny_model(), tiny_model(seed=2)
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    with torch.inference_mode():
        cache = GenerationCache(model)
        with pytest.raises(CacheError, match="left-padded"):
            step(model, cache, ids, torch.tensor([[1, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]]).bool())
        cache = GenerationCache(model, max_length=7)
        step(model, cache, ids, mask.bool())
        with pytest.raises(CacheError, match="another model"):
            step(other, cache, ids[:, :1])
        with pytest.raises(CacheError, match="batch of 2 rows, the input has 1"):
            step(model, cache, ids[:1, :1])
        for bad in (ids[:, 0], ids[:, :0], ids[:, :1].float()):
            with pytest.raises(CacheError, match=r"integer ids \[batch, tokens\]"):
                step(model, cache, bad)
        with pytest.raises(CacheError, match="max_length=7"):
            step(model, cache, ids[:, :2])
        with pytest.raises(CacheError, match="tokens only"):
            step(model, cache, ids[:, :1], torch.tensor([[True], [False]]))
        with pytest.raises(CacheError, match="rewind.. needs an earlier mark"):
            cache.rewind(0)
        cache.mark()
        with pytest.raises(CacheError, match=r"integer in \[0, 0\]"):
            cache.rewind(1)
        with pytest.raises(CacheError, match="part must be"):
            GenerationCache(model, part="draft")
        with pytest.raises(CacheError, match="latent_dtype"):
            GenerationCache(model, latent_dtype=torch.int16)
        with pytest.raises(CacheError, match="max_length"):
            GenerationCache(model, max_length=0)


# latent_dtype -> (bytes saved per latent row of width Z against fp32, the largest logit change relative to the
# logits' scale): bf16 rounds to 8 mantissa bits, int8 to 1/254 of each row's absmax (+ a 4-byte fp32 scale)
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
            step(model, cache, ids[:, :P], mask[:, :P].bool())
            logits[key] = torch.cat([model.lm_head(step(model, cache, ids[:, t : t + 1])) for t in range(P, P + N)], 1)
    saved, bound = NARROW[dtype]
    n_mla = len(cfg.attention_layers)
    assert caches[None].nbytes() - caches[dtype].nbytes() == n_mla * ids.shape[0] * (P + N) * saved(cfg.kv_lora_rank)
    scale = full.abs().max().item()
    exact = (logits[None] - full[:, P:]).abs().max().item()
    rounded = (logits[dtype] - full[:, P:]).abs().max().item()
    assert exact <= REL_TOL * scale < rounded <= bound * scale


def test_cache_bytes_are_the_latent_and_one_pooled_key_per_pool():
    """nbytes = per MLA layer and row: the latent (Z per position) + one indexer key per complete k-pool (full
    indexers only); per KDA layer and row the fp32 state and the three conv histories, whatever the length."""
    model = tiny_model(random_weights=False, **GLM_SHARED)
    cfg = model.config
    ids, mask = left_padded(cfg.vocab_size, [13, 9])
    with torch.inference_mode():
        cache = GenerationCache(model, max_length=40)
        step(model, cache, ids, mask.bool())
    B, S, L, Z, Ki = 2, 13, cfg.index_kpool, cfg.kv_lora_rank, cfg.index_head_dim
    C, W = cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    full_mla = sum(
        1 for i, t in enumerate(cfg.indexer_types) if cfg.layer_types[i] != "linear_attention" and t == "full"
    )
    shared_mla = len(cfg.attention_layers) - full_mla
    kda = cfg.num_hidden_layers - len(cfg.attention_layers)
    want = (
        4
        * B
        * (
            full_mla * (S * Z + (S // L) * Ki)
            + shared_mla * S * Z
            + kda * (cfg.linear_num_heads * cfg.linear_head_dim**2 + 3 * C * (W - 1))
        )
    )
    assert cache.nbytes() == want
    assert cache.seq_len == S


def _graph_counter():
    """A torch.compile backend (public API: a callable) that counts the graphs dynamo hands it."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


# one layer of each attention kind (KDA, indexed MLA) with a dense MLP and an MoE: every kind of block the four-layer
# tiny model has, in half its trace and compile time
TWO_LAYERS = dict(
    num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], mlp_layer_types=["dense", "sparse"]
)


def test_compiled_step_is_one_graph_and_equals_eager():
    """compile: the decode step (T = 1) and the marked verify step (T = 3) each trace into ONE graph with
    fullgraph=True (a host read, a .item() or a data-dependent shape would raise), are reused for every later step
    (no recompile: lengths are device tensors), and give the eager step's logits."""
    model = tiny_model(random_weights=False, **TWO_LAYERS)
    P, N = 9, 6
    ids, mask = left_padded(model.config.vocab_size, [P + N + 3, P + N])
    backend, graphs = _graph_counter()
    stepper = Stepper(compile=backend)
    with torch.inference_mode():
        _, eager = _steps(model, ids, mask, P, N, 1, max_length=P + N + 4)
        cache, compiled = _steps(model, ids, mask, P, N, 1, stepper, max_length=P + N + 4)
        assert len(graphs) == 1
        cache.mark()
        stepper(model, cache, ids[:, P + N : P + N + 3])
        cache.rewind(1)
        cache.mark()
        stepper(model, cache, torch.cat([ids[:, P + N + 1 :], ids[:, :1]], dim=1))  # T = 3 again
        cache.rewind(0)
    assert len(graphs) == 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6 * eager.abs().max().item())  # same ops, same order
    # and nothing inside the graphs reads the host when it runs: no custom op tagged cudagraph_unsafe (the span-
    # reading sparse attention ops were, inside the opaque call); the static ones are there instead
    ops = [getattr(n.target, "default", n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    custom = {str(op) for op in ops if getattr(op, "namespace", None) == "glm53"}
    assert "glm53.sparse_mqa_attention_static.default" in custom, custom
    assert not [op for op in ops if torch.Tag.cudagraph_unsafe in getattr(op, "tags", ())], custom


ONE_LAYER = dict(num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"])  # quick traces


def test_many_models_and_lengths_compile_in_one_process():
    """torch.compile refuses a ninth graph of one code object (its recompile limit, 8; with fullgraph=True a hard
    error): 3 models (different vocabularies) x 3 batch sizes = 9 static signatures compile in this process (after
    every earlier test's compiles, no compiler reset), each one graph, reused by the next step, equal to eager.
    (One shared function fails here at the ninth.)"""
    backend, graphs = _graph_counter()
    stepper = Stepper(compile=backend)
    for vocab in (320, 328, 336):
        model = tiny_model(random_weights=False, vocab_size=vocab, **ONE_LAYER)
        for lengths in ([5], [5, 4], [5, 4, 3]):
            ids, mask = left_padded(vocab, lengths)
            with torch.inference_mode():
                _, eager = _steps(model, ids, mask, 3, 2, 1, max_length=7)
                before = len(graphs)
                _, compiled = _steps(model, ids, mask, 3, 2, 1, stepper, max_length=7)
            assert len(graphs) == before + 1  # one graph for both decode steps of this signature
            torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6 * eager.abs().max().item())
    assert len(graphs) == 9


def test_generate_compiled_reuses_its_graph_across_lengths():
    """Compiled generate sizes its cache in CAPACITY_BUCKET steps (every cache length is its own graph): calls with
    other prompt lengths and max_new_tokens in one bucket reuse the first call's decode graph (a CPU inductor compile
    is tens of seconds), and the tokens stay the eager ones. A call past the bucket compiles once more."""
    model = tiny_model(random_weights=False, **ONE_LAYER)
    backend, graphs = _graph_counter()
    for lengths, new in (([7, 5], 4), ([9, 6], 6), ([4, 4], 3)):
        ids, mask = left_padded(model.config.vocab_size, lengths)
        plain = model.generate(ids, mask, max_new_tokens=new)
        assert torch.equal(model.generate(ids, mask, max_new_tokens=new, compile=backend), plain)
    assert len(graphs) == 1
    ids, mask = left_padded(model.config.vocab_size, [CAPACITY_BUCKET - 2, 5])
    model.generate(ids, mask, max_new_tokens=3, compile=backend)
    assert len(graphs) == 2
    assert Stepper().capacity(CAPACITY_BUCKET + 1) == CAPACITY_BUCKET + 1  # eager: exact
    assert Stepper(compile=backend).capacity(CAPACITY_BUCKET + 1) == 2 * CAPACITY_BUCKET


def test_compiled_generate_follows_the_models_state_without_module_guards():
    """The compiled step skips torch.compile's guards on nn modules (compile_options); its signature carries the
    model's module state instead. A numerics switch (set_numerics(mla_absorb=False): the per-head attention form)
    between calls gets a graph of its own, running that form, with that form's tokens; switching back reuses the
    first graph; new parameter values (graph inputs) are read by the same graph."""
    model = tiny_model(random_weights=False, **TWO_LAYERS)
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    backend, graphs = _graph_counter()
    forms = {True: "glm53.sparse_mqa_attention_static.default", False: "glm53.sparse_attention_static.default"}
    for absorb, want_graphs in ((True, 1), (False, 2), (True, 2)):
        model.set_numerics(mla_absorb=absorb)
        plain = model.generate(ids, mask, max_new_tokens=4)
        assert torch.equal(model.generate(ids, mask, max_new_tokens=4, compile=backend), plain)
        assert len(graphs) == want_graphs
    for graph, absorb in zip(graphs, (True, False)):  # the first graph attends absorbed, the second per head
        ops = {str(getattr(n.target, "default", n.target)) for n in graph.graph.nodes if n.op == "call_function"}
        assert forms[absorb] in ops and forms[not absorb] not in ops, ops
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # other values: another greedy path, the same graph
    flipped = model.generate(ids, mask, max_new_tokens=4)
    assert not torch.equal(flipped, plain)
    assert torch.equal(model.generate(ids, mask, max_new_tokens=4, compile=backend), flipped)
    assert len(graphs) == 2


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_compile_true_options_per_device(monkeypatch, gpu):
    """compile=True: fullgraph, static shapes, no nn-module guards, and per device the form that removes the per-call
    overhead: CUDA graphs on a GPU (what mode="reduce-overhead" sets; the Stepper then copies outputs out of the
    graph's pool), inductor's C++ wrapper on a CPU. A backend name or callable gets the same guard option only."""
    from glm53.generation.step import compile_options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    options = compile_options(True)
    assert options["fullgraph"] is True and options["dynamic"] is False and "mode" not in options
    inner = options["options"]
    assert inner["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe
    assert inner.get("triton.cudagraphs", False) is gpu and inner.get("cpp_wrapper", False) is not gpu
    assert Stepper(compile=True).graphs is gpu
    named = compile_options("aot_eager")
    assert named["backend"] == "aot_eager" and set(named["options"]) == {"guard_filter_fn"}
    assert Stepper(compile="aot_eager").graphs is False


def test_compiled_step_ignores_the_strides_of_sliced_inputs():
    """The MTP draft feeds h[:, -1:] of the previous step's [B, T, D] output: contiguous, with strides of T. The step
    takes its inputs with row-major strides, so every T reuses one draft graph (before, each T compiled again until
    torch.compile's recompile limit failed speculative decoding)."""
    model = tiny_model(random_weights=False, num_nextn_predict_layers=1, **ONE_LAYER)
    ids = torch.randint(1, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(1, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    backend, graphs = _graph_counter()
    stepper = Stepper(compile=backend)
    with torch.inference_mode():
        cache = GenerationCache(model, part="mtp", max_length=12)
        stepper(model, cache, ids[:, :4].contiguous(), None, hidden[:, :4].contiguous())  # the prefill: eager
        for t, T in zip(range(4, 12), (2, 3, 4, 5, 2, 3, 4, 5)):
            source = hidden[:, :T].clone(memory_format=torch.contiguous_format)  # a step output: strides of T
            out = stepper(model, cache, ids[:, t : t + 1], None, source[:, -1:])
            assert out.shape == (1, 1, model.config.hidden_size)
    assert len(graphs) == 1


def test_generate_compiled_with_inductor_equals_eager():
    """compile=True (inductor, public torch.compile only) through generate: the same greedy tokens as eager. One
    inductor graph (the decode step): a cold C++ compile costs about a minute per graph on two cores, and the
    speculative verify and draft steps are the same forward at other static signatures, traced by
    test_compiled_step_is_one_graph_and_equals_eager and run compiled (aot_eager) by
    tests/generation/test_cli.py::test_compile_flag_with_mtp_decodes_the_same_tokens. TWO_LAYERS: about half the
    four-layer model's cold compile time."""
    model = tiny_model(random_weights=False, **TWO_LAYERS)
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    plain = model.generate(ids, mask, max_new_tokens=4)
    assert torch.equal(model.generate(ids, mask, max_new_tokens=4, compile=True), plain)


# ---------------------------------------------------------------------------------- bf16 and a partly selecting indexer
P, N = 9, 6
BF16_REL_TOL = 1e-2  # bf16 rounding of the step's own formula order (~4e-3 of the logits' scale on this case)


def _decoded(model, ids, mask) -> torch.Tensor:
    """Prefill P tokens, decode the next N -> their logits [B, N, vocab] (fp32)."""
    with torch.inference_mode():
        cache = GenerationCache(model)
        model.model(ids[:, :P], mask[:, :P], cache=cache)
        return torch.stack(
            [model.lm_head(step(model, cache, ids[:, t : t + 1]))[:, 0] for t in range(P, P + N)], 1
        ).float()


def test_decode_step_of_a_bf16_model():
    model = tiny_model(random_weights=False).to(torch.bfloat16)
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 3])
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits[:, P:].float()
    got = _decoded(model, ids, mask)
    assert (got - full).abs().max().item() <= BF16_REL_TOL * full.abs().max().item()


def test_decode_step_without_the_tail_selection():
    """index_kpool_always_select_tail False with k-pool 4: a query reads complete pools only."""
    model = tiny_model(random_weights=False, index_kpool_always_select_tail=False)
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 3])
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
    got = torch.cat([full[:, :P], _decoded(model, ids, mask)], dim=1)
    assert_matches_full(got, full, mask, REL_TOL)
