"""Vision-language checkpoints both ways: `model.visual.*` under the official names (save_pretrained,
from_pretrained, glm53.parallel.load_pretrained / export_pretrained, FP8 pairs, crop), transformers loading a glm53
save with no missing or unexpected keys and equal logits, bf16 loads, config round trips, text-only saves."""

from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch

from glm53 import Glm53ForCausalLM, Glm53ForConditionalGeneration
from glm53.checkpoint import fp8
from glm53.checkpoint.crop import crop
from glm53.errors import CheckpointError
from glm53.parallel import load_pretrained
from glm53.parallel.export import export_pretrained
from glm53.vision import Glm53VisionConfig, vision_parts
from tests.helpers.checkpoints import read_all, write_checkpoint
from tests.helpers.vision import TOWER, hf_vl_model, text_config, vl_batch

LOGITS_REL = 1e-4  # as tests/vision/test_vl_model.py (the same computation, read back bit for bit)
ROWS = [[1, 2, ("image", 4, 6), 3, 4], [5, ("video", 2, 2, 4), 6, 8]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    hf = hf_vl_model(text_config(index_topk=64), seed=5)
    path = tmp_path_factory.mktemp("hf-vl")
    hf.save_pretrained(path)
    return hf, str(path)


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def assert_close(got, ref, mask):
    valid = mask.bool()
    assert (got - ref)[valid].abs().max() <= LOGITS_REL * ref[valid].abs().max()


def test_transformers_save_loads_with_equal_logits(hf_dir, caplog):
    hf, path = hf_dir
    with caplog.at_level(logging.WARNING, logger="glm53"):
        ours = Glm53ForConditionalGeneration.from_pretrained(path).eval()
    assert not [r for r in caplog.records if "vision" in r.getMessage()]
    batch = vl_batch(ROWS)
    assert_close(logits(ours, batch), logits(hf, batch), batch["attention_mask"])
    vision, _ = vision_parts(ours.config)
    assert vision == Glm53VisionConfig.from_dict(json.load(open(os.path.join(path, "config.json")))["vision_config"])


def test_glm53_save_loads_in_transformers_with_no_missing_keys(hf_dir, tmp_path):
    from transformers import Glm5NextForConditionalGeneration

    hf, path = hf_dir
    ours = Glm53ForConditionalGeneration.from_pretrained(path).eval()
    out = ours.save_pretrained(tmp_path / "ours")
    stored = read_all(out)
    assert sorted(k for k in stored if k.startswith("model.visual.")) == sorted(
        k for k in hf.state_dict() if k.startswith("model.visual.")
    )
    back, info = Glm5NextForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    for c in (back.config, back.config.text_config, back.config.vision_config):
        c._attn_implementation = "eager"
    batch = vl_batch(ROWS)
    assert_close(logits(back.eval(), batch), logits(ours, batch), batch["attention_mask"])
    saved = json.load(open(os.path.join(out, "config.json")))
    assert Glm53VisionConfig.from_dict(saved["vision_config"]) == vision_parts(ours.config)[0]
    assert saved["image_token_id"] == 300 and saved["video_end_token_id"] == 305


def test_bf16_load_keeps_the_rope_exact(hf_dir):
    """A bf16 load rounds each tower weight once (nothing else: no buffer to round) and the bf16 tower stays
    within bf16 rounding of the fp32 tower holding the same bf16 weights. (Whole-model bf16 logits are bounded in
    tests/model/test_bf16_model.py with discrete routing taken out of play.)"""
    _, path = hf_dir
    ours = Glm53ForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert list(ours.visual.buffers()) == []
    stored = read_all(path)
    for name, p in ours.visual.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, stored["model.visual." + name].to(torch.bfloat16)), name
    same_weights = copy.deepcopy(ours.visual).float()
    batch = vl_batch(ROWS)
    with torch.no_grad():
        got = ours.visual(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
        ref = same_weights(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    assert got.dtype == torch.bfloat16
    # ~10 bf16-rounded stages (2^-9 relative each) between the pixels and the merger's output
    assert (got.float() - ref).abs().max() <= 10 * 2**-8 * ref.abs().max()


def test_text_model_loads_a_vl_checkpoint_as_text_only_and_saves_text_only(hf_dir, tmp_path, caplog):
    hf, path = hf_dir
    with caplog.at_level(logging.WARNING, logger="glm53"):
        text = Glm53ForCausalLM.from_pretrained(path)
    said = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(said) == 1 and "loading its text model only" in said[0] and "39 vision-tower tensors" in said[0]
    out = text.save_pretrained(tmp_path / "text")
    saved = json.load(open(os.path.join(out, "config.json")))
    assert "vision_config" not in saved and "image_token_id" not in saved
    assert not [k for k in read_all(out) if k.startswith("model.visual.")]
    with pytest.raises(Exception, match="config has no vision_config"):
        Glm53ForConditionalGeneration.from_pretrained(out)


def test_missing_tower_tensor_is_named(hf_dir, tmp_path):
    _, path = hf_dir
    state = read_all(path)
    state.pop("model.visual.blocks.1.attn.q_norm.weight")
    write_checkpoint(str(tmp_path), state, json.load(open(os.path.join(path, "config.json"))), sharded=False)
    with pytest.raises(CheckpointError, match=r"model\.visual\.blocks\.1\.attn\.q_norm\.weight \(8,\)"):
        Glm53ForConditionalGeneration.from_pretrained(tmp_path)


def test_fp8_tower_weights_load_through_the_scale_rule(hf_dir, tmp_path):
    hf, path = hf_dir
    state = read_all(path)
    config = json.load(open(os.path.join(path, "config.json")))
    block = (4, 8)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    key = "model.visual.blocks.0.attn.qkv.weight"
    state[key], state[key + fp8.SCALE_SUFFIX] = fp8.quantize(state[key], block)
    write_checkpoint(str(tmp_path), state, config)
    ours = Glm53ForConditionalGeneration.from_pretrained(tmp_path)
    want = fp8.dequantize(state[key], state[key + fp8.SCALE_SUFFIX], block)
    assert torch.equal(ours.visual.blocks[0].attn.qkv.weight, want.float())
    assert not torch.equal(want.float(), hf.state_dict()[key])  # the quantisation did change it


def test_parallel_load_and_export_on_one_process(hf_dir, tmp_path):
    _, path = hf_dir
    ref = Glm53ForConditionalGeneration.from_pretrained(path)
    with torch.device("meta"):
        meta = Glm53ForConditionalGeneration(ref.config)
    load_pretrained(meta, path)
    for (n, a), (_, b) in zip(ref.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), n
    out = export_pretrained(meta, tmp_path / "export")
    assert read_all(out).keys() == read_all(ref.save_pretrained(tmp_path / "save")).keys()
    assert all(torch.equal(read_all(out)[k], v) for k, v in read_all(path).items() if k.startswith("model.visual."))


def test_crop_keeps_the_tower(hf_dir, tmp_path):
    _, path = hf_dir
    crop(path, tmp_path / "crop", 2, dtype=torch.float32)
    cropped = Glm53ForConditionalGeneration.from_pretrained(tmp_path / "crop")
    source = read_all(path)
    assert cropped.config.num_hidden_layers == 2
    for name, p in cropped.visual.named_parameters():
        assert torch.equal(p, source["model.visual." + name]), name
    assert vision_parts(cropped.config)[0] == Glm53VisionConfig.from_dict(TOWER)
