"""`torchrun -m glm53 train` on a VL jsonl (gloo). --dp 2: finite losses while one rank's micro-batch has no image
(the tower's zero-weighted dummy forward keeps FSDP's collectives matched), each rank decoding its own rows; its DCP
save resumes exactly (3 steps == 2 + resume for 1: the loss and every weight).
--cp 2: the losses of one process on the same rows (each cp rank runs the tower on the images its slice's
placeholders take and splices its own feature rows), with the tower trained too; the first step has no image (the
tower's dummy zero gradients are dropped, so AdamW skips the tower as one process does). The CLI runs on the shared
gloo pool's ranks (tests/helpers/cli_jobs.py)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from glm53.__main__ import main
from glm53.training.vl_finetune import VLFileData
from glm53.vision.model import Glm53ForConditionalGeneration
from tests.helpers.cli_jobs import torchrun_in
from tests.helpers.vl_data import tiny_vl_model, vl_corpus, vl_tokenizer, write_jsonl
from tests.training.test_train_cli import losses

REL = 1e-3  # losses printed with 4 decimals (~1e-4 relative at loss ~6), fp32 reduction orders below that


def _run_files(tmp_path) -> tuple[str, str, list[str]]:
    """(checkpoint, data file, the common flags) of a tiny VL run: 2 image/video records among 6 text ones."""
    tok = vl_tokenizer()
    ckpt = str(tmp_path / "base")
    tiny_vl_model(tok, seed=4).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    records = vl_corpus(str(tmp_path / "media"), n=2) + [{"text": f"words and more words {k} " * 4} for k in range(6)]
    data = write_jsonl(str(tmp_path / "vl.jsonl"), records)
    return (
        ckpt,
        data,
        [
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
        ],
    )


def test_dp2_vl_with_a_text_only_rank(tmp_path, pool2):
    ckpt, data, flags = _run_files(tmp_path)
    tok = vl_tokenizer()
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
    save = tmp_path / "run"
    run = ["--dp", "2", "--steps", "3", "--log-every", "1", "--save", str(save), "--save-every", "2"]
    out = torchrun_in(pool2, "train", *flags, *run)
    got = losses(out)
    assert sorted(got) == [1, 2, 3] and all(math.isfinite(v) for v in got.values())
    assert "image tokens" in out
    # DCP resume from step 2 (model, optimizer, both ranks' data cursors and RNG): step 3 as the straight run's,
    # its loss and every final weight bit for bit (the same gloo reductions in the same order)
    i = flags.index("--init")
    again = [
        *flags[:i],
        *flags[i + 2 :],
        *run[:-4],
        "--save",
        str(tmp_path / "resumed"),
        "--resume",
        str(save / "step-2"),
    ]
    resumed = losses(torchrun_in(pool2, "train", *again))
    assert sorted(resumed) == [3] and resumed[3] == got[3], (resumed, got)
    want = Glm53ForConditionalGeneration.from_pretrained(str(save)).state_dict()
    have = Glm53ForConditionalGeneration.from_pretrained(str(tmp_path / "resumed")).state_dict()
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
    base = Glm53ForConditionalGeneration.from_pretrained(ckpt).state_dict()
    assert not torch.equal(want["visual.merger.proj.weight"], base["visual.merger.proj.weight"])  # it trained


@pytest.mark.parametrize(
    "layout, reference",
    [(("--cp", "2"), None), (("--tp", "2"), None), (("--dp", "1", "--ep", "2"), ("--dp", "2"))],
    ids=["cp2", "tp2", "ep2"],
)
def test_vl_layout_matches_one_process(tmp_path, capsys, layout, reference, pool2):
    """--cp 2, --tp 2 and --ep 2 on VL data, the tower trained (--freeze router): every step's loss is that of one
    process on the same rows (the tower replicated over tp and ep, its features spliced per cp slice). ep ranks read
    their own rows, as dp ranks do: --ep 2 is compared with --dp 2."""
    _, _, flags = _run_files(tmp_path)
    flags += ["--steps", "3", "--log-every", "1", "--freeze", "router"]
    if reference is None:
        assert main(["train", *flags]) == 0
        one = losses(capsys.readouterr().out)
    else:
        one = losses(torchrun_in(pool2, "train", *flags, *reference))
    out = torchrun_in(pool2, "train", *flags, *layout)
    assert f"{layout[-2][2:]} {layout[-1]}" in out and "image tokens" in out  # the layout it announced
    got = losses(out)
    assert sorted(got) == [1, 2, 3]
    for step, value in got.items():
        assert value == pytest.approx(one[step], rel=REL), (got, one)
