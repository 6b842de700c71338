"""`torchrun -m glm53 train --dp 2` on a VL jsonl (gloo): finite losses while one rank's micro-batch has no image
(the tower's zero-weighted dummy forward keeps FSDP's collectives matched), each rank decoding its own rows."""

from __future__ import annotations

import argparse
import math

from glm53.training.vl_finetune import VLFileData
from tests.helpers.vl_data import tiny_vl_model, vl_corpus, vl_tokenizer, write_jsonl
from tests.training.test_train_cli import losses
from tests.training.test_train_distributed import torchrun


def test_dp2_vl_with_a_text_only_rank(tmp_path):
    tok = vl_tokenizer()
    ckpt = str(tmp_path / "base")
    tiny_vl_model(tok, seed=4).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    records = vl_corpus(str(tmp_path / "media"), n=2) + [{"text": f"words and more words {k} " * 4} for k in range(6)]
    data = write_jsonl(str(tmp_path / "vl.jsonl"), records)
    flags = [
        "--init",
        ckpt,
        "--data",
        data,
        "--media-root",
        str(tmp_path / "media"),
        "--seq-len",
        "64",
        "--batch-size",
        "1",
        "--seed",
        "2",
    ]
    # the steps' rows per rank, packed as the run packs them: some step has images on one rank only
    ns = argparse.Namespace(
        data=data,
        media_root=str(tmp_path / "media"),
        batch_size=1,
        grad_accum=1,
        seq_len=64,
        seed=2,
        strict=False,
        image_min_tokens=16,
        image_max_tokens=8000,
        video_max_tokens=240000,
    )
    model = tiny_vl_model(tok, seed=4)
    ranks = [VLFileData(ns, ckpt, model, 2, r) for r in range(2)]
    media = [[r.next_step()[0].media_tokens() > 0 for r in ranks] for _ in range(3)]
    assert any(a != b for a, b in media), media
    out = torchrun("train", *flags, "--dp", "2", "--steps", "3", "--log-every", "1")
    got = losses(out)
    assert sorted(got) == [1, 2, 3] and all(math.isfinite(v) for v in got.values())
    assert "image tokens" in out
