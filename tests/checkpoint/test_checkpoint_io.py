"""save_pretrained in the official layout, round trips through transformers, in-memory conversion, atomic writes.

save_checkpoint and ShardedWriter at their edges: what config.json records, which tensors are written (no tied
head), the non-finite check's reach, shard packing at the exact limit, shard names and the index, size strings.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

import glm53.checkpoint.shards as shards
from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import to_transformers_state_dict
from glm53.errors import CheckpointError
from glm53.precision import keeps_fp32
from tests.helpers.checkpoints import TEXT, random_model, read_all, tiny_config
from tests.helpers.oracle import hf_model

IDS = torch.randint(1, 320, (2, 13), generator=torch.Generator().manual_seed(7))  # T > index_topk: sparse


def _state(model):
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same_logits(a, b):
    assert a.std().item() > 0.1  # non-trivial logits
    assert (a - b).abs().max().item() < 2e-5


def test_round_trip_glm53_transformers_glm53(tmp_path):
    from transformers import Glm5NextForConditionalGeneration

    model = random_model(tiny_config())
    path = model.save_pretrained(tmp_path / "glm53", max_shard_size="40KB")
    files = sorted(os.listdir(path))
    assert "model.safetensors.index.json" in files and files[1] == "model-00001-of-00014.safetensors"
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "glm5_next" and config["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert config["text_config"]["num_hidden_layers"] == 4 and config["text_config"]["hidden_size"] == 36
    # a text-only model declares no tower (issue 28: no phantom vision_config whose weights it dropped)
    assert "vision_config" not in config and "image_token_id" not in config
    keys = set(read_all(path))
    assert f"{TEXT}layers.1.mlp.experts.7.up_proj.weight" in keys
    assert f"{TEXT}layers.0.self_attn.k_conv1d.weight" in keys
    assert f"{TEXT}layers.2.hc_ffn_scale" in keys and not any("gate_up_proj" in k or "attn_hc" in k for k in keys)

    hf, info = Glm5NextForConditionalGeneration.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager"
    )
    # transformers' Glm5NextModel always builds a (default) tower: its keys are the only missing ones
    assert info["missing_keys"] and all(k.startswith("model.visual.") for k in info["missing_keys"])
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        _assert_same_logits(model(IDS).logits, hf.eval()(input_ids=IDS).logits)

    hf.save_pretrained(tmp_path / "hf")
    assert {k for k in read_all(tmp_path / "hf") if not k.startswith("model.visual.")} == keys  # same layout
    back = Glm53ForCausalLM.from_pretrained(tmp_path / "hf")
    original, loaded = _state(model), _state(back)
    assert original.keys() == loaded.keys()
    for k in original:
        assert loaded[k].dtype == original[k].dtype and torch.equal(loaded[k], original[k]), k


def test_transformers_state_dict_both_ways():
    hf = hf_model(tiny_config(), seed=5)
    model = Glm53ForCausalLM.from_transformers(hf)
    with torch.no_grad():
        _assert_same_logits(model(IDS).logits, hf(input_ids=IDS).logits)
    converted = to_transformers_state_dict(model)
    hf_text = {k: v for k, v in hf.state_dict().items() if not k.startswith("model.visual.")}
    assert converted.keys() == hf_text.keys()
    for k in hf_text:
        assert torch.equal(converted[k], hf_text[k]), k
    conv = converted[f"{TEXT}layers.0.self_attn.conv1d.weight"]
    assert conv.shape == (48, 1, 4) and torch.equal(conv[16:32], model.model.layers[0].self_attn.k_conv1d.weight)
    result = hf.load_state_dict(converted, strict=False)
    assert not result.unexpected_keys and all(k.startswith("model.visual.") for k in result.missing_keys)


def test_save_bf16_keeps_transformers_fp32_tensors(tmp_path):
    model = random_model(tiny_config())
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    stored = read_all(tmp_path / "bf16")
    fp32 = {k for k, v in stored.items() if v.dtype == torch.float32}
    assert {k for k, v in stored.items() if v.dtype not in (torch.float32, torch.bfloat16)} == set()
    # 2 KDA layers: 3 convs, dt_bias, A_log; 3 routers: bias and weight; 4 blocks x 2 mHC sites: fn, base, scale
    assert len(fp32) == 2 * (3 + 2) + 3 * 2 + 4 * 2 * 3
    assert all(
        k.endswith(
            (
                "conv1d.weight",
                "dt_bias",
                "A_log",
                "e_score_correction_bias",
                "_base",
                "_scale",
                "_fn",
                "mlp.gate.weight",
            )
        )
        for k in fp32
    )
    assert stored[f"{TEXT}layers.0.hc_attn_fn"].dtype == torch.float32  # glm53 reads it in fp32 (precision.py)
    assert stored[f"{TEXT}layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    back = Glm53ForCausalLM.from_pretrained(tmp_path / "bf16")  # dtype from config.json
    for name, tensor in _state(model).items():
        want = tensor if keeps_fp32(name) else tensor.to(torch.bfloat16)
        assert torch.equal(_state(back)[name], want), name


def test_single_file_under_shard_size_and_index_sizes(tmp_path):
    model = random_model(tiny_config())
    model.save_pretrained(tmp_path / "one")
    assert sorted(os.listdir(tmp_path / "one")) == ["config.json", "model.safetensors"]
    model.save_pretrained(tmp_path / "many", max_shard_size=30_000)
    with open(tmp_path / "many" / "model.safetensors.index.json") as f:
        index = json.load(f)
    stored = read_all(tmp_path / "many")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    totals = []
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(tmp_path / "many" / name, "pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= 30_000 or len(sizes) == 1  # a tensor over the limit gets a shard of its own
        totals.append(sum(sizes))
    assert len(totals) == 18 and all(a + b > 30_000 for a, b in zip(totals, totals[1:]))  # greedy packing
    assert shards.parse_size("5GB") == 5 * 10**9 and shards.parse_size("2MiB") == 2 * 2**20
    with pytest.raises(ValueError, match="max_shard_size"):
        shards.parse_size("lots")


def test_interrupted_write_leaves_no_target(tmp_path, monkeypatch):
    model = random_model(tiny_config())
    calls = {"n": 0}
    real_add = shards.ShardedWriter.add

    def failing_add(self, key, tensor):
        calls["n"] += 1
        if calls["n"] == 60:
            raise OSError(28, "No space left on device")
        real_add(self, key, tensor)

    monkeypatch.setattr(shards.ShardedWriter, "add", failing_add)
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    assert os.listdir(tmp_path) == []  # neither the target nor the temporary directory
    monkeypatch.undo()

    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(FileExistsError, match="overwrite"):
        model.save_pretrained(tmp_path / "ckpt")
    other = random_model(tiny_config(), seed=9)
    calls["n"] = 0
    monkeypatch.setattr(shards.ShardedWriter, "add", failing_add)
    with pytest.raises(OSError):
        other.save_pretrained(tmp_path / "ckpt", overwrite=True)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt"]  # the old checkpoint, untouched
    assert torch.equal(Glm53ForCausalLM.from_pretrained(tmp_path / "ckpt").lm_head.weight, model.lm_head.weight)
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    other.save_pretrained(tmp_path / "ckpt", overwrite=True, max_shard_size="20KB")
    assert torch.equal(Glm53ForCausalLM.from_pretrained(tmp_path / "ckpt").lm_head.weight, other.lm_head.weight)
    assert os.listdir(tmp_path) == ["ckpt"]
    names = os.listdir(tmp_path / "ckpt")
    assert "tokenizer.json" in names and "model.safetensors" not in names  # side files kept, old weights gone


def test_mtp_module_is_written_under_layer_n(tmp_path):
    """model.mtp goes to layers.{N}.* in the official names and loads back bit-exact."""
    model = random_model(tiny_config(num_nextn_predict_layers=1))
    model.save_pretrained(tmp_path / "mtp")
    stored = read_all(tmp_path / "mtp")
    layer = model.mtp.layers[0]
    assert torch.equal(stored[f"{TEXT}layers.4.eh_proj.weight"], layer.eh_proj.weight.detach())
    assert torch.equal(stored[f"{TEXT}layers.4.shared_head.norm.weight"], layer.shared_head.norm.weight.detach())
    assert torch.equal(
        stored[f"{TEXT}layers.4.mlp.experts.1.up_proj.weight"], layer.mlp.experts.gate_up_proj.detach()[1, 16:]
    )
    assert not any(".mtp." in k or k.startswith("mtp.") or "hc_" in k and "layers.4." in k for k in stored)
    back = Glm53ForCausalLM.from_pretrained(tmp_path / "mtp")
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------- save_checkpoint and ShardedWriter at their edges
def tiny_model(**overrides) -> Glm53ForCausalLM:
    torch.manual_seed(0)
    return Glm53ForCausalLM(Glm53Config.tiny(**overrides))


def test_tied_head_is_not_stored(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in read_all(tmp_path / "tied")
    back = Glm53ForCausalLM.from_pretrained(tmp_path / "tied")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert torch.equal(back.lm_head.weight, model.model.embed_tokens.weight)


def test_config_records_the_saved_dtype_and_drops_quantization(tmp_path):
    """Weights are written dequantised in `dtype` (a name works): config.json says so at both levels, with no
    quantization_config and no stale torch_dtype left at either."""
    official = Glm53Config.tiny().to_official_dict()
    for level in (official, official["text_config"]):
        level["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [4, 8]}
        level["torch_dtype"] = "float32"
    model = Glm53ForCausalLM(Glm53Config.from_dict(official))
    model.save_pretrained(tmp_path / "ckpt", dtype="float16")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    for level in (config, config["text_config"]):
        assert level["dtype"] == "float16"
        assert "quantization_config" not in level and "torch_dtype" not in level
    stored = read_all(tmp_path / "ckpt")
    assert stored["model.language_model.embed_tokens.weight"].dtype == torch.float16
    model.save_pretrained(tmp_path / "kept")  # dtype None: each tensor's own, fp32 here
    assert json.loads((tmp_path / "kept" / "config.json").read_text())["text_config"]["dtype"] == "float32"


def test_non_finite_check_names_mtp_tensors_and_counts_the_rest(tmp_path):
    model = tiny_model(num_nextn_predict_layers=1)
    with torch.no_grad():
        model.mtp.layers[0].eh_proj.weight[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match=r"NaN or inf in \['model\.layers\.4\.eh_proj\.weight'\]"):
        model.save_pretrained(tmp_path / "a")
    with torch.no_grad():
        for layer in model.model.layers:
            for p in layer.parameters():
                p.view(-1)[0] = float("nan")
    with pytest.raises(CheckpointError) as info:
        model.save_pretrained(tmp_path / "a")
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    assert len(bad) > 10 and f"'... ({len(bad)} in all)'" in str(info.value)
    assert not os.path.lexists(tmp_path / "a")


def shard_sizes(directory) -> dict[str, list[str]]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                out[name] = list(f.keys())
                assert f.metadata()["format"] == "pt"
    return out


def test_writer_packs_to_the_exact_limit_and_names_shards_from_one(tmp_path):
    """Three 40-byte tensors under a 80-byte limit: two fill the first shard exactly, the third gets the second."""
    writer = shards.ShardedWriter(str(tmp_path), max_shard_size=80)
    for key in ("a", "b", "c"):
        writer.add(key, torch.zeros(10))  # 40 bytes
    weight_map = writer.finish()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert weight_map == {"a": first, "b": first, "c": second}
    assert shard_sizes(tmp_path) == {first: ["a", "b"], second: ["c"]}
    index = json.loads((tmp_path / shards.INDEX_FILE).read_text())
    assert index == {"metadata": {"total_size": 120}, "weight_map": weight_map}
    with pytest.raises(ValueError, match=r"tensor 'a' written twice"):
        writer.add("a", torch.zeros(1))


def test_empty_writer_still_writes_one_file(tmp_path):
    assert shards.ShardedWriter(str(tmp_path)).finish() == {}
    assert sorted(os.listdir(tmp_path)) == [shards.SINGLE_FILE]


@pytest.mark.parametrize(
    "size,expected", [("1KB", 1000), ("1.5kb", 1500), ("3 KiB", 3072), ("7", 7), (12, 12), ("2gb", 2 * 10**9)]
)
def test_parse_size(size, expected):
    assert shards.parse_size(size) == expected


@pytest.mark.parametrize("size", [0, "0", "0.4B", -5, True, "5XB", "3KI", "2IB", "lots", "1e3"], ids=repr)
def test_parse_size_refuses(size):
    with pytest.raises(ValueError, match=r"max_shard_size must be"):
        shards.parse_size(size)


def test_checkpoint_owns_only_its_own_names():
    """Overwriting replaces these; anything else in the directory (a user's adapter or export) is kept."""
    own = ["config.json", "model.safetensors", "model.safetensors.index.json", "model-00002-of-00017.safetensors"]
    kept = [
        "adapter_model.safetensors",
        "model-final.safetensors",
        "model-1-of-2.safetensors",
        "tokenizer.json",
        "model.safetensors.bak",
        "generation_config.json",
    ]
    assert [shards.checkpoint_owns(n) for n in own + kept] == [True] * len(own) + [False] * len(kept)
