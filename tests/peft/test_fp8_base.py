"""A frozen FP8 base (glm53.peft.fp8 / load_base): FP8 in memory, the same numbers as the dequantised model,
quantise-on-load round trip, merged bf16 export, bad input. Checkpoints: tests/helpers/checkpoints.py (block 4 x 8
with hidden 36: partial edge blocks everywhere)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import glm53
from glm53 import Glm53ForCausalLM
from glm53.checkpoint import fp8 as fp8_format
from glm53.errors import CheckpointError, ConfigError
from glm53.model.moe import Experts
from glm53.peft import fp8_bytes, load_base, quantize_model
from glm53.peft.fp8 import SCALE, dequantize_blocks
from glm53.peft.fp8_storage import fp8_modules
from tests.helpers.checkpoints import (
    BLOCK,
    fp8_error_bound,
    fp8_source,
    random_model,
    read_all,
    tiny_config,
)
from tests.peft.helpers import EPS32, ids, randomize_adapters, rel_err


@pytest.fixture(scope="module")
def fp8_pair():
    path, _ = fp8_source()
    return (
        path,
        load_base(Glm53ForCausalLM, path, "fp8", dtype=torch.float32).eval(),
        Glm53ForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
    )


def _bytes(model):
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_weights_stay_fp8_in_memory(fp8_pair):
    _, model, ref = fp8_pair
    eligible = fp8_modules(model)
    assert any(isinstance(m, Experts) for m in eligible.values()) and len(eligible) > 30
    fp8_numel = 0
    for name, module in eligible.items():
        for p in ("gate_up_proj", "down_proj") if isinstance(module, Experts) else ("weight",):
            assert getattr(module, p).dtype == fp8_format.FP8_DTYPE and not getattr(module, p).requires_grad, name
            fp8_numel += getattr(module, p).numel()
    values, scales = fp8_bytes(model)
    assert values == fp8_numel
    # exactly the FP8 values (1 byte) and their fp32 scales replace the dequantised fp32 weights (4 bytes)
    assert _bytes(model) == _bytes(ref) - 4 * fp8_numel + values + scales
    assert model.model.embed_tokens.weight.dtype == torch.float32  # not in the FP8 set
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_forward_and_adapter_gradients_equal_the_dequantised_model(fp8_pair):
    _, model, ref = fp8_pair
    x = ids(T=17)
    with torch.no_grad():
        # the same fp32 products per element (checkpoint/fp8.py's rule), then the same matmuls: equal
        assert torch.equal(model(x).logits, ref(x).logits)
    grads = []
    for m in (model, ref):
        torch.manual_seed(0)
        glm53.apply_lora(m, 4, 8)
        randomize_adapters(m)
        m.train()
        m(x, labels=x).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
        m.eval()
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 43 + 2 * 3  # 43 modules, 3 expert layers
    # the FP8 linear's backward is the same matmul (grad @ W) on the same dequantised W; summation order of the
    # frozen path may differ by one fp32 rounding per reduction step: (D + r) eps relative
    for name in grads[0]:
        assert rel_err(grads[0][name], grads[1][name]) <= (36 + 4) * EPS32, name
    for m in (model, ref):
        glm53.merge_lora(m, dtype=torch.float32)


def test_fp8_linear_keeps_no_dequantised_copy_for_backward():
    model = random_model(tiny_config())
    quantize_model(model, BLOCK)
    q_a = model.model.layers[1].self_attn.q_a_proj
    x = torch.randn(5, 36, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = q_a(x)
    assert {t.dtype for t in saved} == {fp8_format.FP8_DTYPE, torch.float32} and len(saved) == 2  # q and its scale
    y.backward(torch.ones_like(y))
    w = dequantize_blocks(q_a.weight, q_a.weight_scale_inv, BLOCK, torch.float32)
    x2 = x.detach().clone().requires_grad_()
    F.linear(x2, w).backward(torch.ones_like(y))
    assert torch.equal(x.grad, x2.grad)


def test_dequantize_blocks_matches_the_checkpoint_rule():
    gen = torch.Generator().manual_seed(0)
    for shape, block in [((36, 20), (4, 8)), ((32, 16), (4, 8)), ((20, 12), (128, 128))]:
        q, s = fp8_format.quantize(torch.randn(shape, generator=gen), block)
        assert torch.equal(dequantize_blocks(q, s, block, torch.float32), fp8_format.dequantize_reference(q, s, block))


def test_bf16_checkpoint_quantised_on_load_round_trips(tmp_path):
    source = random_model(tiny_config(), seed=3)
    source.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    original = {k: v.float() for k, v in read_all(str(tmp_path / "bf16")).items()}
    with pytest.raises(ConfigError, match="no block-scaled FP8 weights.*quantize=True"):
        load_base(Glm53ForCausalLM, tmp_path / "bf16", "fp8")
    model = load_base(Glm53ForCausalLM, tmp_path / "bf16", "fp8", dtype=torch.float32, quantize=True)
    q_a = model.model.layers[1].self_attn.q_a_proj
    key = "model.language_model.layers.1.self_attn.q_a_proj.weight"
    deq = dequantize_blocks(q_a.weight, q_a.weight_scale_inv, fp8_format.DEFAULT_BLOCK_SIZE, torch.float32)
    assert torch.equal(deq, fp8_format.dequantize(*fp8_format.quantize(original[key])))
    scale = q_a.weight_scale_inv
    assert ((deq - original[key]).abs() <= fp8_error_bound(original[key], scale, (128, 128))).all()
    # export the dequantised base, quantise it again: the same FP8 bytes (amax maps to 448 exactly both times)
    glm53.merge_lora(model, dtype=torch.float32)
    model.save_pretrained(tmp_path / "deq")
    again = load_base(Glm53ForCausalLM, tmp_path / "deq", "fp8", dtype=torch.float32, quantize=True)
    model2 = load_base(Glm53ForCausalLM, tmp_path / "bf16", "fp8", dtype=torch.float32, quantize=True)
    for (n, a), (_, b) in zip(again.named_parameters(), model2.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(
            a.view(torch.uint8) if a.dtype == fp8_format.FP8_DTYPE else a,
            b.view(torch.uint8) if b.dtype == fp8_format.FP8_DTYPE else b,
        ), n
    experts = again.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == fp8_format.FP8_DTYPE
    assert tuple(getattr(experts, "gate_up_proj" + SCALE).shape) == (8, 2, 1)  # gate and up grids: [E, 2*1, 1]


def test_merged_export_from_fp8_base_is_bf16(fp8_pair, tmp_path):
    path, _, _ = fp8_pair
    model = load_base(Glm53ForCausalLM, path, "fp8", dtype=torch.float32).eval()
    glm53.apply_lora(model, 4, 8)
    randomize_adapters(model)
    kv_b = model.model.layers[1].self_attn.kv_b_proj
    expected = (
        dequantize_blocks(kv_b.weight, kv_b.weight_scale_inv, BLOCK, torch.float32)
        + kv_b.lora_scale * kv_b.lora_B.weight @ kv_b.lora_A.weight
    ).to(torch.bfloat16)
    glm53.merge_lora(model)  # dequantise, merge, bf16
    assert kv_b.weight.dtype == torch.bfloat16 and not hasattr(kv_b, "weight" + SCALE)
    # one fp32 product per element plus the r-long B A sum: within (r + 2) eps32 of the fp32 result before the cast
    assert rel_err(kv_b.weight, expected) <= (4 + 2) * EPS32
    assert fp8_bytes(model) == (0, 0)
    out = model.save_pretrained(tmp_path / "merged")
    stored = read_all(out)
    assert stored["model.language_model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(stored["model.language_model.layers.1.self_attn.kv_b_proj.weight"], kv_b.weight)
    assert not any(k.endswith(SCALE) for k in stored)


def test_in_memory_quantisation_and_unknown_base_dtype():
    model = random_model(tiny_config())
    done = quantize_model(model, BLOCK)
    assert "model.layers.1.mlp.experts" in done and "lm_head" not in done
    x = ids()
    with torch.no_grad():
        logits = model(x).logits
        glm53.merge_lora(model, dtype=torch.float32)  # dequantised copy of the same numbers
        assert torch.equal(model(x).logits, logits)
    with pytest.raises(ConfigError, match="base_dtype must be one of"):
        load_base(Glm53ForCausalLM, "unused", "int4")


def test_load_pretrained_quantises_the_wider_keys_of_a_mixed_checkpoint_as_load_base(tmp_path):
    """glm53.parallel.load_pretrained(quantize=True) (what --quantize-base runs per rank under torchrun) on a model
    with FP8 placeholders: the stored FP8 keys read raw, the wider ones (layer 0's, kept unquantised here) quantised
    on read in the checkpoint's 4 x 8 blocks; the same FP8 bytes and scales as load_base(quantize=True)."""
    from glm53.config import Glm53Config
    from glm53.parallel import load_pretrained
    from glm53.peft.load import fp8_placeholders
    from tests.helpers.checkpoints import fp8_config_dict, quantize_state, write_checkpoint

    _, state = fp8_source()
    wide = {k: v for k, v in state.items() if ".layers.0." in k}
    mixed = {**quantize_state({k: v for k, v in state.items() if k not in wide}), **wide}
    write_checkpoint(str(tmp_path / "mixed"), mixed, fp8_config_dict(tiny_config()))
    want = load_base(Glm53ForCausalLM, tmp_path / "mixed", "fp8", dtype=torch.float32, quantize=True)
    with torch.device("meta"):
        got = Glm53ForCausalLM(Glm53Config.from_pretrained(tmp_path / "mixed"))
    fp8_placeholders(got, tmp_path / "mixed", torch.float32, quantize=True)
    load_pretrained(got, tmp_path / "mixed", quantize=True)
    held = [n for n, p in want.named_parameters() if p.dtype == fp8_format.FP8_DTYPE]
    assert any(".layers.0." in n for n in held) and any(".layers.1." in n for n in held)
    tensors = {**dict(got.named_parameters()), **dict(got.named_buffers())}
    for name, value in [*want.named_parameters(), *want.named_buffers()]:
        bits = (lambda t: t.view(torch.uint8)) if value.dtype == fp8_format.FP8_DTYPE else (lambda t: t)
        assert tensors[name].dtype == value.dtype and torch.equal(bits(tensors[name]), bits(value)), name
    with pytest.raises(CheckpointError, match="holds it in FP8"):  # without quantize: the wider keys are refused
        load_pretrained(got, tmp_path / "mixed")
