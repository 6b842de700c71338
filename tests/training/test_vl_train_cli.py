"""`glm53 train --init VL_DIR --data vl.jsonl --media-root DIR` end to end (single process): finite, decreasing
loss, image tokens logged, the frozen tower unchanged, exact resume; bad combinations are clear errors."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from glm53.__main__ import main
from glm53.training.data.vl_pack import VLPacker, make_batch
from glm53.training.vl_finetune import VLFileData, heldout_loss, model_inputs
from glm53.vision.image_processing import MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS
from glm53.vision.model import Glm53ForConditionalGeneration
from glm53.vision.video_processing import MAX_VIDEO_TOKENS
from tests.helpers.vl_data import tiny_vl_model, vl_corpus, vl_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlcli")
    tok = vl_tokenizer()
    ckpt = str(tmp / "base")
    tiny_vl_model(tok, seed=3).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    data = write_jsonl(str(tmp / "vl.jsonl"), vl_corpus(str(tmp / "media"), n=6))
    write_jsonl(str(tmp / "heldout.jsonl"), vl_corpus(str(tmp / "media"), n=3, seed=7, prefix="held"))
    return tmp, ckpt, data, str(tmp / "media")


def _train(prepared, *extra):
    _, ckpt, data, root = prepared
    return [
        "train",
        "--init",
        ckpt,
        "--data",
        data,
        "--media-root",
        root,
        "--seq-len",
        "96",
        "--batch-size",
        "2",
        "--lr",
        "3e-3",
        "--log-every",
        "1",
        *extra,
    ]


def _losses(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step +\d+  loss ([0-9.]+)", text, flags=re.M)]


def records_alone(model, path: str, tokenizer: str, root: str) -> tuple[float, int]:
    """(loss over every target token of `path`'s records, each record in a row of its own; its image tokens)."""
    ns = argparse.Namespace(
        data=path,
        media_root=root,
        batch_size=1,
        grad_accum=1,
        seq_len=96,
        seed=0,
        strict=False,
        image_min_tokens=MIN_IMAGE_TOKENS,
        image_max_tokens=MAX_IMAGE_TOKENS,
        video_max_tokens=MAX_VIDEO_TOKENS,
    )
    data = VLFileData(ns, tokenizer, model, 1, 0)
    batches = [make_batch([VLPacker([d], len(d.ids), 0, 0).vl_row()], data.encoder) for d in data.docs]
    inputs = [model_inputs(model, b) for b in batches]
    counts = [model.loss_counts(i["labels"], i["attention_mask"], i["position_ids"]) for i in inputs]
    den = sum(counts[1:], counts[0])
    with torch.no_grad():
        total = sum(model.eval()(**i, loss_denominators=den, return_logits=False).lm_loss for i in inputs)
    return float(total), sum(b.media_tokens() for b in batches)


def test_train_resume_and_freeze(prepared, capsys):
    tmp, ckpt, _, root = prepared
    out = tmp / "run"
    held = str(tmp / "heldout.jsonl")
    run = _train(prepared, "--steps", "4", "--save", str(out), "--save-every", "2")
    assert main([*run, "--eval-data", held, "--eval-every", "2"]) == 0
    text = capsys.readouterr().out
    losses = _losses(text)
    assert len(losses) == 4 and all(map(lambda v: v == v and v < 100, losses))
    assert losses[-1] < losses[0]
    assert re.search(r"^step +1 .* \d+ image tokens$", text, flags=re.M)
    assert "with media" in text and "images" in text
    # the held-out loss on image/video records, its image tokens counted apart: the saved final model's loss over
    # every held-out record run alone (no packing; 4 printed decimals), and heldout_loss's numbers
    evals = re.findall(r"^eval  step +(\d+)  loss ([0-9.]+)  perplexity [0-9.]+  (\d+) image tokens$", text, re.M)
    assert [int(s) for s, _, _ in evals] == [2, 4], text
    final = Glm53ForConditionalGeneration.from_pretrained(str(out))
    want, media = records_alone(final, held, ckpt, root)
    assert media > 0 and all(int(n) == media for _, _, n in evals)
    assert heldout_loss(final, held, ckpt, 96, root) == pytest.approx((want, media), rel=1e-5)
    assert abs(float(evals[-1][1]) - want) <= 5e-5 + 1e-5 * want
    assert float(evals[-1][1]) < float(evals[0][1])  # training on the same task lowers the held-out loss
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_image_tokens"] for r in records if "eval_loss" in r] == [media, media]
    base = Glm53ForConditionalGeneration.from_pretrained(ckpt).state_dict()
    tuned = Glm53ForConditionalGeneration.from_pretrained(str(out)).state_dict()
    for name in base:  # the tower frozen (default), the projector and the language model trained
        if name.startswith(("visual.patch_embed.", "visual.blocks.", "visual.post_layernorm.")):
            assert torch.equal(base[name], tuned[name]), name
    assert not torch.equal(base["visual.merger.proj.weight"], tuned["visual.merger.proj.weight"])
    assert not torch.equal(base["lm_head.weight"], tuned["lm_head.weight"])
    # resume from step 2: the same final weights, bit for bit
    resumed = tmp / "resumed"
    args = _train(prepared, "--steps", "4", "--save", str(resumed))
    i = args.index("--init")
    assert main([*args[:i], "--resume", str(out / "step-2"), *args[i + 2 :]]) == 0
    again = Glm53ForConditionalGeneration.from_pretrained(str(resumed)).state_dict()
    assert all(torch.equal(tuned[n], again[n]) for n in tuned)


def test_text_checkpoint_with_vl_data_is_an_error(prepared, tmp_path, capsys):
    from glm53 import Glm53Config, Glm53ForCausalLM

    _, ckpt, data, root = prepared
    text_only = str(tmp_path / "text")
    Glm53ForCausalLM(Glm53Config.from_pretrained(ckpt)).save_pretrained(text_only)
    with pytest.raises(
        SystemExit,
        match=r"--data has image/video records \(the first at .*vl.jsonl:1\) but .*text "
        r"is a text-only checkpoint",
    ):
        main(["train", "--init", text_only, "--tokenizer", ckpt, "--data", data, "--media-root", root, "--steps", "1"])


def test_vl_flags_need_vl_data_and_known_groups(prepared, tmp_path, capsys):
    _, ckpt, _, root = prepared
    text = write_jsonl(str(tmp_path / "t.jsonl"), [{"text": "just words"}])
    with pytest.raises(SystemExit, match="--media-root is for image/video data"):
        main(["train", "--init", ckpt, "--data", text, "--media-root", root, "--steps", "1"])
    assert main(_train(prepared, "--steps", "1", "--freeze", "vision_tower", "eyes")) == 1
    assert "unknown freeze groups ['eyes']" in capsys.readouterr().err
