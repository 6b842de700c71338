"""What parallelize refuses for glm53.peft models under tensor parallelism, before changing anything: an FP8 base,
an adapter on lm_head (the vocab-parallel loss reads its weight itself), adapter dropout, and an FP8 base under
a low-precision FSDP policy, a held base widened to fp32 under one. Runs in a
simulated world (the fake process group and LocalTensorMode of tests/parallel/test_parallel_boundary.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor

import glm53
from glm53 import Glm53ForCausalLM
from glm53.parallel import parallelize
from glm53.peft import quantize_model
from glm53.peft.fp8_storage import hold_bf16
from tests.parallel.test_parallel_boundary import WORLD, meshes, tiny  # noqa: F401 (fixture)


def _untouched(model) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters())


def test_fp8_base_under_tp_is_refused(meshes):  # noqa: F811
    model = Glm53ForCausalLM(tiny())
    quantize_model(model, block=(8, 8))
    glm53.apply_lora(model, 2)
    with LocalTensorMode(WORLD), pytest.raises(ValueError, match="FP8 base .* under tensor parallelism"):
        parallelize(model, meshes["tp2"])
    assert _untouched(model)


def test_adapter_on_lm_head_under_tp_is_refused(meshes):  # noqa: F811
    model = Glm53ForCausalLM(tiny())
    glm53.apply_lora(model, 2, targets=["attention", "lm_head"])
    with LocalTensorMode(WORLD), pytest.raises(ValueError, match="lm_head has a LoRA adapter"):
        parallelize(model, meshes["tp2"])


def test_adapted_linear_placements_on_tp2(meshes):  # noqa: F811
    """Every adapter factor's placement on a tp2 mesh (the gloo tests check a subset and the numbers)."""
    model = Glm53ForCausalLM(tiny())
    glm53.apply_lora(model, 2)
    base = {n: p for n, p in model.named_parameters()}
    with LocalTensorMode(WORLD):
        parallelize(model, meshes["tp2"])
        params = dict(model.named_parameters())
    for name, param in params.items():
        if ".lora_" not in name:
            continue
        owner = params[name.split(".lora_")[0] + ".weight"].placements[0]
        want = {
            ("Shard(dim=0)", "A"): "Replicate()",
            ("Shard(dim=0)", "B"): "Shard(dim=0)",
            ("Shard(dim=1)", "A"): "Shard(dim=1)",
            ("Shard(dim=1)", "B"): "Replicate()",
            ("Replicate()", "A"): "Replicate()",
            ("Replicate()", "B"): "Replicate()",
        }
        factor = name.split(".lora_")[1][0]
        assert repr(param.placements[0]) == want[(repr(owner), factor)], name
        assert param.shape == base[name].shape


def test_adapter_dropout_under_tp_is_refused(meshes):  # noqa: F811
    model = Glm53ForCausalLM(tiny())
    glm53.apply_lora(model, 2, dropout=0.1)
    with LocalTensorMode(WORLD), pytest.raises(ValueError, match="LoRA dropout under tensor parallelism"):
        parallelize(model, meshes["tp2"])
    assert _untouched(model)


def test_fp8_base_under_a_bf16_policy_is_refused(meshes):  # noqa: F811
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = Glm53ForCausalLM(tiny())
    quantize_model(model, block=(8, 8))
    glm53.apply_lora(model, 2)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with LocalTensorMode(WORLD), pytest.raises(ValueError, match="FP8 base .* MixedPrecisionPolicy"):
        parallelize(model, meshes["2d"]["dp"], mp_policy=policy)
    assert _untouched(model)


def test_bf16_held_base_widened_to_fp32_under_a_bf16_policy_is_refused(meshes):  # noqa: F811
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = Glm53ForCausalLM(tiny())
    glm53.apply_lora(model, 2)
    assert hold_bf16(model, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with (
        LocalTensorMode(WORLD),
        pytest.raises(ValueError, match="held base .* widened to torch.float32 under a MixedPrec"),
    ):
        parallelize(model, meshes["2d"]["dp"], mp_policy=policy)
    assert _untouched(model)
    # held for the policy's dtype (what glm53 train --bf16 does), or without the policy: accepted
    for compute, mp in ((torch.bfloat16, policy), (torch.float32, None)):
        model = Glm53ForCausalLM(tiny())
        glm53.apply_lora(model, 2)
        hold_bf16(model, compute)
        with LocalTensorMode(WORLD):
            parallelize(model, meshes["2d"]["dp"], mp_policy=mp)
        assert not _untouched(model)


def test_bf16_held_embedding_and_head_go_back_to_fp32_under_tp(meshes):  # noqa: F811
    """The vocab-parallel embedding and loss read their shards themselves, not through the widening view: under tp
    a bf16-held embedding / lm_head is held in its compute dtype again (the same values); the linears stay bf16."""
    model = Glm53ForCausalLM(tiny())
    glm53.apply_lora(model, 2)
    held = hold_bf16(model, torch.float32)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(held)
    with LocalTensorMode(WORLD):
        parallelize(model, meshes["tp2"])
    for module in (model.model.embed_tokens, model.lm_head):
        assert module.weight.dtype == torch.float32 and not module.__dict__["held_kinds"]
    assert {p.dtype for n, p in model.named_parameters() if n in held and "embed" not in n and "lm_head" not in n} == {
        torch.bfloat16
    }
