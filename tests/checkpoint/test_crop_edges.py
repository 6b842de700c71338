"""The crop tool at its edges: DST may not contain SRC, quantization_config is read at the text level too, and a
scale without its weight is copied as stored (crop never drops a tensor it does not understand)."""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from glm53.checkpoint import fp8
from glm53.checkpoint.crop import CropError, _human, crop
from tests.helpers.checkpoints import BLOCK, TEXT, fp8_source, read_all


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
