"""`glm53 train --save DIR` over a directory that already holds a checkpoint: a fresh run refuses (before
training, DIR untouched) unless it continues that checkpoint (`--resume DIR`) or is told to replace it
(`--overwrite`)."""

import hashlib
import os

import pytest

from glm53.__main__ import main

SMALL = ["train", "--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--log-every", "1"]


def _digest(path) -> dict[str, str]:
    return {
        name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(path))
        if os.path.isfile(os.path.join(path, name))
    }


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "run"
    assert main(SMALL + ["--steps", "2", "--save", str(path)]) == 0
    return path


def test_a_fresh_run_does_not_replace_a_checkpoint(saved, capsys):
    before = _digest(saved)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(SMALL + ["--steps", "2", "--seed", "1", "--save", str(saved)])
    message = str(info.value.code)
    assert f"--save {saved} already holds a checkpoint" in message and "--overwrite" in message
    assert "step" not in capsys.readouterr().out  # refused before training
    assert _digest(saved) == before


@pytest.mark.parametrize("extra", ["overwrite", "resume"])
def test_overwrite_or_resume_may_replace_it(saved, extra, capsys):
    before = _digest(saved)
    flags = ["--overwrite", "--seed", "1"] if extra == "overwrite" else ["--resume", str(saved)]
    assert main(SMALL + ["--steps", "3", "--save", str(saved)] + flags) == 0
    after = _digest(saved)
    assert after.keys() == before.keys() and after["model.safetensors"] != before["model.safetensors"]


def test_an_empty_or_foreign_directory_is_fine(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(SMALL + ["--steps", "1", "--save", str(tmp_path)]) == 0
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "config.json").exists()
