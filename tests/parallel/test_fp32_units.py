"""The FSDP2 mixed-precision plan and the model cast agree: one fp32 keep-list (glm53/precision.py).

`fp32_units(block)` decides which FSDP units get an fp32 policy under a bf16 MixedPrecisionPolicy; the
parameters those units hold (minus the low-precision units nested inside them) must be exactly the ones
`cast_model` keeps in fp32.
"""

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel.parallelize import fp32_units
from glm53.precision import cast_model, keeps_fp32


def _names(module: torch.nn.Module, under: torch.nn.Module) -> set[str]:
    ids = {id(p) for p in under.parameters()}
    return {n for n, p in module.named_parameters() if id(p) in ids}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Glm53ForCausalLM(Glm53Config.tiny(num_nextn_predict_layers=1))


def test_fsdp_fp32_units_hold_exactly_the_keep_list(model):
    blocks = [*model.model.layers, *model.mtp.layers]
    for i, block in enumerate(blocks):
        fp32, low = fp32_units(block)
        covered = set().union(*(_names(block, m) for m in fp32)) - set().union(*(_names(block, m) for m in low))
        expected = {n for n, _ in block.named_parameters() if keeps_fp32(n)}
        assert covered == expected, f"block {i}: plan-only {covered - expected}, cast-only {expected - covered}"
        assert expected, f"block {i} keeps nothing in fp32: the keep-list no longer matches the model's names"


def test_cast_keeps_exactly_the_keep_list_in_fp32(model):
    bf16 = cast_model(Glm53ForCausalLM(Glm53Config.tiny(num_nextn_predict_layers=1)), torch.bfloat16)
    for name, tensor in [*bf16.named_parameters(), *bf16.named_buffers()]:
        if tensor.is_floating_point():
            assert tensor.dtype == (torch.float32 if keeps_fp32(name) else torch.bfloat16), name
    kept = {n for n, _ in bf16.named_parameters() if keeps_fp32(n)}
    # every fp32 family is present: mHC fn/base/scale, router weight, KDA convs, dt_bias, A_log
    for suffix in ("attn_hc.fn", "ffn_hc.base", "mlp.gate.weight", "q_conv1d.weight", "dt_bias", "A_log"):
        assert any(n.endswith(suffix) for n in kept), suffix


def test_kda_fp32_unit_nests_its_projections(model):
    kda = model.model.layers[0].self_attn
    fp32, low = fp32_units(model.model.layers[0])
    assert kda in fp32 and kda.q_proj in low and kda.o_norm in low
    assert all(conv not in low for conv in (kda.q_conv1d, kda.k_conv1d, kda.v_conv1d))
