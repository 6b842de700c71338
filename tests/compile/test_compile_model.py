"""torch.compile of the whole Glm53ForCausalLM: forward (eval, no labels) and forward+backward with labels (every
loss part) in fp32 and bf16, equal to the eager model, and no graph break where the model is compile-clean.

Legend: B batch, T time.
The "aot_eager" backend (dynamo + AOT autograd, no code generation) checks traceability in seconds; inductor
compiles the same graphs (benchmarks/bench_model.py --compile). The hybrid model (KDA and MLA layers, MoE, MTP,
every loss part) compiles without a graph break: the test compiles with fullgraph=False and counts the breaks,
since under fullgraph=True dynamo would also accept a data-dependent size (an unbacked symbol) silently, which
breaks the graph everywhere else (per-block compile under a low-precision FSDP policy). Packed documents
(`cu_seqlens`): tests/compile/test_compile_packed.py.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.helpers.modules import assert_same_grads_and_loads

LOSS_PARTS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss")
COMMON = dict(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"], router_z_loss_coef=1e-2)
CONFIGS = {
    "KDA-MoE": dict(COMMON, layer_types=["linear_attention"] * 2),
    # every loss part on: MTP (an MLA + MoE layer), indexer KL, balance and z-loss
    "hybrid-MLA-MTP": dict(
        COMMON,
        layer_types=["linear_attention", "indexed_attention"],
        num_nextn_predict_layers=1,
        indexer_loss_weight=0.5,
    ),
}
# bf16: eager and compiled run the same bf16 ops (aot_eager generates no code), so they agree to a few roundings
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make_model(name: str, dtype: torch.dtype) -> Glm53ForCausalLM:
    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config.tiny(**CONFIGS[name]))
    with torch.no_grad():
        for p in model.parameters():  # random weights: default inits hide bugs
            p.normal_(std=0.2)
    return model.to_dtype(dtype)


def make_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, T], mask [B, T] (row 1 left-padded), labels [B, T] (some ignored)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (2, 19), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 7] = -100
    return ids, mask, labels


def run(model: Glm53ForCausalLM, fn, batch, inference: bool) -> dict[str, object]:
    """(With `inference`: an eval forward without labels, then) a training forward+backward with labels, via `fn`."""
    ids, mask, labels = batch
    for router in model.routers():
        router.counted_load = None
    logits = None
    if inference:
        model.eval()
        with torch.no_grad():
            logits = fn(ids, attention_mask=mask).logits
    model.train()
    out = fn(ids, attention_mask=mask, labels=labels)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    loads = [r.counted_load for r in model.routers() if r.counted_load is not None]
    return dict(
        logits=logits, train_logits=out.logits, grads=grads, loads=loads, **{k: getattr(out, k) for k in LOSS_PARTS}
    )


def check_parity(name: str, dtype: torch.dtype, fullgraph: bool, inference: bool = True) -> int:
    """Compiled vs eager on the same weights and batch -> the number of graph breaks."""
    model = make_model(name, dtype)
    batch = make_batch(model.config.vocab_size)
    torch._dynamo.reset()
    ref = run(model, model, batch, inference)
    torch._dynamo.utils.counters.clear()
    got = run(model, torch.compile(model, fullgraph=fullgraph, backend="aot_eager"), batch, inference)
    tol = TOLERANCES[dtype]
    for key in ("logits", "train_logits", *LOSS_PARTS):
        if ref[key] is None:
            assert got[key] is None, key
        else:
            torch.testing.assert_close(got[key], ref[key], **tol, msg=lambda m: f"{key}: {m}")
    assert_same_grads_and_loads(got, ref, tol)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert not fullgraph or breaks == 0
    return breaks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hybrid_model_compiles_without_graph_breaks_and_matches_eager(dtype):
    # T=19 > index_topk=8: sparse selection, and pool 4 (tokens 16-18) is incomplete in every row. The eval forward
    # (no labels) is the training graph without its loss parts: traced in fp32; bf16 traces the training graph.
    inference = dtype == torch.float32
    assert check_parity("hybrid-MLA-MTP", dtype, fullgraph=False, inference=inference) == 0


def test_compile_blocks_rejects_an_unknown_backend_and_a_second_call():
    from glm53.model.compile import compile_blocks

    model = make_model(next(iter(CONFIGS)), torch.float32)
    with pytest.raises(ValueError, match=r"compile backend must be one of .*got 'tensorrt'"):
        compile_blocks(model, backend="tensorrt")
    assert not any(getattr(b, "_glm53_compiled", False) for b in model.model.layers)  # nothing half-done
    compile_blocks(model, backend="eager")
    with pytest.raises(RuntimeError, match="already compiled"):
        compile_blocks(model, backend="eager")
