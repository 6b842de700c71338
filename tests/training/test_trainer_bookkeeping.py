"""Trainer bookkeeping pinned exactly: which steps are logged and saved, resume edge cases (at or past --steps,
another layout, --data on a corpus run), the progress bar and loss-part text. Legend: no tensors beyond ids."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from glm53.__main__ import main
from glm53.training.metrics import Recorder
from glm53.training.metrics import describe_parts as _describe
from glm53.training.metrics import progress_text as _progress
from glm53.training.state import TRAINER_STATE
from glm53.training.trainer import Trainer

SMALL = ["train", "--preset", "tiny", "--batch-size", "1", "--seq-len", "16", "--log-every", "1", "--lr", "1e-2"]


def checkpoints(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("step-"))


def test_save_every_counts_global_steps_and_resume_edges(tmp_path, capsys):
    run, again, kept = tmp_path / "run", tmp_path / "again", tmp_path / "kept"
    assert main(SMALL + ["--steps", "2", "--save", str(run), "--save-every", "1"]) == 0
    assert checkpoints(run) == ["step-1"]  # the last step is the final checkpoint itself, no step-2 copy
    assert (
        main(SMALL + ["--steps", "3", "--resume", str(run / "step-1"), "--save", str(again), "--save-every", "2"]) == 0
    )
    assert checkpoints(again) == ["step-2"]  # every 2nd global step, not every 2nd step since the resume
    assert torch.load(again / "step-2" / TRAINER_STATE, weights_only=True)["step"] == 2
    capsys.readouterr()
    assert main(SMALL + ["--steps", "2", "--resume", str(run)]) == 0
    assert "already at step 2 >= --steps 2; nothing to do" in capsys.readouterr().out
    assert main(SMALL + ["--steps", "1", "--resume", str(run), "--save", str(kept)]) == 0
    assert torch.load(kept / TRAINER_STATE, weights_only=True)["step"] == 2  # never saved as an earlier step
    with pytest.raises(SystemExit, match="trained on the built-in corpus, not on --data"):
        main(SMALL + ["--steps", "3", "--resume", str(run), "--data", str(tmp_path / "x.jsonl"), "--override", "data"])
    state = torch.load(run / TRAINER_STATE, weights_only=False)
    state["layout"] = [2, 1]
    torch.save(state, run / TRAINER_STATE)
    with pytest.raises(SystemExit, match=r"saved with layout \[2, 1\]"):
        main(SMALL + ["--steps", "3", "--resume", str(run)])


def test_log_steps_progress_bar_and_loss_parts(capsys):
    fake = SimpleNamespace(
        args=argparse.Namespace(steps=10, log_every=4),
        start=5,
        lr=1.0,
        vl_record=None,  # a text run: no image-token count on the line
        recorder=Recorder(None, False, 10, 5, active=True),
    )  # not a TTY: no bar
    fake._is_log_step = lambda step: Trainer._is_log_step(fake, step)
    parts = {"loss": 2.0, "lm_loss": 1.5, "mtp_loss": 0.25, "aux_loss": 0.125}
    for step in range(6, 11):
        Trainer._log(fake, step, parts, 2.0, 100.0)
    out = capsys.readouterr().out
    assert [int(line.split()[1]) for line in out.splitlines()] == [6, 8, 10]  # first after the resume, every 4th, last
    assert "loss 2.0000  lm 1.5000  mtp 0.25  aux 0.125  lr " in out
    assert _describe({"lm_loss": 3.0}) == "lm 3.0000"
    bar, *rest = _progress(6, 24, 1.5, 1234.0).split()  # what the bar says, not how it is drawn
    assert bar.count("#") / len(bar.strip("[]")) == 6 / 24 and rest[0] == "6/24"
    assert float(rest[rest.index("loss") + 1]) == 1.5 and "1,234 tok/s" in " ".join(rest)


def test_corpus_micro_batches_are_grad_accum_draws():
    draws = iter(torch.arange(12).view(4, 1, 3))
    micro = Trainer.next_micro_batches(SimpleNamespace(data=None, args=argparse.Namespace(grad_accum=3)), draws)
    assert [m["input_ids"].tolist() for m in micro] == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]]]
    assert all(m["labels"] is m["input_ids"] for m in micro)


def test_an_infinite_loss_stops_the_run(monkeypatch):
    inf = {"loss": torch.tensor(float("inf")), "lm_loss": torch.tensor(1.0)}
    monkeypatch.setattr(Trainer, "step", lambda self, step, micro: dict(inf))
    with pytest.raises(SystemExit, match="step 1: loss is inf; stopping"):
        main(SMALL + ["--steps", "2"])
