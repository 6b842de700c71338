"""`python -m glm53 train`: a short run lowers the loss; resuming continues exactly from the saved step."""

import re

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.__main__ import main
from glm53.training.state import TRAINER_STATE
from glm53.training.trainer import lr_at

SMALL = ["train", "--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--log-every", "1", "--lr", "1e-2"]


def losses(text):
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step\s+(\d+)\s+loss (\S+)", text, re.MULTILINE)}


def test_short_run_lowers_loss_and_resume_continues(tmp_path, capsys):
    save = tmp_path / "run"
    assert main(SMALL + ["--steps", "8", "--seed", "3", "--save", str(save), "--save-every", "5"]) == 0
    first = capsys.readouterr()
    straight = losses(first.out)
    assert sorted(straight) == list(range(1, 9))
    assert straight[8] < straight[1] - 0.5, straight
    assert "tok/s" in first.err and "[" in first.err  # the progress bar
    assert "data: the built-in byte corpus" in first.out  # no --data: said, not silent
    assert (save / "config.json").is_file() and (save / "model.safetensors").is_file()
    assert torch.load(save / "step-5" / TRAINER_STATE, weights_only=True)["step"] == 5
    model = Glm53ForCausalLM.from_pretrained(save)  # an official-layout checkpoint, MTP included
    assert model.mtp is not None and model.mtp_checkpoint_keys == []

    assert main(SMALL + ["--steps", "8", "--seed", "3", "--resume", str(save / "step-5")]) == 0
    resumed = capsys.readouterr().out
    assert "resuming" in resumed and "at step 5" in resumed
    again = losses(resumed)
    assert sorted(again) == [6, 7, 8]
    for step in again:  # model, optimizer, router biases, data and RNG state all restored
        assert again[step] == pytest.approx(straight[step], rel=1e-5, abs=1e-6), (step, again, straight)


def test_parallel_flags_need_torchrun():
    with pytest.raises(SystemExit, match="torchrun"):
        main(SMALL + ["--steps", "1", "--dp", "2"])


def test_lr_schedule_warms_up_then_decays():
    assert lr_at(1, 100, 1.0) < lr_at(5, 100, 1.0) == 1.0
    assert lr_at(100, 100, 1.0) == pytest.approx(0.1)
    assert lr_at(50, 100, 1.0) > lr_at(80, 100, 1.0)
