"""`python -m glm53 generate`: streams text from a saved checkpoint (byte codec), prints tokens/s; bad numbers are
argparse usage errors."""

from __future__ import annotations

import pytest

from glm53.__main__ import main
from glm53.training.data import VOCAB_SIZE
from tests.helpers.generation import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    tiny_model(vocab_size=VOCAB_SIZE + 63, num_nextn_predict_layers=1).save_pretrained(path)
    return str(path)


def test_generate_streams_and_reports_speed(checkpoint, capsys):
    assert main(["generate", "--model", checkpoint, "--prompt", "Hello", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Hello")
    assert "6 new tokens" in out and "decode" in out and "tok/s" in out
    assert main(["generate", "--model", checkpoint, "--prompt", "Hi", "--max-new-tokens", "5", "--temperature",
                 "0.8", "--top-p", "0.9", "--seed", "4"]) == 0  # fmt: skip
    assert main(["generate", "--model", checkpoint, "--prompt", "Hi", "--max-new-tokens", "5", "--mtp", "2"]) == 0
    assert "acceptance rate" in capsys.readouterr().out


@pytest.mark.parametrize("flag,value", [("--max-new-tokens", "-1"), ("--temperature", "-0.5"), ("--top-p", "0"),
                                        ("--top-p", "1.5"), ("--seed", "x"), ("--mtp", "0")])  # fmt: skip
def test_bad_numbers_are_usage_errors(checkpoint, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", checkpoint, "--prompt", "Hi", flag, value])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_compile_flag_decodes_the_same_tokens(checkpoint, capsys):
    plain = ["generate", "--model", checkpoint, "--prompt", "Hello", "--max-new-tokens", "6"]
    assert main(plain) == 0
    out = capsys.readouterr().out
    eager = out[: out.rindex("\n[")]  # the streamed text, without the speed line
    assert main(plain + ["--compile", "aot_eager"]) == 0  # traced graphs, no C++ compile (the suite stays fast)
    out = capsys.readouterr().out
    assert out[: out.rindex("\n[")] == eager and len(eager) > len("Hello")


def test_compile_flag_with_mtp_decodes_the_same_tokens(checkpoint, capsys):
    """--compile with --mtp: the compiled verify and draft steps stream the plain greedy text."""
    plain = ["generate", "--model", checkpoint, "--prompt", "Hello", "--max-new-tokens", "6"]
    assert main(plain) == 0
    out = capsys.readouterr().out
    eager = out[: out.rindex("\n[")]
    assert main(plain + ["--mtp", "2", "--compile", "aot_eager"]) == 0
    out = capsys.readouterr().out
    assert "acceptance rate" in out
    assert out[: out.index("\n[")] == eager and len(eager) > len("Hello")


@pytest.mark.parametrize("extra", [["--compile", "cuda-graphs"], ["--mtp", "2", "--compile", "nonsense"]])
def test_bad_compile_options_are_usage_errors(checkpoint, capsys, extra):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", checkpoint, "--prompt", "Hi"] + extra)
    assert exit_info.value.code == 2
    assert "--compile" in capsys.readouterr().err
