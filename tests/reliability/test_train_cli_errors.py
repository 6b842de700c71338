"""`glm53 train` with bad numbers or bad checkpoints: argparse usage errors (exit 2) naming the flag, or one
line on stderr with exit 1; never a traceback."""

import pytest
import torch

from glm53.__main__ import main
from glm53.training.state import RUN_TAG, TRAINER_STATE

SMALL = ["train", "--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--log-every", "1"]


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--batch-size", "0", "must be >= 1, got 0"),
        ("--seq-len", "0", "must be >= 2, got 0"),
        ("--log-every", "0", "must be >= 1, got 0"),
        ("--steps", "-5", "must be >= 1, got -5"),
        ("--save-every", "-1", "must be >= 0, got -1"),
        ("--lr", "-1e-3", "must be > 0, got -1e-3"),
        ("--lr", "nan", "expected a finite number, got 'nan'"),
        ("--bias-rate", "nan", "expected a finite number"),
        ("--bias-rate", "-1", "must be >= 0"),
        ("--threads", "0", "must be >= 1"),
        ("--dp", "0", "must be >= 1"),
        ("--steps", "ten", "expected an integer, got 'ten'"),
        ("--seed", str(2**70), "must be in [0, 4294967295]"),
    ],
)
def test_bad_numbers_are_usage_errors(flag, value, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(SMALL + [f"{flag}={value}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err and "Traceback" not in err


def test_sequence_longer_than_the_corpus(capsys):
    assert main(SMALL + ["--seq-len", "100000", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "--seq-len 100000 needs a corpus of more than 100000 tokens" in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "ckpt"
    assert main(SMALL + ["--steps", "2", "--save", str(path)]) == 0
    return path


def _resume_error(path, capsys) -> str:
    capsys.readouterr()
    assert main(SMALL + ["--steps", "3", "--resume", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("glm53 train: error: ") and len(err.strip().splitlines()) == 1, err
    return err


def _copy(saved, tmp_path):
    import shutil

    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "foreign-object", "missing-rng", "short-rng"])
def test_damaged_trainer_state_is_one_line(saved, tmp_path, capsys, damage):
    path = _copy(saved, tmp_path)
    file = path / TRAINER_STATE
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:200])
    elif damage == "garbage":
        file.write_bytes(b"\x00not a torch file")
    elif damage == "foreign-object":
        torch.save({"epoch": 3}, file)
    else:
        state = torch.load(file, weights_only=True)
        if damage == "missing-rng":
            del state["torch_rng"]
        else:
            state["data_rng"] = state["data_rng"][:100]
        torch.save(state, file)
    err = _resume_error(path, capsys)
    assert str(file) in err


def test_trainer_state_of_another_model(saved, tmp_path, capsys):
    path = _copy(saved, tmp_path)
    state = torch.load(path / TRAINER_STATE, weights_only=True)
    first = state["optimizer"]["state"][0]
    first["exp_avg"] = torch.zeros(7, 3)  # as if saved for other shapes; the run tag still matches
    torch.save(state, path / TRAINER_STATE)
    err = _resume_error(path, capsys)
    assert "optimizer state 'exp_avg' of parameter 0 has shape (7, 3)" in err and RUN_TAG not in err


def test_save_onto_a_file_is_refused_before_training(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_bytes(b"keep")
    with pytest.raises(SystemExit, match="exists and is not a directory"):
        main(SMALL + ["--steps", "1", "--save", str(target)])
    assert target.read_bytes() == b"keep"


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--cp", "2"], ["--ep", "2"], ["--dp", "2"]])
def test_bf16_under_torchrun_needs_an_fsdp_dimension(layout, monkeypatch):
    """--bf16 under torchrun is FSDP2's policy: refused before any work for a --tp-only layout (no FSDP), accepted
    (past this check: the next step is the process group, absent here) when dp, cp or ep holds replicas."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("glm53.training.cli.Trainer", lambda *a: (_ for _ in ()).throw(RuntimeError("reached")))
    if layout[0] == "--tp":
        with pytest.raises(SystemExit, match="a --tp-only layout has no FSDP"):
            main(SMALL + ["--steps", "1", "--bf16", *layout])
    else:
        with pytest.raises(RuntimeError, match="reached"):
            main(SMALL + ["--steps", "1", "--bf16", *layout])
