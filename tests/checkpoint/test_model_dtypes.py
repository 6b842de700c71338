"""A glm53 model holds its weights in fp32, bf16, fp16 or fp64 only. FP8 (and other narrow floating dtypes)
need per-block scales, so every way of asking for one is refused with an error naming the argument or the file:
a config.json whose stored dtype is FP8 used to load into an FP8-cast model that could neither train nor load back."""

import json

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.errors import ConfigError
from glm53.precision import MODEL_DTYPES, cast_model
from tests.helpers.checkpoints import tiny_config

NARROW = [torch.float8_e4m3fn, torch.float8_e5m2, "float8_e4m3fn", "torch.float8_e5m2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("dtypes") / "ckpt"
    Glm53ForCausalLM(tiny_config()).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", NARROW)
def test_narrow_dtypes_are_refused_everywhere(saved, tmp_path, dtype):
    model = Glm53ForCausalLM(tiny_config())
    before = {k: v.dtype for k, v in model.state_dict().items()}
    calls = [
        lambda: Glm53ForCausalLM.from_pretrained(saved, dtype=dtype),
        lambda: model.to_dtype(dtype),
        lambda: cast_model(model, dtype),
        lambda: Glm53ForCausalLM.from_config(tiny_config(), dtype=dtype),
        lambda: model.save_pretrained(tmp_path / "out", dtype=dtype),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"dtype must be one of \['float32', 'bfloat16', 'float16', 'float64'\]"):
            call()
    assert {k: v.dtype for k, v in model.state_dict().items()} == before  # refused before any cast
    assert not (tmp_path / "out").exists()


def test_a_stored_fp8_dtype_is_a_config_error_naming_the_file(saved, tmp_path):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "float8_e4m3fn"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json: dtype must be one of .* got torch.float8_e4m3fn"):
        Glm53ForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_model_dtypes_load(saved, dtype):
    model = Glm53ForCausalLM.from_pretrained(saved, dtype=dtype)
    assert model.model.embed_tokens.weight.dtype == dtype


def test_values_beyond_fp16_range_are_refused_not_written_as_inf(tmp_path):
    """fp16 holds at most 65504: casting, saving or loading a larger value as fp16 would make it inf (and the saved
    checkpoint then fails to load). Each way is refused naming the tensor, before anything is cast or written;
    bf16 (fp32's range) takes the same model unchanged."""
    from glm53.errors import CheckpointError

    model = Glm53ForCausalLM(tiny_config())
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 1e5
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(CheckpointError, match=rf"saving as float16 .*\+-65504.* {name} \(max \|x\| 1e\+05\)"):
        model.save_pretrained(tmp_path / "half", dtype=torch.float16)
    assert not (tmp_path / "half").exists()
    before = {k: v.dtype for k, v in model.state_dict().items()}
    for cast in (lambda: model.to_dtype(torch.float16), lambda: cast_model(model, "float16")):
        with pytest.raises(ValueError, match=rf"casting to float16 .* {name}"):
            cast()
    assert {k: v.dtype for k, v in model.state_dict().items()} == before
    model.save_pretrained(tmp_path / "full")
    with pytest.raises(CheckpointError, match=r"loading as float16 .*layers\.0\.mlp\.down_proj\.weight"):
        Glm53ForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float16)
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    loaded = Glm53ForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.model.layers[0].mlp.down_proj.weight[0, 0].item() == 99840.0  # 1e5 rounded to bf16, finite
