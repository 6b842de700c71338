"""Per-block torch.compile under `parallelize` (torchtitan's order: TP -> activation checkpointing -> compile ->
FSDP), on gloo: FSDP2 dp2 (MLA and KDA blocks) against the uncompiled parallel run, tp2 (an MLA block, DTensors
inside the graph) against one eager process, with no graph break; the vocab-parallel loss under torch.compile; and
`compile_blocks` on one process. (FSDP around a TP block, dp2 x tp2, composes two things tested here one at a time:
FSDP2's all-gather into the TP DTensor happens outside the compiled block, and the eager 2 x 2 layouts of
tests/parallel check it; compiling it on four ranks cost a minute of both cores.)

Legend: B batch, T time.
Backend "aot_eager" (tracing and AOT autograd without code generation) keeps each case to seconds.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from torch._dynamo.utils import counters

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.model.compile import compile_blocks, model_blocks
from glm53.training.cli import add_arguments
from glm53.training.trainer import Trainer
from tests.helpers.compile_jobs import refused, step, vocab_loss_compiled

# KDA layers 0-2 (dense, MoE, MoE), MLA layer 3 and the MTP layer (MLA + MoE) all compiled; every loss part on
HYBRID = Glm53Config.tiny(num_nextn_predict_layers=1, indexer_loss_weight=0.5, router_z_loss_coef=1e-2)
# under FSDP one KDA + MoE block: each compiled block kind costs seconds per rank
ONE_BLOCK = Glm53Config.tiny(
    num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["sparse"], router_z_loss_coef=1e-2
)
# one MLA + MoE block (indexer, sparse attention, every loss part but MTP)
ONE_MLA_BLOCK = Glm53Config.tiny(
    num_hidden_layers=1,
    layer_types=["indexed_attention"],
    mlp_layer_types=["sparse"],
    router_z_loss_coef=1e-2,
    indexer_loss_weight=0.5,
)
# fp32: whole block graphs. bf16 policy: the nested fp32 FSDP units (mHC, router, convs) split each block's graph.
CASES = {
    "fp32-checkpointing-MLA": dict(config=ONE_MLA_BLOCK, checkpointing=True),
    "bf16-policy-KDA": dict(config=ONE_BLOCK, bf16=True),
}


def make_inputs(config: Glm53Config) -> dict:
    torch.manual_seed(0)
    model = Glm53ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, config.vocab_size, (4, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return dict(
        config=config.to_dict(), state=model.state_dict(), ids=ids, mask=mask, labels=ids.masked_fill(mask == 0, -100)
    )


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_compiled_blocks_under_fsdp_match_the_uncompiled_parallel_run(pool2, case):
    case = dict(case)
    inputs = make_inputs(case.pop("config"))
    eager = pool2.run(step, **inputs, dp=2, compile=False, **case)
    compiled = pool2.run(step, **inputs, dp=2, compile=True, **case)
    tol = dict(rtol=2e-2, atol=2e-2) if case.get("bf16") else dict(rtol=1e-5, atol=1e-6)
    for got, ref in zip(compiled, eager):
        assert got["graphs"] > 0  # the blocks really were compiled
        assert (got["graph_breaks"] == 0) == (not case.get("bf16"))
        assert got["parts"].keys() == ref["parts"].keys() and got["grads"].keys() == ref["grads"].keys()
        for name, value in ref["parts"].items():
            torch.testing.assert_close(got["parts"][name], value, **tol, msg=lambda m: f"{name}: {m}")
        for name, value in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], value, **tol, msg=lambda m: f"{name}: {m}")


def test_compiled_blocks_under_tp_match_one_eager_process(pool2):
    # the MLA + MoE block (column/row-parallel projections, DTensor ops inside the compiled graph) and the
    # vocab-sharded head's loss (glm53/parallel/vocab_loss.py), eager outside it
    inputs = make_inputs(ONE_MLA_BLOCK)
    model = Glm53ForCausalLM(ONE_MLA_BLOCK)
    model.load_state_dict(inputs["state"])
    out = model(inputs["ids"], attention_mask=inputs["mask"], labels=inputs["labels"])
    out.loss.backward()
    results = pool2.run(step, **inputs, dp=1, tp=2, compile=True)
    for got in results:
        assert got["graph_breaks"] == 0 and got["graphs"] == 1
        assert set(got["parts"]) == {"loss", "lm_loss", "aux_loss", "indexer_loss"}
        for name, value in got["parts"].items():
            torch.testing.assert_close(value, getattr(out, name).detach(), rtol=1e-5, atol=1e-6)
        assert got["grads"].keys() == {n for n, p in model.named_parameters() if p.grad is not None}
        for name, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(
                    got["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}"
                )


def test_vocab_parallel_loss_compiles_fullgraph_and_matches_eager(pool2):
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(37, 12, generator=g), torch.randn(64, 12, generator=g)
    targets = torch.randint(0, 64, (37,), generator=g)
    targets[::5] = -100
    for res in pool2.run(vocab_loss_compiled, hidden=hidden, weight=weight, targets=targets, chunk=8):
        assert res["graph_breaks"] == 0 and res["graphs"] == 1  # the autograd.Function and its collectives traced
        for key in ("loss", "hidden", "weight"):
            torch.testing.assert_close(res["compiled"][key], res["eager"][key], rtol=1e-6, atol=1e-6)


def test_compile_blocks_keeps_parameter_names_and_matches_eager_with_checkpointing():
    inputs = make_inputs(HYBRID)
    model = Glm53ForCausalLM(HYBRID)
    model.load_state_dict(inputs["state"])
    compiled = compile_blocks(copy.deepcopy(model), backend="aot_eager")
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert [hasattr(b.forward, "_torchdynamo_orig_callable") for b in model_blocks(compiled)] == [1, 1, 1, 1, 1]
    compiled.gradient_checkpointing_enable()  # the compiled blocks run again inside torch.utils.checkpoint
    torch._dynamo.reset()
    counters.clear()
    runs = []
    for m in (model, compiled):
        out = m(inputs["ids"], attention_mask=inputs["mask"], labels=inputs["labels"])
        runs.append((out.loss, torch.autograd.grad(out.loss, list(m.parameters()), allow_unused=True)))
    # KDA + dense, KDA + MoE (reused by layer 2), MLA + MoE, the MTP layer
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 4
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-6)
    for got, ref in zip(runs[1][1], runs[0][1]):
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="already compiled"):
        compile_blocks(compiled, backend="aot_eager")
    with pytest.raises(ValueError, match="backend"):
        compile_blocks(copy.deepcopy(model), backend="tensorrt")


def test_train_cli_compile_flag_compiles_every_block():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--compile", "aot_eager", "--steps", "1"])
    model = Trainer(args, None).model
    compiled = [hasattr(b.forward, "_torchdynamo_orig_callable") for b in model_blocks(model)]
    assert compiled == [1, 1, 1, 1, 1]  # KDA blocks, the MLA block and the MTP layer
    assert parser.parse_args(["--compile"]).compile == "inductor" and parser.parse_args([]).compile is None


def test_parallelize_refuses_compile_where_blocks_cannot_stay_whole(pool2):
    for errors in pool2.run(refused, config=ONE_BLOCK.to_dict()):
        assert len(errors) == 2
        assert "activation checkpointing" in errors[0] and "mp_policy" in errors[0]
        assert "expert parallelism" in errors[1]
