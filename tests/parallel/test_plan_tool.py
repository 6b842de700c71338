"""`python -m glm53.tools.plan`: per-rank bytes from the real parallelize on a fake process group.

The TP plan at its edges (one process): tied embeddings are refused under tensor parallelism, a field that does
not split over tp is named with its value, and (LocalTensorMode, the `meshes` fixture of test_parallel_boundary.py)
the logits stay a vocab-sharded DTensor equal to one process's.

Legend: tp the tensor-parallel ranks; logits [B, T, vocab].
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Shard

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import parallelize
from glm53.parallel.tensor_parallel import check_tp_size
from glm53.tools.plan import GIB, main, moe_comm_bytes, parse_args, plan
from tests.parallel.test_parallel_boundary import WORLD, meshes, per_rank  # noqa: F401 (fixture)
from tests.parallel.test_parallel_boundary import tiny as boundary_tiny


def tiny() -> Glm53Config:
    return Glm53Config.tiny()


@pytest.mark.parametrize("layout", [(2, 2, 1), (4, 1, 1), (1, 4, 1), (2, 1, 2)])
def test_local_shard_bytes(layout):
    """Routed experts: E / ep experts per rank, split again over dp (fp32 tiny model: 4 bytes each); the rest
    at least its share of the world."""
    dp, ep, tp = layout
    config = tiny()
    with torch.device("meta"):
        model = Glm53ForCausalLM(config)
    expert_numel = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    args = parse_args(["--dp", str(dp), "--ep", str(ep), "--tp", str(tp), "--dtype", "fp32", "--seq-len", "64"])
    result = plan(args, config)
    measured = result["measured"]
    shard = dp * ep * tp
    assert measured["expert"] == expert_numel * 4 // shard
    assert measured["total_params"] == total
    assert total * 4 // shard <= measured["params"] <= total * 4 // shard * 1.5
    assert result["rows"]["adamw"] == 2 * measured["params"] and result["rows"]["grads"] == measured["params"]
    assert measured["gather"].bytes > 0


def test_released_config_layout(capsys):
    assert main(["--dp", "8", "--ep", "8", "--activation-checkpointing", "--device-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "313.3B parameters" in out
    with pytest.raises(SystemExit, match="n_routed_experts=288 is not divisible by 5"):
        main(["--dp", "1", "--ep", "5"])


def test_moe_comm_bytes_formula():
    """FSDP over 4 ranks sends each expert's shard thrice; EP adds four all-to-alls of k rows per token."""
    c = tiny()
    E, k, D, I = c.n_routed_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    fsdp = moe_comm_bytes(c, 4, 1, 100, 4)
    experts = E * 3 * I * D * 4
    rest = E * D * 4 + 3 * I * c.n_shared_experts * D * 4
    assert fsdp["all_gather"] == 2 * (experts * 3 // 4 + rest * 3 // 4) and fsdp["all_to_all"] == 0
    ep = moe_comm_bytes(c, 1, 4, 100, 4)
    assert ep["all_to_all"] == 4 * 100 * k * D * 4 * 3 // 4 + E * 8 * 3 // 4
    assert ep["all_gather"] == 2 * rest * 3 // 4
    assert GIB == 2**30


def test_context_parallel_shards_parameters_and_tokens():
    """--cp: parameters sharded over dp x cp like dp alone, per-token activations over seq_len / cp tokens; an
    MLA block also keeps the whole sequence's gathered latent and indexer keys."""
    config = tiny()
    argv = ["--dtype", "fp32", "--seq-len", "256"]
    dp4 = plan(parse_args(["--dp", "4", *argv]), config)
    cp4 = plan(parse_args(["--dp", "2", "--cp", "2", *argv]), config)
    assert cp4["measured"]["params"] == dp4["measured"]["params"] and cp4["tokens"] == 128
    gathered = 256 * (config.kv_lora_rank + 2 * config.index_head_dim) * 4
    assert cp4["per_kind"][("kda", "moe")] * 2 == dp4["per_kind"][("kda", "moe")]
    assert cp4["per_kind"][("mla", "moe")] == dp4["per_kind"][("mla", "moe")] // 2 + gathered
    assert cp4["head"] * 2 == dp4["head"]


def test_released_config_at_128k_tokens_fits_with_cp(capsys):
    assert (
        main(["--dp", "2", "--cp", "16", "--seq-len", "131072", "--activation-checkpointing", "--device-gib", "141"])
        == 0
    )
    out = capsys.readouterr().out
    assert "dp 2 x cp 16" in out and "8192 tokens per rank" in out and "fits" in out
    assert main(["--dp", "32", "--seq-len", "131072", "--activation-checkpointing", "--device-gib", "141"]) == 1


def test_composed_layout_at_128k_tokens(capsys):
    """The README's composed command: tp x ep x cp planned from the real parallelize, with the bytes each rank
    sends per MoE, MLA and KDA layer (glm53.tools.comm_model)."""
    code = main(
        [
            "--tp",
            "2",
            "--ep",
            "8",
            "--cp",
            "4",
            "--seq-len",
            "131072",
            "--activation-checkpointing",
            "--device-gib",
            "141",
        ]
    )
    out = capsys.readouterr().out
    assert "dp 1 x cp 4 x ep 8 x tp 2 = 64 ranks" in out and "32768 tokens per rank" in out
    for layer in ("moe", "mla", "kda"):
        assert f"  {layer}: all_gather" in out, out
    assert (code == 0) == ("does NOT fit" not in out)


def test_comm_model_composes_the_dimensions():
    """Each dimension adds its own collectives: EP all-to-alls independent of tp and cp's split of the rows, TP
    all-reduces only with tp, CP gathers only with cp; FSDP shrinks with every replica dimension."""
    from glm53.tools.comm_model import kda_layer_bytes, mla_layer_bytes, moe_layer_bytes

    c = tiny()
    k, D = c.num_experts_per_tok, c.hidden_size
    tp_ep = moe_layer_bytes(c, 1, 2, 100, 4, tp=2)
    assert tp_ep["all_to_all"] == 4 * 100 * k * D * 4 // 2 + c.n_routed_experts * 8 // 2
    assert tp_ep["all_reduce"] == 2 * (5 * 100 * D * 4 + 100 * k * 4) // 2
    assert moe_layer_bytes(c, 1, 2, 100, 4)["all_reduce"] == 0
    plain, cp2 = mla_layer_bytes(c, 2, 1, 1, 64, 4), mla_layer_bytes(c, 1, 1, 1, 64, 4, cp=2)
    assert plain["all_reduce"] == 0 and cp2["all_gather"] > plain["all_gather"]  # FSDP alike, plus the latent
    width = c.kv_lora_rank + 2 * c.index_head_dim
    assert cp2["all_gather"] - plain["all_gather"] == 32 * width * 4 + 32
    assert kda_layer_bytes(c, 1, 1, 1, 64, 4, tp=2)["all_gather"] == 0  # tp alone: no FSDP, no cp


def test_a_world_too_large_to_plan_is_a_usage_error_not_a_hang(capsys):
    """The plan builds every rank of the fake world (O(world)): `--dp 1000000` ran for minutes. A world above
    MAX_WORLD is refused at once, naming the product."""
    from glm53.tools import plan as plan_tool

    with pytest.raises(SystemExit) as e:
        plan_tool.parse_args(["--dp", "1000000"])
    assert e.value.code == 2
    assert "--dp 1000000 x --cp 1 x --ep 1 x --tp 1 = 1000000 ranks" in capsys.readouterr().err
    assert plan_tool.parse_args(["--dp", str(plan_tool.MAX_WORLD)]).dp == plan_tool.MAX_WORLD


def test_ckpt_plan_with_a_tp_that_splits_no_heads_is_a_usage_error(capsys):
    """`ckpt_plan --tp 3` (64 heads) was a traceback from every fake rank; now one usage line naming the field."""
    from glm53.tools import ckpt_plan

    with pytest.raises(SystemExit) as e:
        ckpt_plan.main(["--dp", "1", "--tp", "3"])
    assert e.value.code == 2
    assert "argument --tp: tensor parallelism over 3 ranks splits MLA heads, but num_attention_heads=64" in (
        capsys.readouterr().err
    )


# ------------------------------------------------------------------------------------------- the plan tool at its edges
def test_tied_embeddings_are_refused_under_tensor_parallelism():
    model = Glm53ForCausalLM(Glm53Config.tiny(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        check_tp_size(model, 2)
    check_tp_size(Glm53ForCausalLM(Glm53Config.tiny()), 2)  # untied: passes


@pytest.mark.parametrize("field,value", [("vocab_size", 321), ("moe_intermediate_size", 15)])
def test_a_field_that_does_not_split_is_named(field, value):
    model = Glm53ForCausalLM(Glm53Config.tiny(**{field: value}))
    with pytest.raises(ValueError, match=f"{field}={value} is not divisible by 2"):
        check_tp_size(model, 2)


def test_tp_logits_stay_a_vocab_sharded_dtensor_equal_to_one_process(meshes):  # noqa: F811
    """lm_head's output under TP is a Shard(-1) DTensor (loss_parallel reads it unsplit); its full tensor is one
    process's logits. A plain local tensor here would hand the caller vocab / tp columns without a word."""
    torch.manual_seed(0)
    model = Glm53ForCausalLM(boundary_tiny())
    ids = torch.randint(1, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
    with LocalTensorMode(WORLD):
        parallelize(model, meshes["tp2"])
        with torch.no_grad():
            logits = model(ids).logits
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)  # the vocab dimension
        assert logits.to_local().shape[-1] * 2 == model.config.vocab_size
    for value in per_rank(logits):
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5)
