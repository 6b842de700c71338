"""The recomputing indexer KL (glm53/losses/indexer_kl.py) against the stored [B, T, P] path: value and every gradient.

Legend: B batch, T queries, H heads, K head width, P k-pools, L tokens per pool.
Op level: one real Indexer scores random inputs; the stored path is what MLA recorded before (score_and_select's
[B, T, P] scores, candidate and selected masks, attention_pool_mass over all rows, `chunked_pool_kl`), the new one
the O(T) record (`Indexer.kl_inputs`, the top-k, PoolMassInputs) through kernel "indexer_kl" ("fast": blocks of
`chunk` rows; "reference": one block, plain autograd). Cases: dense and sparse masks, two layers' masses (a full
indexer and the shared layer it serves), left padding, packed documents (cu_seqlens), a chunk that does not
divide T, fp32 and fp64 inputs. Model level: a tiny model's losses and every parameter's gradient with
`set_numerics(indexer_kl_recompute=...)` on and off.

Tolerance (derived): both paths run the same fp32 kernels (indexer_scores and attention_pool_mass compute in fp32
also for fp64 inputs); they differ only in how rows are grouped into GEMMs and sums, so each result is a sum whose
rounding differs by at most ~eps32 per term over its reduction length: the score contraction K * H, the
softmax / KL over P pools and the row sum over B * T. RTOL = 4 * eps32 * (K * H + P + B * T) (factor 2 for two
paths' errors, 2 for the gradient's extra pass).
"""

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels import use_backend
from glm53.losses import chunked_pool_kl, recomputed_indexer_kl
from glm53.losses.indexer_kl import indexer_kl_reference
from glm53.model.attention_mass import IndexerKlInputs, PoolMassInputs, attention_pool_mass
from glm53.model.indexer import Indexer
from tests.helpers.oracle import randomize

B, T, H, K, L = 2, 23, 3, 8, 4
CHUNK = 5  # 23 = 4 * 5 + 3: the last block is short
EPS32 = torch.finfo(torch.float32).eps


def rtol_for(config: Glm53Config, P: int) -> float:
    return 4 * EPS32 * (config.index_head_dim * config.index_n_heads + P + B * T)


def make_case(dtype, layout: str, seed: int = 0):
    """A real indexer with peaked weights, its inputs, two layers' MLA queries/keys, the mask and documents."""
    gen = torch.Generator().manual_seed(seed)
    config = Glm53Config.tiny(index_topk=8, index_kpool=L)  # 2 of up to 5 pools: sparse differs from dense
    indexer = Indexer(config)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    indexer = indexer.to(dtype)
    x = torch.randn(B, T, config.hidden_size, generator=gen, dtype=dtype)
    q_resid = torch.randn(B, T, config.q_lora_rank, generator=gen, dtype=dtype)
    valid = torch.ones(B, T, dtype=torch.bool)
    cu = None
    if layout == "left_pad":
        valid[1, :6] = False
    elif layout == "packed":  # documents of 9 + 14 and 23 tokens over the flattened B * T
        cu = torch.tensor([0, 9, 23, 46])
    mla = [
        (torch.randn(B, T, H, K, generator=gen, dtype=dtype) * 2, torch.randn(B, T, H, K, generator=gen, dtype=dtype))
        for _ in range(2)
    ]
    return config, indexer, x, q_resid, valid, cu, mla


def stored_loss(indexer, x, q_resid, valid, cu, mla, mode):
    topk, scores, candidate, selected = indexer.score_and_select(x, q_resid, valid, grad=True, cu_seqlens=cu)
    masses = [attention_pool_mass(q, k, valid, L, 0.3, cu_seqlens=cu) for q, k in mla]
    return chunked_pool_kl(scores, masses, candidate if mode == "dense" else selected, valid), topk, candidate


def recorded(indexer, x, q_resid, valid, cu, mla, topk):
    full = IndexerKlInputs(
        **indexer.kl_inputs(x, q_resid, valid, cu),
        topk=topk,
        valid=valid,
        cu_seqlens=cu,
        kpool=L,
        scale=indexer.head_dim**-0.5,
    )
    return full, [PoolMassInputs(q, k, valid, cu, L, 0.3) for q, k in mla]


def grads(loss, module):
    return torch.autograd.grad(loss, list(module.parameters()), retain_graph=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("layout", ["plain", "left_pad", "packed"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_recomputed_kl_equals_the_stored_path_value_and_every_gradient(mode, layout, dtype):
    config, indexer, x, q_resid, valid, cu, mla = make_case(dtype, layout)
    want, topk, candidate = stored_loss(indexer, x, q_resid, valid, cu, mla, mode)
    want_grads = grads(want, indexer)
    full, masses = recorded(indexer, x, q_resid, valid, cu, mla, topk)
    rtol = rtol_for(config, candidate.shape[-1])
    for name, fn in (
        ("fast", lambda: recomputed_indexer_kl(full, masses, valid, mode, chunk=CHUNK)),
        ("reference", lambda: indexer_kl_reference(full, masses, valid, mode)),
    ):
        got = fn()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=rtol, atol=0, msg=f"{name} loss")
        for p_name, g, w in zip([n for n, _ in indexer.named_parameters()], grads(got, indexer), want_grads):
            scale = w.abs().max().item()
            assert scale > 0, p_name  # every indexer parameter is trained by the KL
            torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * scale, msg=f"{name} d/d {p_name}")
    assert want > 0.05  # a KL far from zero: the targets and the student differ
    assert candidate.any(-1).sum() > B * T // 2  # most rows train


def test_recomputed_kl_with_a_given_row_count_and_chunks_of_every_size():
    """num_rows (the global denominator) divides the summed rows; any chunk (1, T, past T) gives the same loss."""
    config, indexer, x, q_resid, valid, cu, mla = make_case(torch.float32, "left_pad", seed=3)
    topk, scores, candidate, _ = indexer.score_and_select(x, q_resid, valid, grad=True)
    masses = [attention_pool_mass(q, k, valid, L, 0.3) for q, k in mla]
    rows = torch.tensor(7.5)
    want = chunked_pool_kl(scores, masses, candidate, valid, rows)
    full, inputs = recorded(indexer, x, q_resid, valid, None, mla, topk)
    rtol = rtol_for(config, candidate.shape[-1])
    for chunk in (1, 7, T, 4 * T):
        got = recomputed_indexer_kl(full, inputs, valid, "dense", rows, chunk=chunk)
        torch.testing.assert_close(got, want, rtol=rtol, atol=0, msg=f"chunk {chunk}")
    with pytest.raises(ValueError, match="chunk must be a positive"):
        recomputed_indexer_kl(full, inputs, valid, "dense", rows, chunk=0)


def trained_looking(model, seed):
    """Peaked attention (randomize) and an indexer far from its targets, so the KL is far from zero."""
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".indexer." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def shared_config(mode):
    kinds = ["linear_attention", "indexed_attention"] * 2
    return Glm53Config.tiny(
        layer_types=kinds,
        indexer_types=["full", "full", "full", "shared"],
        router_aux_loss_coef=0.0,
        indexer_loss_weight=0.5,
        indexer_loss_mode=mode,
        num_nextn_predict_layers=1,
        index_topk=8,
    )


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_whole_model_losses_and_gradients_unchanged_by_the_recomputing_kl(mode):
    """A full and a shared indexer layer plus an MTP layer, left padding: every loss part and every parameter's
    gradient as with the stored [B, T, P] record; the recomputing record keeps no [B, T, P] tensor."""
    config = shared_config(mode)
    model = trained_looking(Glm53ForCausalLM(config), 2)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, config.vocab_size, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :5] = False
    runs = {}
    for recompute in (False, True):
        model.set_numerics(indexer_kl_recompute=recompute)
        model.zero_grad(set_to_none=True)
        out = model(ids, attention_mask=mask, labels=ids.masked_fill(~mask, -100))
        out.loss.backward()
        grads_ = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[recompute] = (out, grads_)
    (old, old_g), (new, new_g) = runs[False], runs[True]
    assert old.indexer_loss > 0.05
    P = -(-T // config.index_kpool)
    rtol = rtol_for(config, P)
    for part in ("loss", "lm_loss", "mtp_loss", "indexer_loss"):
        torch.testing.assert_close(getattr(new, part), getattr(old, part), rtol=rtol, atol=0, msg=part)
    assert old_g.keys() == new_g.keys() and any(".indexer." in n for n in old_g)
    for n in old_g:
        scale = old_g[n].abs().max().item()
        torch.testing.assert_close(new_g[n], old_g[n], rtol=rtol, atol=rtol * scale, msg=n)


def test_whole_model_recomputing_kl_under_the_reference_kernels():
    """Kernel "indexer_kl" forced to its reference (one block) gives the fast op's loss on the same model."""
    config = shared_config("sparse")
    model = trained_looking(Glm53ForCausalLM(config), 2)
    ids = torch.randint(1, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(6))
    fast = model(ids, labels=ids).indexer_loss
    with use_backend("reference", ["indexer_kl"]):
        ref = model(ids, labels=ids).indexer_loss
    torch.testing.assert_close(fast, ref, rtol=rtol_for(config, -(-T // config.index_kpool)), atol=0)
    assert fast > 0.05


def saved_shapes(fn):
    """fn() under a saved-tensor hook -> (its result, the shapes of every tensor autograd saved for backward)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), shapes


def test_compiled_model_records_the_inputs_and_matches_eager():
    """torch.compile of the whole model (one aot_eager compile: the loss traced too) takes the recomputing op, a
    custom op on tensors: every loss part and gradient as eager, no graph break, and autograd saves no [B, T, P]
    tensor (the stored record saves several: the eager run with kl_recompute=False shows the check can fail)."""
    config = Glm53Config.tiny(
        num_hidden_layers=2,
        layer_types=["indexed_attention"] * 2,
        indexer_types=["full", "shared"],
        mlp_layer_types=["dense"] * 2,
        router_aux_loss_coef=0.0,
        indexer_loss_weight=0.5,
        indexer_loss_mode="sparse",
        index_topk=8,
    )
    model = trained_looking(Glm53ForCausalLM(config), 4)
    ids = torch.randint(1, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :5] = False
    labels = ids.masked_fill(~mask, -100)
    params = [p for p in model.parameters() if p.requires_grad]
    bpt = (B, T, -(-T // config.index_kpool))  # a [B, T, P] tensor's shape

    def step(fn):
        out, shapes = saved_shapes(lambda: fn(ids, attention_mask=mask, labels=labels))
        grads_ = torch.autograd.grad(out.loss, params, allow_unused=True)
        return out, grads_, [s for s in shapes if s == bpt]

    model.set_numerics(indexer_kl_recompute=False)
    assert step(model)[2], "the stored record saves [B, T, P] tensors (the check below can fail)"
    model.set_numerics(indexer_kl_recompute=True)
    want, want_g, want_bpt = step(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got, got_g, got_bpt = step(torch.compile(model, backend="aot_eager"))
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert want_bpt == [] and got_bpt == []
    assert want.indexer_loss > 0.05
    rtol = rtol_for(config, bpt[-1])  # eager and traced run the same fp32 kernels: the same bound as above
    for part in ("loss", "lm_loss", "indexer_loss"):
        torch.testing.assert_close(getattr(got, part), getattr(want, part), rtol=rtol, atol=0, msg=part)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".indexer." in n and g is not None for n, g in zip(names, want_g))
    for n, g, w in zip(names, got_g, want_g):
        assert (g is None) == (w is None), n
        if w is not None:
            torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * w.abs().max().item(), msg=n)
