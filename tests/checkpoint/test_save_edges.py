"""save_checkpoint and ShardedWriter at their edges: what config.json records, which tensors are written (no tied
head), the non-finite check's reach, shard packing at the exact limit, shard names and the index, size strings."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import shards
from glm53.errors import CheckpointError
from tests.helpers.checkpoints import read_all


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
