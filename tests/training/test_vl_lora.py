"""`glm53 train --init VL_DIR --data vl.jsonl --media-root DIR --lora-rank R [--base-dtype] [--export-merged]`
(one process): LoRA on Glm53ForConditionalGeneration through glm53.peft (adapters on the default targets, the
projector among them; the tower and the rest of the base frozen), the adapter saved in peft's format and resumed
exactly, and the merged export a VL checkpoint transformers' Glm5NextForConditionalGeneration loads with glm53's
logits."""

from __future__ import annotations

import argparse
import copy
import re

import pytest
import torch
from safetensors.torch import load_file

from glm53.__main__ import main
from glm53.peft import load_lora, merge_lora
from glm53.peft.files import WEIGHTS_FILE
from glm53.training.vl_finetune import VLFileData, check_args
from glm53.vision.model import Glm53ForConditionalGeneration
from tests.helpers.vl_data import tiny_vl_model, vl_corpus, vl_tokenizer, write_jsonl

# fp32 on both sides, the same bf16-valued weights: reduction order only (eps 2^-23 x widths <= 64 x ~10 stages),
# as tests/vision/test_vl_checkpoint.py's 1e-4.
LOGITS_REL = 1e-4


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllora")
    tok = vl_tokenizer()
    ckpt = str(tmp / "base")
    # index_topk 128 > --seq-len: the dense regime. In the sparse one this model's 4 indexer heads leave ReLU scores
    # tied at exactly 0, which transformers' torch.topk and glm53's tie rule break differently
    # (tests/vision/test_vl_model.py); the export's check is about the weights, not the indexer's choice.
    tiny_vl_model(tok, seed=3, index_topk=128).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    data = write_jsonl(str(tmp / "vl.jsonl"), vl_corpus(str(tmp / "media"), n=6))
    return tmp, ckpt, data, str(tmp / "media")


def _run(prepared, *extra, init=True):
    _, ckpt, data, root = prepared
    start = ["--init", ckpt] if init else []
    return [
        "train",
        *start,
        "--data",
        data,
        "--media-root",
        root,
        "--seq-len",
        "96",
        "--batch-size",
        "2",
        "--lr",
        "1e-2",
        "--log-every",
        "1",
        "--lora-rank",
        "4",
        *extra,
    ]


def _losses(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step +\d+  loss ([0-9.]+)", text, flags=re.M)]


def _batch(prepared, model) -> dict:
    """The first packed training batch (images in it), as the model's forward keywords without labels."""
    _, ckpt, data, root = prepared
    args = argparse.Namespace(
        data=data,
        media_root=root,
        batch_size=2,
        grad_accum=1,
        seq_len=96,
        seed=0,
        strict=False,
        image_min_tokens=1,
        image_max_tokens=16384,
        video_max_tokens=16384,
    )
    b = VLFileData(args, ckpt, model, 1, 0).next_step()[0]
    out = dict(input_ids=b.input_ids, attention_mask=b.attention_mask, **b.vision_inputs())
    assert "pixel_values" in out
    return out


def test_vl_lora_run_resume_and_merged_export(prepared, capsys):
    tmp, ckpt, _, _ = prepared
    merged_dir = tmp / "merged"
    run = _run(prepared, "--steps", "4", "--save", str(tmp / "a"), "--save-every", "2")
    assert main([*run, "--export-merged", str(merged_dir)]) == 0
    text = capsys.readouterr().out
    losses = _losses(text)
    assert len(losses) == 4 and all(v == v and v < 100 for v in losses), text
    assert losses[-1] < losses[0], losses
    assert re.search(r"^step +1 .* \d+ image tokens$", text, flags=re.M)

    # the adapter: the default targets over the VL model, the projector's linears (the merger; downsample is a
    # Conv2d, which glm53's LoRA does not adapt) among them, nothing in the tower
    adapter = load_file(tmp / "a" / WEIGHTS_FILE)
    assert {k.split(".visual.merger.")[1].split(".")[0] for k in adapter if ".visual.merger." in k} == {
        "proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert not any(re.search(r"\.visual\.(blocks|patch_embed|post_layernorm|downsample)\.", k) for k in adapter)
    assert any(".language_model.layers." in k for k in adapter)
    base = Glm53ForConditionalGeneration.from_pretrained(ckpt)
    lora = Glm53ForConditionalGeneration.from_pretrained(ckpt)
    load_lora(lora, tmp / "a")
    state = torch.load(tmp / "a" / "trainer_state.pt", weights_only=True)
    n_adapter = sum(1 for n, _ in lora.named_parameters() if "lora_" in n)
    assert len(state["optimizer"]["state"]) == n_adapter  # the optimizer held the adapters only
    trained = [n for n, p in lora.named_parameters() if "lora_B" in n]
    assert all(lora.get_parameter(n).abs().max() > 0 for n in trained)  # every B left its zero start

    # resume from step 2 (no --init: the base the adapter config records): the same adapter at step 4, bit for bit
    again = _run(prepared, "--steps", "4", "--save", str(tmp / "b"), "--resume", str(tmp / "a" / "step-2"), init=False)
    assert main(again) == 0
    capsys.readouterr()
    b = load_file(tmp / "b" / WEIGHTS_FILE)
    assert adapter.keys() == b.keys() and all(torch.equal(adapter[k], b[k]) for k in adapter)

    # the merged export: every base tensor the adapters do not touch is the base's, rounded to bf16 (the tower
    # among them) or kept fp32 (save_pretrained's fp32 keep-list: dt_bias, ...); the adapted ones are base + s B A
    # (merge_lora in fp32) rounded to bf16, and moved from the base
    merged = Glm53ForConditionalGeneration.from_pretrained(merged_dir, dtype=torch.float32).eval()
    exact = copy.deepcopy(lora)
    merge_lora(exact, dtype=torch.float32)
    # the base tensor each B adapts: `X.lora_B.weight` -> X.weight (a linear), `X.P_lora_B` -> X.P (fused experts)
    adapted = {n.replace(".lora_B.weight", ".weight").replace("_lora_B", "") for n in trained}
    ms, bs, es = merged.state_dict(), base.state_dict(), exact.state_dict()
    assert ms.keys() == bs.keys() == es.keys()
    for name, value in bs.items():
        want = es[name] if name in adapted else value
        assert torch.equal(ms[name], want.bfloat16().float()) or torch.equal(ms[name], want), name
        assert (name in adapted) != torch.equal(es[name], value), name
    assert any(n.startswith("visual.merger.") for n in adapted) and any("experts.gate_up_proj" in n for n in adapted)

    # transformers reads the export: its logits on a packed batch with images are glm53's
    from transformers import Glm5NextForConditionalGeneration

    batch = _batch(prepared, merged)
    with torch.no_grad():
        ours = merged(**batch).logits
        hf = Glm5NextForConditionalGeneration.from_pretrained(merged_dir, dtype=torch.float32).eval()
        for c in (hf.config, hf.config.text_config, hf.config.vision_config):
            c._attn_implementation = "eager"
        theirs = hf(**batch).logits
    valid = batch["attention_mask"].bool()
    assert (theirs - ours)[valid].abs().max() <= LOGITS_REL * ours[valid].abs().max()


def test_vl_bf16_base_lora_run(prepared, capsys):
    tmp, _, _, _ = prepared
    assert main(_run(prepared, "--steps", "2", "--base-dtype", "bf16", "--save", str(tmp / "bf16"))) == 0
    losses = _losses(capsys.readouterr().out)
    assert len(losses) == 2 and all(v == v for v in losses)
    assert any(".visual.merger." in k for k in load_file(tmp / "bf16" / WEIGHTS_FILE))


def test_vl_lora_needs_a_vl_checkpoint(prepared, tmp_path, capsys):
    from glm53 import Glm53Config, Glm53ForCausalLM

    _, ckpt, data, root = prepared
    text_only = str(tmp_path / "text")
    Glm53ForCausalLM(Glm53Config.from_pretrained(ckpt)).save_pretrained(text_only)
    with pytest.raises(SystemExit, match=r"but .*text is a text-only checkpoint"):
        main(
            [
                "train",
                "--init",
                text_only,
                "--tokenizer",
                ckpt,
                "--data",
                data,
                "--media-root",
                root,
                "--lora-rank",
                "2",
                "--steps",
                "1",
            ]
        )


def test_vl_lora_under_torchrun_is_refused_before_any_work():
    args = argparse.Namespace(data="vl.jsonl", media_root=None, lora_rank=2, base_dtype=None, export_merged=None)
    check_args(args, "vl.jsonl:1")  # one process: LoRA on the VL model
    with pytest.raises(SystemExit, match="--lora-rank with image/video --data under torchrun is not supported"):
        check_args(args, "vl.jsonl:1", distributed=True)
