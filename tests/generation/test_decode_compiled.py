"""The compiled decode step (glm53/generation/decode_compiled.py; `decode_step(..., compile=...)`).

site_input (the fused mHC site) against decode.py's eager ops in fp32 and bf16, eagerly (no compiler: the formulas);
then decode steps with the sites compiled by inductor against one full forward at test_decode.py's tolerance,
with one graph for all sites; a bad backend is an error naming the parameter.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils

from glm53.generation import GenerationCache, generate
from glm53.generation import decode as D
from glm53.generation.decode_compiled import site_input
from tests.generation.test_incremental import CASES, REL_TOL
from tests.helpers.generation import assert_matches_full, case_inputs, tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_site_input_equals_eager_site(dtype):
    """Block input, post and comb of one site: the fused formula equals _coefficients + _collapse + _rms, and comb
    sums to 1 over each column (decode._sinkhorn is kernels/sinkhorn.py's order: test_decode.py)."""
    model = tiny_model(random_weights=True)
    layer = model.model.layers[0]
    gen = torch.Generator().manual_seed(3)
    streams = torch.randn(3, model.config.hc_mult, model.config.hidden_size, generator=gen).to(dtype)
    site = D._site(layer.attn_hc, 3)
    # peaked comb logits: Sinkhorn still moves at its last iteration, so a missing or extra one shows
    site.base = site.base + 6 * torch.randn(site.base.shape, generator=gen)
    norm = D._norm(layer.input_layernorm)
    with torch.inference_mode():
        pre, post, comb = D._coefficients(site, streams)
        want = D._rms(D._collapse(pre, streams), *norm)
        got, got_post, got_comb = site_input(streams, site.fn, site.scale, site.base, norm[0], site.n, site.eps,
                                             site.norm_eps, site.iters, norm[1])  # fmt: skip
    assert got.dtype == want.dtype and got_comb.dtype == got_post.dtype == torch.float32
    torch.testing.assert_close(got_post, post, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_comb, comb, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
    assert (got_comb.sum(-2) - 1).abs().max() < 1e-5  # the last normalisation is over columns


@pytest.mark.parametrize("case", ["sparse-P13-N12", "shared-across-kda"])
def test_compiled_decode_step_equals_full_forward(case):
    """decode_step(compile=True): inductor compiles the site once (every site has the same shapes) and the logits
    equal one full forward at test_decode.py's tolerance."""
    spec = CASES[case]
    model, ids, mask, P, N = case_inputs(spec, shorter_by=5)
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache = GenerationCache(model)
        steps = [model.lm_head(model.model(ids[:, :P], mask[:, :P], cache=cache))]
        steps += [model.lm_head(D.decode_step(model, cache, ids[:, t], compile=True))[:, None] for t in range(P, P + N)]
    assert cache.decode_plan.fused.backend == "inductor"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1  # 0 when an earlier case compiled it
    assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL)


def test_generate_compile_matches_eager():
    model = tiny_model(random_weights=False)
    ids = torch.randint(1, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    eager = generate(model, ids, max_new_tokens=6)
    assert torch.equal(generate(model, ids, max_new_tokens=6, compile="aot_eager"), eager)


def test_bad_compile_backend():
    model = tiny_model()
    ids = torch.randint(1, model.config.vocab_size, (1, 5))
    with pytest.raises(ValueError, match="decode compile backend.*'cudagraphs'"):
        generate(model, ids, max_new_tokens=2, compile="cudagraphs")
    with pytest.raises(ValueError, match="compile must be a bool"):
        generate(model, ids, max_new_tokens=2, compile=3)
