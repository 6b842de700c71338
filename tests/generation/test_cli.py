"""`python -m glm53 generate`: streams text from a saved checkpoint (byte codec), prints tokens/s; bad numbers are
argparse usage errors."""

from __future__ import annotations

import pytest
import torch

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
    assert (
        main(
            [
                "generate",
                "--model",
                checkpoint,
                "--prompt",
                "Hi",
                "--max-new-tokens",
                "5",
                "--temperature",
                "0.8",
                "--top-p",
                "0.9",
                "--seed",
                "4",
            ]
        )
        == 0
    )
    assert main(["generate", "--model", checkpoint, "--prompt", "Hi", "--max-new-tokens", "5", "--mtp", "2"]) == 0
    assert "acceptance rate" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--max-new-tokens", "-1"),
        ("--temperature", "-0.5"),
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--seed", "x"),
        ("--mtp", "0"),
    ],
)
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


def _continuations(out: str) -> list[str]:
    """The `### i` sections of a --prompts run (without the speed line)."""
    body = out[: out.rindex("\n[")]
    return [part.split("\n", 1)[1] for part in body.split("### ")[1:]]


def test_prompts_file_is_one_left_padded_batch(checkpoint, capsys, tmp_path):
    """--prompts FILE (lines, and .jsonl of objects or strings): each continuation equals its prompt run alone."""
    alone = []
    for prompt in ("Hello", "Hi there, you"):
        assert main(["generate", "--model", checkpoint, "--prompt", prompt, "--max-new-tokens", "5"]) == 0
        out = capsys.readouterr().out
        alone.append(out[: out.rindex("\n[")].rstrip("\n"))
    lines, jsonl = tmp_path / "p.txt", tmp_path / "p.jsonl"
    lines.write_text("Hello\n\nHi there, you\n")
    jsonl.write_text('{"prompt": "Hello"}\n"Hi there, you"\n')
    for path in (lines, jsonl):
        assert main(["generate", "--model", checkpoint, "--prompts", str(path), "--max-new-tokens", "5"]) == 0
        got = [text.rstrip("\n") for text in _continuations(capsys.readouterr().out)]
        assert got == alone


BAD_PROMPTS = {
    "p.txt": ("\n\n", "holds no prompt"),
    "p.jsonl": ("{bad\n", "line 1: not JSON"),
    "q.jsonl": ('"ok"\n{"text": "x"}\n', "line 2: expected a JSON string"),
    "ok.txt": ("Hi\n", ""),
}


@pytest.mark.parametrize(
    "argv,error",
    [
        (["--prompts", "p.txt"], BAD_PROMPTS["p.txt"][1]),
        (["--prompts", "p.jsonl"], BAD_PROMPTS["p.jsonl"][1]),
        (["--prompts", "q.jsonl"], BAD_PROMPTS["q.jsonl"][1]),
        (["--prompts", "missing.txt"], "cannot read"),
        (["--prompt", "Hi", "--prompts", "ok.txt"], "not allowed with"),
        (["--prompt", "Hi", "--device", "tpu:0"], "tpu"),
        (["--prompt", "Hi", "--device", "cuda:7" if not torch.cuda.is_available() else "meta"], "not available"),
    ],
)
def test_bad_batch_and_device_flags_are_usage_errors(checkpoint, capsys, tmp_path, argv, error):
    for name, (content, _) in BAD_PROMPTS.items():
        (tmp_path / name).write_text(content)
    argv = [str(tmp_path / a) if a.endswith((".txt", ".jsonl")) else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", checkpoint] + argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert error in err and ("--device" in err if "--device" in argv else "--prompts" in err)


def test_chat_applies_the_tokenizers_template(checkpoint, capsys, tmp_path):
    """--chat wraps the prompt in the tokenizer's chat template (the text printed is the templated prompt); without a
    template (the byte codec) it is an error naming --chat, no traceback."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(
        "finetune_example", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune.py")
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tok_dir = tmp_path / "tok"
    example.build_tokenizer().save_pretrained(tok_dir)
    assert (
        main(
            [
                "generate",
                "--model",
                checkpoint,
                "--tokenizer",
                str(tok_dir),
                "--prompt",
                "Hi",
                "--chat",
                "--max-new-tokens",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("<|user|>\nHi\n<|assistant|>\n")
    assert main(["generate", "--model", checkpoint, "--prompt", "Hi", "--chat"]) == 1
    assert "--chat needs a tokenizer with a chat template" in capsys.readouterr().err


def test_device_flag_places_the_model(checkpoint, capsys):
    assert (
        main(["generate", "--model", checkpoint, "--prompt", "Hello", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    )
    assert "3 new tokens" in capsys.readouterr().out
