"""Glm53ForCausalLM.from_pretrained on checkpoints written by transformers' save_pretrained (the official layout).

Good checkpoints: every tensor lands where it belongs, sharded == single file, vision keys skipped, the MTP layer set
aside, tied embeddings. Bad checkpoints: each failure raises with a message naming the offending key or file.

load_checkpoint's key matching at its edges: the last expert and a partial MTP layer count as missing, two
stored forms of one tensor are refused rather than one silently overwriting the other, and the stored `dtype` /
block size are read at both config levels.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import CheckpointError, iter_official_state
from glm53.errors import ConfigError
from tests.helpers.oracle import hf_model

PREFIX = "model.language_model."
SINGLE = "model.safetensors"


def config(**overrides) -> Glm53Config:
    return Glm53Config.tiny(**overrides)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Directories written by transformers: single file, sharded, and a tied-embedding model."""
    root = tmp_path_factory.mktemp("ckpt")
    model = hf_model(config(), seed=1)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    hf_model(config(tie_word_embeddings=True), seed=2).save_pretrained(root / "tied")
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy of the single-file checkpoint, safe to corrupt."""
    return shutil.copytree(saved / "single", tmp_path / "ckpt")


def rewrite(path, edit) -> None:
    """Load model.safetensors, let `edit` change the dict, write it back (safetensors only)."""
    tensors = load_file(str(path / SINGLE))
    edit(tensors)
    save_file(tensors, str(path / SINGLE), metadata={"format": "pt"})


def logits(model, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


# ------------------------------------------------------------------------------------------ good checkpoints
def test_every_tensor_lands_where_it_belongs(saved):
    model = Glm53ForCausalLM.from_pretrained(saved / "single")
    on_disk = load_file(str(saved / "single" / SINGLE))
    ours = dict(iter_official_state(model))
    text_keys = {k for k in on_disk if not k.startswith("model.visual.")}
    assert set(ours) == text_keys
    for key, tensor in ours.items():
        assert torch.equal(tensor, on_disk[key]), key
    assert model.mtp_checkpoint_keys == []
    assert torch.isfinite(logits(model)).all()


def test_sharded_checkpoint_gives_the_same_logits(saved):
    shards = sorted(p.name for p in (saved / "sharded").glob("*.safetensors"))
    assert len(shards) > 3 and (saved / "sharded" / "model.safetensors.index.json").is_file()
    single = Glm53ForCausalLM.from_pretrained(saved / "single")
    sharded = Glm53ForCausalLM.from_pretrained(saved / "sharded")
    assert torch.equal(logits(single), logits(sharded))
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_vision_keys_are_skipped(saved, caplog):
    assert any(k.startswith("model.visual.") for k in load_file(str(saved / "single" / SINGLE)))
    with caplog.at_level(logging.WARNING, logger="glm53.checkpoint"):
        model = Glm53ForCausalLM.from_pretrained(saved / "single")
    assert any("vision-tower tensors (model.visual.*)" in r.getMessage() for r in caplog.records)
    assert not any("visual" in name for name, _ in model.named_parameters())


def test_mtp_layer_is_set_aside(ckpt):
    n = config().num_hidden_layers
    mtp = [f"{PREFIX}layers.{n}.eh_proj.weight", f"{PREFIX}layers.{n}.shared_head.norm.weight"]

    def add(t):
        t[mtp[0]] = torch.randn(32, 64)
        t[mtp[1]] = torch.ones(32)

    rewrite(ckpt, add)
    model = Glm53ForCausalLM.from_pretrained(ckpt)
    assert model.mtp_checkpoint_keys == sorted(mtp)


def test_tied_embeddings(saved):
    assert "lm_head.weight" not in load_file(str(saved / "tied" / SINGLE))
    model = Glm53ForCausalLM.from_pretrained(saved / "tied")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 320, (1, 6))
    with torch.no_grad():
        out = model(ids)
    torch.testing.assert_close(out.logits, out.last_hidden_state @ model.model.embed_tokens.weight.T)


def test_tied_checkpoint_with_a_stored_head_ignores_it(saved, tmp_path):
    path = shutil.copytree(saved / "tied", tmp_path / "tied")
    rewrite(path, lambda t: t.__setitem__("lm_head.weight", torch.zeros(320, 32)))
    model = Glm53ForCausalLM.from_pretrained(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.abs().sum() > 0


def test_dtype_keeps_fp32_parameters(saved):
    model = Glm53ForCausalLM.from_pretrained(saved / "single", dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for name in (
        "model.layers.0.self_attn.A_log",
        "model.layers.0.self_attn.dt_bias",
        "model.layers.0.self_attn.q_conv1d.weight",
        "model.layers.0.attn_hc.base",
        "model.layers.0.ffn_hc.scale",
    ):
        assert params[name].dtype == torch.float32, name
    assert dict(model.named_buffers())["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_dtype_defaults_to_the_stored_one(ckpt):
    official = json.loads((ckpt / "config.json").read_text())
    official["dtype"] = "bfloat16"
    (ckpt / "config.json").write_text(json.dumps(official))
    params = dict(Glm53ForCausalLM.from_pretrained(ckpt).named_parameters())
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert params["model.layers.2.self_attn.A_log"].dtype == torch.float32
    fp32 = dict(Glm53ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).named_parameters())
    assert fp32["model.embed_tokens.weight"].dtype == torch.float32


def test_nothing_is_unpickled(saved, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the loader must not unpickle anything")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    Glm53ForCausalLM.from_pretrained(saved / "sharded")


def test_pytorch_bin_only_is_not_read(saved, tmp_path):
    (tmp_path / "config.json").write_text((saved / "single" / "config.json").read_text())
    torch.save({"lm_head.weight": torch.zeros(320, 32)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors or model.safetensors.index.json in"):
        Glm53ForCausalLM.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------------- bad checkpoints
def test_no_checkpoint_files(saved, tmp_path):
    (tmp_path / "config.json").write_text((saved / "single" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors or model.safetensors.index.json in"):
        Glm53ForCausalLM.from_pretrained(tmp_path)


def test_no_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config.json at"):
        Glm53ForCausalLM.from_pretrained(tmp_path)


MISSING = {
    "norm": (
        f"{PREFIX}layers.2.post_attention_layernorm.weight",
        r"layers\.2\.post_attention_layernorm\.weight \(32,\)",
    ),
    "hc": (f"{PREFIX}layers.0.hc_ffn_base", r"layers\.0\.hc_ffn_base \(24,\)"),
    "kda-conv": (f"{PREFIX}layers.1.self_attn.k_conv1d.weight", r"layers\.1\.self_attn\.k_conv1d\.weight \(16, 1, 4\)"),
    "expert": (
        f"{PREFIX}layers.2.mlp.experts.5.up_proj.weight",
        r"layers\.2\.mlp\.experts\.5\.up_proj\.weight \(16, 32\)",
    ),
    "router-bias": (
        f"{PREFIX}layers.3.mlp.gate.e_score_correction_bias",
        r"layers\.3\.mlp\.gate\.e_score_correction_bias \(8,\)",
    ),
    "lm_head": ("lm_head.weight", r"lm_head\.weight \(320, 32\)"),
}


@pytest.mark.parametrize("key,message", MISSING.values(), ids=MISSING.keys())
def test_missing_key(ckpt, key, message):
    rewrite(ckpt, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=r"(?s)missing keys \(expected shape\):.*" + message):
        Glm53ForCausalLM.from_pretrained(ckpt)


UNEXPECTED = {
    "unknown-module": f"{PREFIX}layers.0.self_attn.rotary.weight",
    "extra-expert": f"{PREFIX}layers.1.mlp.experts.8.down_proj.weight",
    "no-prefix": "transformer.h.0.weight",
    "fp8-scale": f"{PREFIX}layers.0.self_attn.q_proj.weight_scale_inv",
}


@pytest.mark.parametrize("key", UNEXPECTED.values(), ids=UNEXPECTED.keys())
def test_unexpected_key(ckpt, key):
    shape = (32, 16) if "experts" in key else (2, 2)
    rewrite(ckpt, lambda t: t.__setitem__(key, torch.zeros(shape)))
    with pytest.raises(CheckpointError, match=r"(?s)unexpected keys:.*" + re.escape(key)):
        Glm53ForCausalLM.from_pretrained(ckpt)


MISSHAPED = {
    "linear": (f"{PREFIX}layers.0.self_attn.q_proj.weight", (16, 31), r"\(16, 31\), expected \(16, 32\)"),
    "expert": (f"{PREFIX}layers.1.mlp.experts.0.gate_proj.weight", (15, 32), r"\(15, 32\), expected \(16, 32\)"),
    "embedding": (f"{PREFIX}embed_tokens.weight", (321, 32), r"\(321, 32\), expected \(320, 32\)"),
}


@pytest.mark.parametrize("key,shape,message", MISSHAPED.values(), ids=MISSHAPED.keys())
def test_misshaped_key(ckpt, key, shape, message):
    rewrite(ckpt, lambda t: t.__setitem__(key, torch.zeros(shape)))
    with pytest.raises(CheckpointError, match=r"(?s)mis-shaped keys:.*" + re.escape(key) + ": " + message):
        Glm53ForCausalLM.from_pretrained(ckpt)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "key",
    [f"{PREFIX}layers.3.self_attn.indexer.wk.weight", f"{PREFIX}layers.2.mlp.experts.7.down_proj.weight"],
    ids=["indexer", "expert"],
)
def test_non_finite_tensor(ckpt, key, value):
    def poison(t):
        t[key] = t[key].clone()
        t[key].view(-1)[3] = value

    rewrite(ckpt, poison)
    with pytest.raises(CheckpointError, match=f"tensor '{re.escape(key)}' holds NaN or infinite values"):
        Glm53ForCausalLM.from_pretrained(ckpt)


def test_missing_shard_file(saved, tmp_path):
    path = shutil.copytree(saved / "sharded", tmp_path / "sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (path / victim).unlink()
    with pytest.raises(CheckpointError, match=rf"names shard files that do not exist: \['{victim}'\]"):
        Glm53ForCausalLM.from_pretrained(path)


def test_index_without_weight_map(saved, tmp_path):
    path = shutil.copytree(saved / "sharded", tmp_path / "sharded")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json has no 'weight_map'"):
        Glm53ForCausalLM.from_pretrained(path)


def test_config_mismatch_lists_every_problem(saved, tmp_path):
    """A checkpoint for a different config: one error naming missing, unexpected and mis-shaped keys together."""
    path = shutil.copytree(saved / "single", tmp_path / "ckpt")
    official = config(moe_intermediate_size=8, n_routed_experts=4).to_official_dict()
    (path / "config.json").write_text(json.dumps(official))
    with pytest.raises(CheckpointError) as info:
        Glm53ForCausalLM.from_pretrained(path)
    message = str(info.value)
    assert "unexpected keys:" in message and f"{PREFIX}layers.1.mlp.experts.7.up_proj.weight" in message
    assert "mis-shaped keys:" in message and "expected (8, 32)" in message
    assert "missing keys" not in message


def test_from_config_keeps_embeddings_tied():
    """Building on meta and materialising with to_empty must not untie lm_head from the embedding."""
    model = Glm53ForCausalLM.from_config(config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.abs().sum() > 0


def test_from_pretrained_returns_an_eval_mode_model(tmp_path):
    """As transformers' from_pretrained: a loaded model is in eval mode (no dropout, no expert loads counted for
    update_router_bias) until the caller says .train(); it used to come back in train mode."""
    from glm53 import Glm53Config, Glm53ForCausalLM

    Glm53ForCausalLM(Glm53Config.tiny()).save_pretrained(tmp_path / "ckpt")
    model = Glm53ForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert not model.training and not any(m.training for m in model.modules())
    assert model.train().training


# -------------------------------------------------------------------------------------------- key matching at its edges
P = "model.language_model."


@pytest.fixture(scope="module")
def saved_edges(tmp_path_factory):
    """A tiny checkpoint with one MTP layer (num_hidden_layers 4, so the MTP layer is stored as layers.4)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("load") / "ckpt_edges"
    model = Glm53ForCausalLM(Glm53Config.tiny(num_nextn_predict_layers=1))
    model.save_pretrained(path)
    return path, model


@pytest.fixture
def ckpt_edges(saved_edges, tmp_path):
    return shutil.copytree(saved_edges[0], tmp_path / "ckpt_edges")


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        Glm53ForCausalLM.from_pretrained(path)
    return str(info.value)


@pytest.mark.parametrize("part", ["gate", "up", "down"])
def test_last_expert_missing(ckpt_edges, part):
    last = Glm53Config.tiny().n_routed_experts - 1
    key = f"{P}layers.1.mlp.experts.{last}.{part}_proj.weight"
    rewrite(ckpt_edges, lambda t: t.pop(key))
    assert re.search(r"(?s)missing keys \(expected shape\):\n  " + re.escape(key), load_error(ckpt_edges))


@pytest.mark.parametrize("rest", ["eh_proj.weight", "mlp.experts.3.down_proj.weight", "self_attn.indexer.wk.weight"])
def test_partial_mtp_layer_is_missing_keys(ckpt_edges, rest):
    """Some MTP tensors present and one absent: an error naming it, not a half-initialised MTP module."""
    key = f"{P}layers.4.{rest}"
    rewrite(ckpt_edges, lambda t: t.pop(key))
    assert re.search(r"(?s)missing keys \(expected shape\):.*" + re.escape(key), load_error(ckpt_edges))


def test_mtp_tensors_load_where_they_belong(saved_edges):
    path, model = saved_edges
    loaded = Glm53ForCausalLM.from_pretrained(path)
    for name, tensor in model.mtp.state_dict().items():
        assert torch.equal(loaded.mtp.state_dict()[name], tensor), name
    assert loaded.mtp_checkpoint_keys == []


@pytest.mark.parametrize("kind", ["hc", "experts"])
def test_two_forms_of_one_tensor_are_refused(saved_edges, ckpt_edges, kind):
    """glm53's own name beside the official one (hc_attn_fn / attn_hc.fn; fused experts / per-expert keys)."""
    model = saved_edges[1]
    if kind == "hc":
        extra, tensor = f"{P}layers.0.attn_hc.fn", torch.zeros_like(model.model.layers[0].attn_hc.fn)
        named = r"layers\.0\.(attn_hc\.fn|hc_attn_fn)"
    else:
        extra = f"{P}layers.1.mlp.experts.down_proj"
        tensor = torch.zeros_like(model.model.layers[1].mlp.experts.down_proj)
        named = re.escape(extra)
    rewrite(ckpt_edges, lambda t: t.__setitem__(extra, tensor))
    assert re.search(r"(?s)unexpected keys:.*" + named, load_error(ckpt_edges))


def test_fused_experts_alone_load(saved_edges, ckpt_edges):
    """The fused form by itself is accepted (one source per tensor)."""
    fused = saved_edges[1].model.layers[1].mlp.experts.down_proj.detach()

    def fuse(t):
        for e in range(fused.shape[0]):
            t.pop(f"{P}layers.1.mlp.experts.{e}.down_proj.weight")
        t[f"{P}layers.1.mlp.experts.down_proj"] = fused.clone()

    rewrite(ckpt_edges, fuse)
    assert torch.equal(Glm53ForCausalLM.from_pretrained(ckpt_edges).model.layers[1].mlp.experts.down_proj, fused)


@pytest.mark.parametrize("level", ["outer", "text", "absent"])
def test_stored_dtype_is_read_at_either_level(ckpt_edges, level):
    """config.json's `dtype` at the outer or the text level; neither: fp32."""
    config = json.loads((ckpt_edges / "config.json").read_text())
    for d in (config, config["text_config"]):
        d.pop("dtype", None), d.pop("torch_dtype", None)
    if level != "absent":
        (config if level == "outer" else config["text_config"])["dtype"] = "float16"
    (ckpt_edges / "config.json").write_text(json.dumps(config))
    model = Glm53ForCausalLM.from_pretrained(ckpt_edges)
    assert model.model.embed_tokens.weight.dtype == (torch.float32 if level == "absent" else torch.float16)
    assert model.model.layers[0].self_attn.A_log.dtype == torch.float32


def test_expert_of_an_integer_dtype_is_refused(ckpt_edges):
    key = f"{P}layers.1.mlp.experts.2.up_proj.weight"
    rewrite(ckpt_edges, lambda t: t.__setitem__(key, (t[key] * 100).to(torch.int32)))
    message = load_error(ckpt_edges)
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
def test_stored_dtype_that_is_not_a_floating_dtype(ckpt_edges, stored):
    config = json.loads((ckpt_edges / "config.json").read_text())
    config["dtype"] = stored
    (ckpt_edges / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"config.json: dtype(={stored!r} is not a torch dtype| must be a floating)"):
        Glm53ForCausalLM.from_pretrained(ckpt_edges)


def test_mtp_copies_of_the_shared_embedding_and_head_are_set_aside(saved_edges, ckpt_edges):
    """Some releases store the embedding / head inside the MTP layer (DeepSeek-V3): glm53 shares the main
    model's, so those keys are set aside and listed, not loaded or refused."""
    copies = [f"{P}layers.4.embed_tokens.weight", f"{P}layers.4.shared_head.head.weight"]
    rewrite(ckpt_edges, lambda t: t.update({k: torch.zeros(320, 32) for k in copies}))
    model = Glm53ForCausalLM.from_pretrained(ckpt_edges)
    assert model.mtp_checkpoint_keys == sorted(copies)
    assert torch.equal(model.lm_head.weight, saved_edges[1].lm_head.weight)


@pytest.mark.parametrize("key", [f"{P}layers.0.hc_attn_fn", f"{P}layers.1.mlp.experts.3.up_proj.weight"])
def test_a_renamed_key_is_not_taken_for_the_original(ckpt_edges, key):
    """`<key>_old` (a stray backup name) is unexpected and `<key>` missing; it never fills the original's place."""
    rewrite(ckpt_edges, lambda t: t.__setitem__(key + "_old", t.pop(key)))
    message = load_error(ckpt_edges)
    assert re.search(r"(?s)missing keys \(expected shape\):.*" + re.escape(key) + " ", message)
    assert re.search(r"(?s)unexpected keys:.*" + re.escape(key + "_old"), message)
