"""The model's public helpers with arguments of the wrong type: from_pretrained's device, save_pretrained's flags
and shard size, cast_model's dtype, loss_counts' labels. Each names the argument; a truthy string never replaces a
checkpoint. Legend: B batch, T time."""

import os

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.config import Glm53Config
from glm53.errors import ConfigError, InputError
from glm53.precision import cast_model, resolve_device


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config.tiny())
    path = tmp_path_factory.mktemp("ckpt") / "model"
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize(
    "device,match",
    [
        ("foo", "device='foo' is not a device"),
        (3.5, "device must be a torch.device.* got 3.5 \\(float\\)"),
        (None, "got None"),
        (True, "got True"),
        ("cuda:x", "device='cuda:x' is not a device"),
    ],
)
def test_from_pretrained_device(saved, device, match):
    with pytest.raises(TypeError, match=match):
        Glm53ForCausalLM.from_pretrained(saved[1], device=device)


def test_resolve_device_accepts_the_usual_forms():
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("meta").type == "meta"


@pytest.mark.parametrize("flag", ["overwrite", "allow_non_finite"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_save_flags_must_be_bools(saved, flag, value):
    model, path = saved
    before = {f: os.path.getmtime(path / f) for f in os.listdir(path)}
    with pytest.raises(TypeError, match=f"{flag} must be True or False, got {value!r}"):
        model.save_pretrained(path, **{flag: value})
    assert {f: os.path.getmtime(path / f) for f in os.listdir(path)} == before  # nothing replaced


@pytest.mark.parametrize("size", [1.5, 1e9, [5], b"5GB"])
def test_max_shard_size_of_another_type(saved, tmp_path, size):
    with pytest.raises(ValueError, match="max_shard_size must be an int or a size like '5GB'"):
        saved[0].save_pretrained(tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "dtype,match",
    [
        ("bf16", "dtype='bf16' is not a torch dtype name"),
        (torch.int8, "must be a floating dtype"),
        (3, "must be a torch.dtype or its name"),
    ],
)
def test_cast_model_dtype(dtype, match):
    model = Glm53ForCausalLM(Glm53Config.tiny(num_hidden_layers=1, mlp_layer_types=["dense"]))
    with pytest.raises(TypeError, match=match):
        cast_model(model, dtype)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing half-cast


@pytest.mark.parametrize(
    "labels,error,match",
    [
        ([[1, 2, 3]], TypeError, "labels must be a torch.Tensor"),
        (torch.ones(2, 3), InputError, "labels must hold integer token ids"),
        (torch.ones(3, dtype=torch.long), InputError, r"labels must be \[batch, seq\]"),
        (torch.tensor([[1, 320]]), InputError, "labels holds 320, outside"),
    ],
)
def test_loss_counts_labels(saved, labels, error, match):
    with pytest.raises(error, match=match):
        saved[0].loss_counts(labels)


@pytest.mark.parametrize("config", [None, {"vocab_size": 320}, "config.json"])
def test_model_needs_a_config(config):
    with pytest.raises(TypeError, match="config must be a Glm53Config"):
        Glm53ForCausalLM(config)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("hidden_size", "32", "hidden_size must be a positive int, got '32'"),
        ("num_experts_per_tok", 100, r"num_experts_per_tok \(100\) must not exceed n_routed_experts"),
        ("layer_types", ["linear_attention"], "layer_types has 1 entries but num_hidden_layers is 4"),
    ],
)
def test_config_changed_after_construction_is_checked_by_the_model(field, value, match):
    config = Glm53Config.tiny()
    setattr(config, field, value)
    with pytest.raises(ConfigError, match=match):
        Glm53ForCausalLM(config)


def test_forward_context_of_another_type(saved):
    with pytest.raises(TypeError, match="ctx must be a ForwardContext or None, got dict"):
        saved[0].model(torch.ones(1, 4, dtype=torch.long), ctx={})


@pytest.mark.parametrize("path", [None, 3, ["dir"]])
def test_paths_of_another_type(saved, path):
    for call in (Glm53Config.from_pretrained, Glm53ForCausalLM.from_pretrained, saved[0].save_pretrained):
        with pytest.raises(TypeError, match=f"path must be a .*, got {type(path).__name__}"):
            call(path)
