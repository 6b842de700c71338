"""Bad input to every command line (`python -m glm53 train|generate`, `python -m glm53.tools.plan`,
`python -m glm53.tools.ckpt_plan`): a bad number or path is argparse's usage error (exit 2, the flag named), a
file that cannot be read one line on stderr (exit 1); never a traceback. No tensors."""

import json
import os

import pytest

from glm53.__main__ import main
from glm53.config import Glm53Config
from glm53.tools import ckpt_plan, plan

GENERATE = ["generate", "--prompt", "Hi", "--max-new-tokens", "1"]


def usage_error(run, argv, flag, message, capsys):
    with pytest.raises(SystemExit) as info:
        run(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--steps", "-1", "must be >= 1, got -1"),
        ("--steps", "x", "expected an integer, got 'x'"),
        ("--batch-size", "0", "must be >= 1, got 0"),
        ("--seq-len", "1", "must be >= 2, got 1"),
        ("--seq-len", "0", "must be >= 2, got 0"),
        ("--lr", "nan", "expected a finite number"),
        ("--lr", "0", "must be > 0"),
        ("--seed", "-5", "must be in [0, 4294967295]"),
    ],
)
def test_train_number_flags(flag, value, message, capsys):
    usage_error(main, ["train", f"{flag}={value}"], flag, message, capsys)


def test_train_sequence_longer_than_the_corpus(capsys):
    assert main(["train", "--steps", "1", "--seq-len", "10000000"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("glm53 train: error: --seq-len 10000000") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--seq-len", "1", "must be >= 2, got 1"),  # one token: no next-token target, a loss of nothing
        ("--threads", str((os.cpu_count() or 1) + 1), "this machine's CPU count"),  # torch crashes on huge counts
        ("--threads", "100000", "this machine's CPU count"),
    ],
)
def test_train_numbers(flag, value, message, capsys):
    usage_error(main, ["train", f"{flag}={value}"], flag, message, capsys)


@pytest.mark.parametrize("below", ["file/x", "file/deeper/x"])
def test_train_save_below_a_file_fails_before_training(tmp_path, below, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=rf"--save .*{below}: .*file is not a directory"):
        main(["train", "--steps", "1", "--save", str(tmp_path / below)])
    assert "step" not in capsys.readouterr().out  # nothing trained


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--temperature", "inf", "must lie in [0.0, inf]"),
        ("--temperature", "nan", "must lie in"),
        ("--top-p", "inf", "must lie in (0.0, 1.0]"),
        ("--seed", str(2**70), "must be in [0, 4294967295]"),
        ("--seed", "-1", "must be in [0, 4294967295]"),
    ],
)
def test_generate_numbers(flag, value, message, tmp_path, capsys):
    usage_error(main, GENERATE + ["--model", str(tmp_path), f"{flag}={value}"], flag, message, capsys)


@pytest.mark.parametrize("flag", ["--model", "--tokenizer"])
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_generate_paths_are_usage_errors(flag, kind, tmp_path, capsys):
    path = tmp_path / "x"
    if kind == "file":
        path.write_text("{}")
    argv = GENERATE + ["--model", str(tmp_path), flag, str(path)]
    message = "not a directory" if kind == "file" else "no such directory"
    usage_error(main, argv, flag, f"{path}: {message}", capsys)


@pytest.fixture
def bad_checkpoints(tmp_path):
    """Directories `generate --model` cannot use: no config.json, config.json not JSON, weights truncated."""
    config = json.dumps(Glm53Config.tiny().to_official_dict())
    dirs = {name: tmp_path / name for name in ("empty", "not-json", "truncated", "no-tokenizer")}
    for d in dirs.values():
        d.mkdir()
    (dirs["not-json"] / "config.json").write_text("{")
    (dirs["truncated"] / "config.json").write_text(config)
    (dirs["truncated"] / "model.safetensors").write_bytes(b"\x10\x00\x00")
    return dirs


@pytest.mark.parametrize(
    "name,message",
    [
        ("empty", "no config.json"),
        ("not-json", "is not valid JSON"),
        ("truncated", "model.safetensors"),
    ],
)
def test_generate_unreadable_checkpoint_is_one_line(bad_checkpoints, name, message, capsys):
    assert main(GENERATE + ["--model", str(bad_checkpoints[name])]) == 1
    err = capsys.readouterr().err
    assert err.startswith("glm53 generate: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_generate_tokenizer_directory_without_tokenizer(bad_checkpoints, tmp_path, capsys):
    from glm53.generation import cli

    with pytest.raises(OSError, match=rf"--tokenizer {tmp_path}: no tokenizer there"):
        cli._Codec(str(tmp_path), str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{")  # a tokenizer file transformers cannot parse
    with pytest.raises(OSError, match=rf"--tokenizer {tmp_path}: cannot load a tokenizer there"):
        cli._Codec(str(tmp_path), str(tmp_path))


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--dp", "0", "must be >= 1, got 0"),
        ("--cp", "x", "expected an integer"),
        ("--batch", "-2", "must be >= 1"),
        ("--device-gib", "nan", "expected a finite number"),
        ("--device-gib", "-1", "must be > 0"),
        ("--device-gib", "inf", "expected a finite number"),
        ("--seq-len", "0", "must be >= 1"),
    ],
)
def test_plan_numbers(flag, value, message, capsys):
    usage_error(plan.main, [f"{flag}={value}"], flag, message, capsys)


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--dp", "0", "must be >= 1, got 0"),
        ("--tp", "-1", "must be >= 1, got -1"),
        ("--num-layers", "0", "must be >= 1, got 0"),
        ("--num-layers", "-3", "must be >= 1"),
        ("--ranks", "a", "expected comma-separated integer ranks"),
        ("--ranks", "0,,1", "expected comma-separated"),
        ("--ranks", "4", "[4] outside the 4 ranks of --dp 2 x --tp 2"),
        ("--ranks", "-5", "[-5] outside the 4 ranks"),
        ("--max-shard-size", "xx", "size like '5GB'"),
        ("--max-shard-size", "0", "must be positive"),
    ],
)
def test_ckpt_plan_numbers(flag, value, message, capsys):
    usage_error(ckpt_plan.main, ["--dp", "2", "--tp", "2", f"{flag}={value}"], flag, message, capsys)


def test_ckpt_plan_unreadable_config_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[1, 2]")
    for config, message in ((tmp_path / "none", "no config.json"), (tmp_path, "config must be a dict")):
        assert ckpt_plan.main(["--config", str(config), "--num-layers", "1", "--dp", "1", "--tp", "1"]) == 1
        err = capsys.readouterr().err
        assert f"--config {config}: " in err and message in err and len(err.strip().splitlines()) == 1
