"""FP8 block dequantisation: vectorised vs per-block loop, round-off bounds, and FP8 checkpoints loading directly.

FP8 block scaling at its edges: bad `weight_block_size` values are ConfigErrors naming the field, all-zero blocks
quantise to exact zeros with scale 1, and a scale of the wrong shape is refused (not cropped or broadcast).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm53 import Glm53ForCausalLM
from glm53.checkpoint import CheckpointError, fp8, iter_official_state
from glm53.errors import ConfigError
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


# --------------------------------------------------------------------------------------- FP8 block scaling at its edges
@pytest.mark.parametrize("block", [[0, 8], [4, -1], [True, 8], [4.0, 8], [128], [4, 8, 2], "4x8", 128], ids=repr)
def test_bad_block_size_is_a_config_error(block):
    with pytest.raises(ConfigError, match=r"quantization_config\.weight_block_size must be two positive ints"):
        fp8.weight_block_size({"weight_block_size": block})


def test_block_size_defaults_and_non_dict_config():
    assert fp8.weight_block_size({}) == fp8.weight_block_size({"weight_block_size": None}) == (128, 128)
    assert fp8.weight_block_size({"weight_block_size": (3, 5)}) == (3, 5)
    with pytest.raises(ConfigError, match=r"quantization_config must be a dict, got \[4, 8\]"):
        fp8.weight_block_size([4, 8])


def test_zero_blocks_quantise_to_exact_zeros():
    """A block that is all zero (pruned rows, padding) has no amax: scale 1, q 0, dequantised 0 (not 0/0)."""
    w = torch.zeros(6, 10)
    w[4:, 8:] = torch.tensor([[1.5, -3.0], [0.25, 7.0]])  # only the last (partial) block is non-zero
    q, scale = fp8.quantize(w, (4, 8))
    assert torch.equal(scale, torch.tensor([[1.0, 1.0], [1.0, 7.0 / fp8.FP8_MAX]]))
    out = fp8.dequantize(q, scale, (4, 8))
    assert torch.equal(out[:4], torch.zeros(4, 10)) and torch.equal(out[4:, :8], torch.zeros(2, 8))
    assert out[5, 9].item() == 7.0 and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("scale_shape", [(3, 2), (2, 3), (1, 2), (2, 1), (4,)], ids=str)
@pytest.mark.parametrize("fn", [fp8.dequantize, fp8.dequantize_reference], ids=["fast", "reference"])
def test_dequantize_refuses_a_scale_of_the_wrong_shape(fn, scale_shape):
    """Weight [8, 16] with blocks 4 x 8 needs a [2, 2] scale; a larger one must not be cropped silently."""
    q = torch.ones(8, 16).to(fp8.FP8_DTYPE)
    with pytest.raises(ValueError, match=r"'weight_scale_inv' has shape .*expected \(2, 2\) for weight \(8, 16\)"):
        fn(q, torch.ones(scale_shape), (4, 8))


def test_fp8_tensors_must_be_2d():
    with pytest.raises(ValueError, match=r"FP8 tensor 'k' must be 2-D for block scaling, got shape \(2, 4, 8\)"):
        fp8.check_scale("k", (2, 4, 8), (1, 1), (4, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_both_dequantisations_return_the_requested_dtype(dtype):
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(9, 17, generator=gen) * 40).to(fp8.FP8_DTYPE)
    scale = torch.rand(3, 3, generator=gen) + 0.5
    fast, ref = fp8.dequantize(q, scale, (4, 8), dtype), fp8.dequantize_reference(q, scale, (4, 8), dtype)
    assert fast.dtype == ref.dtype == dtype and torch.equal(fast, ref)
    assert fast[8, 16].item() == (q[8, 16].float() * scale[2, 2]).to(dtype).item()
