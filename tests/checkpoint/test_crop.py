"""The crop tool: `python -m glm53.tools.crop SRC DST --num-layers N` on a synthesized sharded FP8 checkpoint.

The crop tool at its edges: DST may not contain SRC, quantization_config is read at the text level too, and a
scale without its weight is copied as stored (crop never drops a tensor it does not understand).
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

import glm53.checkpoint.crop as crop_mod
import glm53.checkpoint.shards as shards
from glm53 import Glm53ForCausalLM
from glm53.checkpoint import fp8
from glm53.checkpoint.crop import CropError, _human, crop, main, rewrite_config
from tests.helpers.checkpoints import BLOCK, TEXT, fp8_source, random_model, read_all, tiny_config

IDS = torch.randint(1, 320, (2, 13), generator=torch.Generator().manual_seed(11))
LAYER3_SHARD = "model-00004-of-00006.safetensors"  # the source groups one layer per shard; layer 3 is cropped


def _source_key(key: str, n: int = 3, total: int = 4) -> str:
    """Output key -> source key (the MTP layer moved from layers.{total} to layers.{n})."""
    prefix = f"{TEXT}layers.{n}."
    return f"{TEXT}layers.{total}." + key[len(prefix) :] if key.startswith(prefix) else key


def test_crop_fp8_to_three_layers(tmp_path, monkeypatch):
    from transformers import Glm5NextForConditionalGeneration

    src, _ = fp8_source()
    opened = []
    real_open = crop_mod.safe_open
    monkeypatch.setattr(crop_mod, "safe_open", lambda f, **kw: opened.append(os.path.basename(f)) or real_open(f, **kw))
    log = io.StringIO()
    dst = str(tmp_path / "crop3")
    plan = crop(src, dst, 3, max_shard_size="60KB", log=log)
    monkeypatch.undo()
    assert LAYER3_SHARD not in opened and len(set(opened)) == 5  # only the shards it needs
    assert "[1/5] model-00001-of-00006.safetensors" in log.getvalue() and "[5/5]" in log.getvalue()

    stored, out = read_all(src), read_all(dst)
    assert os.path.isfile(os.path.join(dst, "model.safetensors.index.json"))
    expected = {k for k in stored if not k.endswith("_scale_inv") and not k.startswith(f"{TEXT}layers.3.")}
    assert {_source_key(k) for k in out} == expected and len(out) == len(plan.entries)
    assert sum(k.startswith("model.visual.") for k in out) == 25 and f"{TEXT}layers.3.eh_proj.weight" in out
    n_fp8 = 0
    for key, tensor in out.items():
        source = stored[_source_key(key)]
        scale = stored.get(_source_key(key) + "_scale_inv")
        if scale is not None:
            n_fp8 += 1
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, fp8.dequantize_reference(source, scale, BLOCK).to(torch.bfloat16)), key
        else:
            assert tensor.dtype == source.dtype and torch.equal(tensor, source), key  # bit for bit
    assert n_fp8 == 12 + 35 + 32 + 36  # projections of layers 0 (KDA, dense), 1 (MLA+indexer, MoE), 2 (MLA), MTP

    ours = Glm53ForCausalLM.from_pretrained(dst, dtype=torch.float32)
    assert ours.mtp_checkpoint_keys == sorted(k for k in out if k.startswith(f"{TEXT}layers.3."))
    hf, info = Glm5NextForConditionalGeneration.from_pretrained(
        dst, dtype=torch.float32, output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]  # vision tower kept
    assert info["unexpected_keys"] and all(k.startswith(f"{TEXT}layers.3.") for k in info["unexpected_keys"])
    with torch.no_grad():
        a, b = ours(IDS).logits, hf.eval()(input_ids=IDS).logits
    assert a.std().item() > 0.1 and (a - b).abs().max().item() < 2e-5
    # Same weights as loading the FP8 source directly in bf16 (dequantise once, round once).
    direct = Glm53ForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict()
    cropped = Glm53ForCausalLM.from_pretrained(dst, dtype=torch.bfloat16).state_dict()
    for name, tensor in cropped.items():
        assert torch.equal(tensor, direct[name]), name


def test_dtype_option_chooses_the_dequantised_dtype(tmp_path):
    src, _ = fp8_source()
    args = ["--num-layers", "1", "--dtype", "float16", "--max-shard-size", "1MB"]
    assert main([src, str(tmp_path / "fp16"), *args]) == 0
    stored, out = read_all(src), read_all(tmp_path / "fp16")
    key = f"{TEXT}layers.0.self_attn.q_proj.weight"  # [16, 36]: the last column block is partial (4 of 8)
    assert out[key].dtype == torch.float16
    want = fp8.dequantize_reference(stored[key], stored[key + "_scale_inv"], BLOCK, torch.float16)
    assert torch.equal(out[key], want)
    assert out[f"{TEXT}layers.0.hc_attn_fn"].dtype == torch.float32  # no scale: as stored
    assert sorted(os.listdir(tmp_path / "fp16")) == ["config.json", "model.safetensors"]


def test_bf16_checkpoint_passes_through_bit_exact(tmp_path):
    model = random_model(tiny_config())
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    (tmp_path / "bf16" / "tokenizer.json").write_text('{"v": 1}')
    crop(tmp_path / "bf16", tmp_path / "two", 2, dtype=torch.float32, log=io.StringIO())
    stored, out = read_all(tmp_path / "bf16"), read_all(tmp_path / "two")
    assert sorted(os.listdir(tmp_path / "two")) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (tmp_path / "two" / "tokenizer.json").read_text() == '{"v": 1}'
    assert set(out) == {k for k in stored if not k.startswith((f"{TEXT}layers.2.", f"{TEXT}layers.3."))}
    for key, tensor in out.items():
        assert tensor.dtype == stored[key].dtype and torch.equal(tensor, stored[key]), key
    assert {t.dtype for t in out.values()} == {torch.bfloat16, torch.float32}


RELEASE_LIKE = {
    "architectures": ["Glm5NextForConditionalGeneration"],
    "model_type": "glm5_next",
    "dtype": "bfloat16",
    "tie_word_embeddings": False,
    "image_token_id": 151363,
    "vision_config": {"depth": 1, "hidden_size": 16},
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "text_config": {
        "model_type": "glm5_next_text",
        "vocab_size": 320,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 0,
        "v_head_dim": 8,
        "index_topk": 8,
        "index_head_dim": 8,
        "index_n_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 3,
        "num_nextn_predict_layers": 1,
        "rope_theta": 1e6,
        "pad_token_id": 0,
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 5,
        "indexer_types": ["full"] * 4 + ["shared"] + ["full"] * 3,
        "linear_attn_config": {
            "head_dim": 8,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3, 5, 6, 7],
            "full_attn_layers": [4, 8],
        },
    },
}


def test_rewrite_config_nested_field_by_field():
    for n, kda, full, dense in [(5, [1, 2, 3, 5], [4], 3), (2, [1, 2], [], 2)]:
        out = rewrite_config(RELEASE_LIKE, n)
        want = copy.deepcopy(RELEASE_LIKE)
        del want["quantization_config"]
        text = want["text_config"]
        text["num_hidden_layers"] = n
        text["mlp_layer_types"] = text["mlp_layer_types"][:n]
        text["indexer_types"] = text["indexer_types"][:n]
        text["first_k_dense_replace"] = dense
        text["linear_attn_config"].update(kda_layers=kda, full_attn_layers=full)
        assert out.keys() == want.keys() and out["text_config"].keys() == text.keys()
        for key in want:
            if key != "text_config":
                assert out[key] == want[key], key
        for key in text:
            assert out["text_config"][key] == text[key], key
    assert RELEASE_LIKE["text_config"]["num_hidden_layers"] == 8  # the input is not modified


def test_rewrite_config_flat():
    flat = {k: v for k, v in RELEASE_LIKE["text_config"].items() if k not in ("linear_attn_config", "indexer_types")}
    flat.update(
        num_hidden_layers=6,
        mlp_layer_types=["dense"] * 3 + ["sparse"] * 3,
        index_topk_pattern="FFFFFS",
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"],
        quantization_config={"weight_block_size": [4, 8]},
    )
    out = rewrite_config(flat, 4)
    assert out["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]  # legacy spelling kept
    assert out["index_topk_pattern"] == "FFFF" and out["mlp_layer_types"] == ["dense"] * 3 + ["sparse"]
    assert out["num_hidden_layers"] == 4 and out["first_k_dense_replace"] == 3 and "quantization_config" not in out
    assert {k: v for k, v in out.items() if k not in flat or flat[k] != v} == {
        "num_hidden_layers": 4,
        "layer_types": out["layer_types"],
        "index_topk_pattern": "FFFF",
        "mlp_layer_types": out["mlp_layer_types"],
    }
    assert rewrite_config(flat, 1)["first_k_dense_replace"] == 1


def test_dry_run_prints_plan_and_writes_nothing(tmp_path, capsys):
    src, _ = fp8_source()
    dst = tmp_path / "dry"
    assert main([src, str(dst), "--num-layers", "3", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert not dst.exists() and os.listdir(tmp_path) == []
    assert f"{TEXT}layers.4.eh_proj.weight -> {TEXT}layers.3.eh_proj.weight  [36, 72]  F8_E4M3 -> bfloat16" in printed
    assert "source shards read (5):" in printed and LAYER3_SHARD not in printed
    size = int(printed.split("output: ")[1].split(" tensors, ")[1].split(" bytes")[0])
    plan = crop(src, dst, 3, log=io.StringIO())
    assert size == plan.out_bytes == sum(t.nbytes for t in read_all(dst).values())


def test_errors(tmp_path, capsys):
    src, _ = fp8_source()
    for n in (0, 5):
        with pytest.raises(CropError, match=rf"between 1 and the source's num_hidden_layers \(4\), got {n}"):
            crop(src, tmp_path / "x", n)
    os.makedirs(tmp_path / "exists")
    with pytest.raises(CropError, match="already exists; pass --overwrite"):
        crop(src, tmp_path / "exists", 2)
    assert main([src, str(tmp_path / "new"), "--num-layers", "0"]) == 2
    assert "error: --num-layers must be between 1" in capsys.readouterr().err
    crop(src, tmp_path / "exists", 1, overwrite=True, log=io.StringIO())
    assert json.load(open(tmp_path / "exists" / "config.json"))["text_config"]["num_hidden_layers"] == 1

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    os.remove(broken / "model-00002-of-00006.safetensors")
    with pytest.raises(CropError, match=r"shard files that do not exist: \['model-00002-of-00006.safetensors'\]"):
        crop(broken, tmp_path / "y", 2)

    no_indexer, _ = fp8_source(mtp_indexer=False)  # the MTP layer reuses layer 1's top-k
    with pytest.raises(CropError, match=r"MTP layer \(layers\.4\) has a shared indexer.*layer 1.*--num-layers 1"):
        crop(no_indexer, tmp_path / "z", 1)
    crop(no_indexer, tmp_path / "z", 2, log=io.StringIO())  # keeps layer 1: fine

    with pytest.raises(CropError, match="must not be SRC"):
        crop(src, src, 2, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["broken", "exists", "z"]


def _move_scale(src, dst, key, scale):
    """Copy of SRC whose index points `key`'s scale at a separate shard holding `scale` (None: no scale)."""
    shutil.copytree(src, dst)
    index = json.load(open(dst / "model.safetensors.index.json"))
    del index["weight_map"][key + "_scale_inv"]
    if scale is not None:
        save_file({key + "_scale_inv": scale}, dst / "scales.safetensors")
        index["weight_map"][key + "_scale_inv"] = "scales.safetensors"
    json.dump(index, open(dst / "model.safetensors.index.json", "w"))


def test_missing_or_misshaped_scale_raises_naming_the_key(tmp_path):
    src, _ = fp8_source()
    key = f"{TEXT}layers.0.self_attn.q_proj.weight"
    _move_scale(src, tmp_path / "noscale", key, None)
    with pytest.raises(CropError, match=rf"FP8 tensor '{key}' has no '{key}_scale_inv'"):
        crop(tmp_path / "noscale", tmp_path / "out", 2)
    _move_scale(src, tmp_path / "badscale", key, torch.ones(4, 4))
    with pytest.raises(CropError, match=rf"'{key}_scale_inv' has shape \(4, 4\), expected \(4, 5\)"):
        crop(tmp_path / "badscale", tmp_path / "out", 2)
    # A scale stored in a shard of its own is found, and that shard is listed as read.
    scale = read_all(src)[key + "_scale_inv"]
    _move_scale(src, tmp_path / "apart", key, scale)
    plan = crop(tmp_path / "apart", tmp_path / "out", 1, log=io.StringIO())
    assert [os.path.basename(f) for f in plan.shards] == [
        "model-00001-of-00006.safetensors",
        "scales.safetensors",
        "model-00005-of-00006.safetensors",
        "model-00006-of-00006.safetensors",
    ]  # layer 0, its moved scale, the MTP layer, the rest
    want = fp8.dequantize_reference(read_all(src)[key], scale, BLOCK, torch.bfloat16)
    assert torch.equal(read_all(tmp_path / "out")[key], want)
    assert sorted(os.listdir(tmp_path)) == ["apart", "badscale", "noscale", "out"]


def test_interrupted_crop_leaves_no_dst(tmp_path, monkeypatch):
    src, _ = fp8_source()
    real_add, calls = shards.ShardedWriter.add, []

    def failing_add(self, key, tensor):
        calls.append(key)
        if len(calls) == 40:
            raise KeyboardInterrupt
        real_add(self, key, tensor)

    monkeypatch.setattr(shards.ShardedWriter, "add", failing_add)
    with pytest.raises(KeyboardInterrupt):
        crop(src, tmp_path / "out", 3, max_shard_size="20KB", log=io.StringIO())
    assert os.listdir(tmp_path) == [] and len(calls) == 40


def test_an_unwritable_destination_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """The OS refusing the write (permissions, a read-only or full file system) is reported in one line naming
    DST and the reason, exit 1, and leaves nothing behind (it was a PermissionError traceback)."""
    import glm53.checkpoint.atomic as atomic

    src, _ = fp8_source()

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(atomic.os, "mkdir", refuse)
    dst = tmp_path / "out"
    assert main([src, str(dst), "--num-layers", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {dst}: Permission denied") and "Traceback" not in err
    assert err.count("\n") == 1 and sorted(os.listdir(tmp_path)) == []


# ---------------------------------------------------------------------------------------------------- crop at its edges
def test_dst_containing_src_is_refused(tmp_path):
    src = shutil.copytree(fp8_source()[0], tmp_path / "inner" / "src")
    with pytest.raises(CropError, match=r"must not be SRC or lie inside it \(or contain it\)"):
        crop(src, tmp_path / "inner", 1, overwrite=True)
    assert sorted(os.listdir(tmp_path / "inner")) == ["src"] and sorted(os.listdir(src)) == sorted(
        os.listdir(fp8_source()[0])
    )


def test_text_level_quantization_config_gives_the_block_size(tmp_path):
    src = shutil.copytree(fp8_source()[0], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["quantization_config"] = config.pop("quantization_config")
    (src / "config.json").write_text(json.dumps(config))
    crop(src, tmp_path / "out", 1, dtype=torch.float32, log=io.StringIO())
    key, stored = f"{TEXT}layers.0.self_attn.q_proj.weight", read_all(src)
    want = fp8.dequantize_reference(stored[key], stored[key + "_scale_inv"], BLOCK)
    assert torch.equal(read_all(tmp_path / "out")[key], want)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]


def test_a_scale_without_its_weight_is_copied_as_stored(tmp_path):
    src = shutil.copytree(fp8_source()[0], tmp_path / "src")
    orphan = f"{TEXT}extra_proj.weight_scale_inv"  # no extra_proj.weight anywhere
    save_file({orphan: torch.tensor([[2.5]])}, src / "extra.safetensors")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][orphan] = "extra.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    crop(src, tmp_path / "out", 1, log=io.StringIO())
    assert torch.equal(read_all(tmp_path / "out")[orphan], torch.tensor([[2.5]]))


def test_dry_run_into_an_existing_dst_prints_and_touches_nothing(tmp_path, capsys):
    dst = tmp_path / "exists"
    dst.mkdir()
    (dst / "mine.txt").write_text("kept")
    plan = crop(fp8_source()[0], dst, 1, dry_run=True)
    assert f"output: {len(plan.entries)} tensors" in capsys.readouterr().out
    assert os.listdir(dst) == ["mine.txt"] and sorted(os.listdir(tmp_path)) == ["exists"]


def test_keeping_every_layer_dequantises_the_whole_checkpoint(tmp_path):
    src = fp8_source()[0]
    crop(src, tmp_path / "all", 4, log=io.StringIO())  # num_layers == the source's: allowed
    stored, out = read_all(src), read_all(tmp_path / "all")
    assert set(out) == {k for k in stored if not k.endswith(fp8.SCALE_SUFFIX)}
    assert {t.dtype for k, t in out.items() if stored[k].dtype == fp8.FP8_DTYPE} == {torch.bfloat16}


@pytest.mark.parametrize(
    "nbytes,shown",
    [(999, "999 B"), (1000, "1.0 KB"), (1023, "1.0 KB"), (1_500_000, "1.5 MB"), (2 * 10**15, "2000.0 TB")],
)
def test_progress_sizes_use_decimal_units(nbytes, shown):
    assert _human(nbytes) == shown


def test_a_scale_beside_a_weight_that_is_not_fp8_is_refused(tmp_path):
    # the loader refuses such a checkpoint (an unexpected key): crop must not drop the scale and hide it
    src = shutil.copytree(fp8_source()[0], tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight = next(k for k in index["weight_map"] if k.endswith("input_layernorm.weight"))
    save_file({weight + "_scale_inv": torch.tensor([[2.5]])}, src / "extra.safetensors")
    index["weight_map"][weight + "_scale_inv"] = "extra.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CropError, match=rf"{weight}_scale_inv is the block scale of {weight}, which is .*, not FP8"):
        crop(src, tmp_path / "out", 1, log=io.StringIO())
    assert not (tmp_path / "out").exists()


def test_a_source_that_is_a_file_is_named_as_such(tmp_path):
    (tmp_path / "file").write_text("not a checkpoint")
    with pytest.raises(CropError, match="source checkpoint directory .*file is not a directory"):
        crop(tmp_path / "file", tmp_path / "out", 1)
    with pytest.raises(CropError, match="source checkpoint directory .*missing does not exist"):
        crop(tmp_path / "missing", tmp_path / "out", 1)
