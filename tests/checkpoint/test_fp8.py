"""FP8 block dequantisation: vectorised vs per-block loop, round-off bounds, and FP8 checkpoints loading directly."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm53 import Glm53ForCausalLM
from glm53.checkpoint import CheckpointError, fp8, iter_official_state
from tests.helpers.checkpoints import (
    BLOCK,
    TEXT,
    fp8_config_dict,
    fp8_error_bound,
    fp8_source,
    quantize_state,
    random_model,
    read_all,
    tiny_config,
    write_checkpoint,
)


@pytest.mark.parametrize(
    "shape,block",
    [((37, 53), (4, 8)), ((16, 36), (4, 8)), ((8, 8), (4, 8)), ((300, 130), (128, 128)), ((5, 3), (128, 128))],
    ids=["37x53-b4x8", "16x36-b4x8", "8x8-b4x8-exact", "300x130-b128", "5x3-b128"],
)
def test_dequantize_matches_block_loop(shape, block):
    gen = torch.Generator().manual_seed(1)
    q = (torch.randn(shape, generator=gen) * 50).clamp(-448, 448).to(fp8.FP8_DTYPE)
    scale = torch.rand(fp8.scale_shape(shape, block), generator=gen) + 0.01
    fast = fp8.dequantize(q, scale, block)
    ref = fp8.dequantize_reference(q, scale, block)
    assert torch.equal(fast, ref)
    # Spot-check the last (partial) block by hand.
    r, c = shape[0] - 1, shape[1] - 1
    assert fast[r, c].item() == (q[r, c].float() * scale[r // block[0], c // block[1]]).item()  # fp32 product
    assert torch.equal(fp8.dequantize(q, scale, block, torch.bfloat16), ref.to(torch.bfloat16))


def test_quantize_round_off_within_fp8_error():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(37, 53, generator=gen) * torch.logspace(-3, 1, 53)  # columns of very different magnitude
    q, scale = fp8.quantize(w, BLOCK)
    assert q.dtype == fp8.FP8_DTYPE and scale.shape == (10, 7)
    err = (fp8.dequantize(q, scale, BLOCK) - w).abs()
    assert bool((err <= fp8_error_bound(w, scale)).all())
    assert err.max().item() > 0  # really quantised
    # Each block's largest magnitude maps onto the e4m3 maximum.
    assert q.float().abs().amax().item() == fp8.FP8_MAX


def test_scale_shape_errors_name_the_key():
    with pytest.raises(ValueError, match=r"'a\.weight' has no 'a\.weight_scale_inv'"):
        fp8.check_scale("a.weight", (9, 9), None, (4, 8))
    with pytest.raises(ValueError, match=r"'a\.weight_scale_inv' has shape \(2, 2\), expected \(3, 2\)"):
        fp8.check_scale("a.weight", (9, 9), (2, 2), (4, 8))
    assert fp8.weight_block_size(None) == (128, 128)
    assert fp8.weight_block_size({"weight_block_size": [4, 8]}) == (4, 8)


def test_sharded_fp8_checkpoint_loads_directly():
    path, original = fp8_source()
    stored = read_all(path)
    assert any(k.endswith("_scale_inv") for k in stored)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    model = Glm53ForCausalLM.from_pretrained(path, dtype=torch.float32)
    loaded = dict(iter_official_state(model))
    n_fp8 = 0
    for key, tensor in loaded.items():
        if key + fp8.SCALE_SUFFIX in stored:
            n_fp8 += 1
            scale = stored[key + fp8.SCALE_SUFFIX]
            assert torch.equal(tensor, fp8.dequantize_reference(stored[key], scale, BLOCK)), key
            assert bool(((tensor - original[key]).abs() <= fp8_error_bound(original[key], scale)).all()), key
        else:
            assert torch.equal(tensor, original[key]), key  # not quantised: exact
    assert n_fp8 > 40
    # The MTP layer (layers.4) and the vision tower are recognised, not loaded.
    assert len(model.mtp_checkpoint_keys) == sum(
        k.startswith(f"{TEXT}layers.4.") for k in stored if not k.endswith("_scale_inv")
    )
    # bf16 request: the dequantised values rounded once to bf16; fp32-kept tensors stay fp32.
    bf16 = Glm53ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    key = f"{TEXT}layers.1.self_attn.q_a_proj.weight"
    assert torch.equal(bf16.model.layers[1].self_attn.q_a_proj.weight, loaded[key].to(torch.bfloat16))
    assert bf16.model.layers[0].self_attn.dt_bias.dtype == torch.float32


def _small_fp8(tmp_path, block=BLOCK, with_block_in_config=True):
    config = tiny_config()
    model = random_model(config)
    state = {k: v.detach().clone() for k, v in iter_official_state(model)}
    cfg = fp8_config_dict(config, block)
    if not with_block_in_config:
        del cfg["quantization_config"]["weight_block_size"]
    path = str(tmp_path / "fp8")
    write_checkpoint(path, quantize_state(state, block), cfg, sharded=False)
    return path, state


def test_block_128_default_from_config(tmp_path):
    path, original = _small_fp8(tmp_path, block=(128, 128), with_block_in_config=False)
    key = f"{TEXT}layers.0.self_attn.q_proj.weight"
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice(key + "_scale_inv").get_shape()) == (1, 1)  # one partial 128x128 block
        q, scale = f.get_tensor(key), f.get_tensor(key + "_scale_inv")
    model = Glm53ForCausalLM.from_pretrained(path)  # config dtype: bfloat16
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    model = Glm53ForCausalLM.from_pretrained(path, dtype=torch.float32)
    w = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, fp8.dequantize_reference(q, scale, (128, 128)))
    assert bool(((w - original[key]).abs() <= fp8_error_bound(original[key], scale, (128, 128))).all())


def _edit(path, fn):
    """Rewrite the single-file checkpoint with fn(state)."""
    file = os.path.join(path, "model.safetensors")
    with safe_open(file, "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    fn(state)
    save_file(state, file, metadata={"format": "pt"})


def test_missing_misshaped_and_nonfinite_scales_raise_naming_the_key(tmp_path):
    path, _ = _small_fp8(tmp_path)
    key = f"{TEXT}layers.1.self_attn.kv_b_proj.weight"
    for name, fn, pattern in [
        ("missing", lambda s: s.pop(key + "_scale_inv"), rf"'{key}' has no '{key}_scale_inv'"),
        (
            "shape",
            lambda s: s.__setitem__(key + "_scale_inv", torch.ones(2, 2)),
            rf"'{key}_scale_inv' has shape \(2, 2\), expected \(8, 2\)",
        ),
        ("inf", lambda s: s[key + "_scale_inv"].__setitem__((0, 0), float("inf")), rf"'{key}' holds NaN or infinite"),
    ]:
        broken = str(tmp_path / name)
        shutil.copytree(path, broken)
        _edit(broken, fn)
        with pytest.raises(CheckpointError, match=pattern):
            Glm53ForCausalLM.from_pretrained(broken)


def test_orphan_scale_is_unexpected(tmp_path):
    path, _ = _small_fp8(tmp_path)
    _edit(path, lambda s: s.__setitem__(f"{TEXT}layers.0.nothing.weight_scale_inv", torch.ones(1, 1)))
    with pytest.raises(CheckpointError, match=r"unexpected keys:\n  model\.language_model\.layers\.0\.nothing\."):
        Glm53ForCausalLM.from_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [4, 8]
