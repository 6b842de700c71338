"""load_checkpoint's key matching at its edges: the last expert and a partial MTP layer count as missing, two
stored forms of one tensor are refused rather than one silently overwriting the other, and the stored `dtype` /
block size are read at both config levels."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import CheckpointError
from glm53.errors import ConfigError

P = "model.language_model."
SINGLE = "model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny checkpoint with one MTP layer (num_hidden_layers 4, so the MTP layer is stored as layers.4)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("load") / "ckpt"
    model = Glm53ForCausalLM(Glm53Config.tiny(num_nextn_predict_layers=1))
    model.save_pretrained(path)
    return path, model


@pytest.fixture
def ckpt(saved, tmp_path):
    return shutil.copytree(saved[0], tmp_path / "ckpt")


def rewrite(path, edit) -> None:
    tensors = load_file(str(path / SINGLE))
    edit(tensors)
    save_file(tensors, str(path / SINGLE), metadata={"format": "pt"})


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        Glm53ForCausalLM.from_pretrained(path)
    return str(info.value)


@pytest.mark.parametrize("part", ["gate", "up", "down"])
def test_last_expert_missing(ckpt, part):
    last = Glm53Config.tiny().n_routed_experts - 1
    key = f"{P}layers.1.mlp.experts.{last}.{part}_proj.weight"
    rewrite(ckpt, lambda t: t.pop(key))
    assert re.search(r"(?s)missing keys \(expected shape\):\n  " + re.escape(key), load_error(ckpt))


@pytest.mark.parametrize("rest", ["eh_proj.weight", "mlp.experts.3.down_proj.weight", "self_attn.indexer.wk.weight"])
def test_partial_mtp_layer_is_missing_keys(ckpt, rest):
    """Some MTP tensors present and one absent: an error naming it, not a half-initialised MTP module."""
    key = f"{P}layers.4.{rest}"
    rewrite(ckpt, lambda t: t.pop(key))
    assert re.search(r"(?s)missing keys \(expected shape\):.*" + re.escape(key), load_error(ckpt))


def test_mtp_tensors_load_where_they_belong(saved):
    path, model = saved
    loaded = Glm53ForCausalLM.from_pretrained(path)
    for name, tensor in model.mtp.state_dict().items():
        assert torch.equal(loaded.mtp.state_dict()[name], tensor), name
    assert loaded.mtp_checkpoint_keys == []


@pytest.mark.parametrize("kind", ["hc", "experts"])
def test_two_forms_of_one_tensor_are_refused(saved, ckpt, kind):
    """glm53's own name beside the official one (hc_attn_fn / attn_hc.fn; fused experts / per-expert keys)."""
    model = saved[1]
    if kind == "hc":
        extra, tensor = f"{P}layers.0.attn_hc.fn", torch.zeros_like(model.model.layers[0].attn_hc.fn)
        named = r"layers\.0\.(attn_hc\.fn|hc_attn_fn)"
    else:
        extra = f"{P}layers.1.mlp.experts.down_proj"
        tensor = torch.zeros_like(model.model.layers[1].mlp.experts.down_proj)
        named = re.escape(extra)
    rewrite(ckpt, lambda t: t.__setitem__(extra, tensor))
    assert re.search(r"(?s)unexpected keys:.*" + named, load_error(ckpt))


def test_fused_experts_alone_load(saved, ckpt):
    """The fused form by itself is accepted (one source per tensor)."""
    fused = saved[1].model.layers[1].mlp.experts.down_proj.detach()

    def fuse(t):
        for e in range(fused.shape[0]):
            t.pop(f"{P}layers.1.mlp.experts.{e}.down_proj.weight")
        t[f"{P}layers.1.mlp.experts.down_proj"] = fused.clone()

    rewrite(ckpt, fuse)
    assert torch.equal(Glm53ForCausalLM.from_pretrained(ckpt).model.layers[1].mlp.experts.down_proj, fused)


@pytest.mark.parametrize("level", ["outer", "text", "absent"])
def test_stored_dtype_is_read_at_either_level(ckpt, level):
    """config.json's `dtype` at the outer or the text level; neither: fp32."""
    config = json.loads((ckpt / "config.json").read_text())
    for d in (config, config["text_config"]):
        d.pop("dtype", None), d.pop("torch_dtype", None)
    if level != "absent":
        (config if level == "outer" else config["text_config"])["dtype"] = "float16"
    (ckpt / "config.json").write_text(json.dumps(config))
    model = Glm53ForCausalLM.from_pretrained(ckpt)
    assert model.model.embed_tokens.weight.dtype == (torch.float32 if level == "absent" else torch.float16)
    assert model.model.layers[0].self_attn.A_log.dtype == torch.float32


def test_expert_of_an_integer_dtype_is_refused(ckpt):
    key = f"{P}layers.1.mlp.experts.2.up_proj.weight"
    rewrite(ckpt, lambda t: t.__setitem__(key, (t[key] * 100).to(torch.int32)))
    message = load_error(ckpt)
    assert re.search(rf"{re.escape(key)}: I32, but model.layers.1.mlp.experts.gate_up_proj is float32", message)


def test_checkpoint_without_mtp_tensors_initialises_the_mtp_module(tmp_path, caplog):
    """A model with an MTP layer from a checkpoint with none (transformers drops them): the MTP module gets its
    init_weights values (norms at 1, projections at the configured std), not the memory `to_empty` left."""
    torch.manual_seed(0)
    Glm53ForCausalLM(Glm53Config.tiny()).save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 1
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="glm53.checkpoint"):
        mtp = Glm53ForCausalLM.from_pretrained(tmp_path / "plain").mtp.layers[0]
    assert any("has no MTP tensors (layers.4.*)" in r.getMessage() for r in caplog.records)
    assert torch.equal(mtp.enorm.weight, torch.ones_like(mtp.enorm.weight))
    std = Glm53Config.tiny().initializer_range
    assert 0.8 * std < float(mtp.eh_proj.weight.detach().std()) < 1.2 * std


@pytest.mark.parametrize("stored", ["int8", "bool", "float99"])
def test_stored_dtype_that_is_not_a_floating_dtype(ckpt, stored):
    config = json.loads((ckpt / "config.json").read_text())
    config["dtype"] = stored
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"config.json: dtype(={stored!r} is not a torch dtype| must be a floating)"):
        Glm53ForCausalLM.from_pretrained(ckpt)


def test_mtp_copies_of_the_shared_embedding_and_head_are_set_aside(saved, ckpt):
    """Some releases store the embedding / head inside the MTP layer (DeepSeek-V3): glm53 shares the main
    model's, so those keys are set aside and listed, not loaded or refused."""
    copies = [f"{P}layers.4.embed_tokens.weight", f"{P}layers.4.shared_head.head.weight"]
    rewrite(ckpt, lambda t: t.update({k: torch.zeros(320, 32) for k in copies}))
    model = Glm53ForCausalLM.from_pretrained(ckpt)
    assert model.mtp_checkpoint_keys == sorted(copies)
    assert torch.equal(model.lm_head.weight, saved[1].lm_head.weight)


@pytest.mark.parametrize("key", [f"{P}layers.0.hc_attn_fn", f"{P}layers.1.mlp.experts.3.up_proj.weight"])
def test_a_renamed_key_is_not_taken_for_the_original(ckpt, key):
    """`<key>_old` (a stray backup name) is unexpected and `<key>` missing; it never fills the original's place."""
    rewrite(ckpt, lambda t: t.__setitem__(key + "_old", t.pop(key)))
    message = load_error(ckpt)
    assert re.search(r"(?s)missing keys \(expected shape\):.*" + re.escape(key) + " ", message)
    assert re.search(r"(?s)unexpected keys:.*" + re.escape(key + "_old"), message)
