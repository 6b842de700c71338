"""`python -m glm53 generate`: streams text from a saved checkpoint (byte codec), prints tokens/s; bad numbers are
argparse usage errors.

Edges of `python -m glm53 generate` (generation/cli.py): the streamed text is exactly the greedy continuation,
defaults, --seed / --top-k / --top-p on their own, numbers at their limits, the byte streamer's hold-back of an
incomplete character, and what reaches `generate`.

Legend: T tokens.
"""

from __future__ import annotations

import io

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.__main__ import main
from glm53.generation import cli
from glm53.generation.emit import GenerationStats
from glm53.training.data import BYTE_OFFSET, VOCAB_SIZE, encode
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
    assert (
        main(plain + ["--compile", "eager"]) == 0
    )  # dynamo's graphs run eagerly: no AOT trace, no C++ compile (the suite stays fast)
    out = capsys.readouterr().out
    assert out[: out.rindex("\n[")] == eager and len(eager) > len("Hello")


def test_compile_flag_with_mtp_decodes_the_same_tokens(checkpoint, capsys):
    """--compile with --mtp: the compiled verify and draft steps stream the plain greedy text."""
    plain = ["generate", "--model", checkpoint, "--prompt", "Hello", "--max-new-tokens", "6"]
    assert main(plain) == 0
    out = capsys.readouterr().out
    eager = out[: out.rindex("\n[")]
    assert main(plain + ["--mtp", "2", "--compile", "eager"]) == 0
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


# ---------------------------------------------------------------------------------------- the command line at its edges
@pytest.fixture(scope="module")
def checkpoint_edges(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen-edges") / "ckpt"
    tiny_model(vocab_size=VOCAB_SIZE + 63, num_nextn_predict_layers=1).save_pretrained(path)
    return str(path)


def text(checkpoint_edges, capsys, *flags) -> str:
    """The CLI's output for --prompt Hi and `flags`."""
    assert main(["generate", "--model", checkpoint_edges, "--prompt", "Hi", *flags]) == 0
    return capsys.readouterr().out


def streamed(out: str) -> str:
    return out[: out.rindex("\n[")]


def test_streamed_text_is_the_greedy_continuation(checkpoint_edges, capsys):
    """Prompt, then the decoded greedy tokens (from generate on the same checkpoint), a newline and the speed line."""
    model = Glm53ForCausalLM.from_pretrained(checkpoint_edges).eval()
    ids = encode("Hi")[None]
    new = model.generate(ids, max_new_tokens=12)[0, ids.shape[1] :].tolist()
    want = "Hi" + cli._Codec(checkpoint_edges, "bytes").decode(new)
    out = text(checkpoint_edges, capsys, "--max-new-tokens", "12")
    assert out.startswith(want + "\n[12 new tokens in ") and len(want) > 2


def test_default_is_64_greedy_tokens(checkpoint_edges, capsys):
    out = text(checkpoint_edges, capsys)
    assert "\n[64 new tokens in " in out
    assert streamed(out) == streamed(text(checkpoint_edges, capsys, "--max-new-tokens", "64", "--temperature", "0"))


def test_seed_top_k_and_top_p_each_sample(checkpoint_edges, capsys):
    """--top-k or --top-p alone samples (temperature 1), reproducibly per --seed; --top-k 1 is greedy."""
    greedy = streamed(text(checkpoint_edges, capsys, "--max-new-tokens", "12"))
    k50 = [
        streamed(text(checkpoint_edges, capsys, "--max-new-tokens", "12", "--top-k", "50", "--seed", s)) for s in "334"
    ]
    assert k50[0] == k50[1] != k50[2] and greedy not in k50
    top1 = text(
        checkpoint_edges, capsys, "--max-new-tokens", "12", "--top-k", "1", "--temperature", "1.5", "--seed", "5"
    )
    assert streamed(top1) == greedy
    p = [
        streamed(text(checkpoint_edges, capsys, "--max-new-tokens", "12", "--top-p", "0.95", "--seed", s)) for s in "77"
    ]
    assert p[0] == p[1] != greedy


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--max-new-tokens", "0"),
        ("--top-p", "1"),
        ("--top-k", "1"),
        ("--temperature", "0"),
        ("--mtp", "1"),
        ("--seed", "0"),
    ],
)
def test_numbers_at_their_limits_are_accepted(checkpoint_edges, capsys, flag, value):
    new = "0" if flag == "--max-new-tokens" else "2"
    out = text(checkpoint_edges, capsys, "--max-new-tokens", new, flag, value)
    assert f"\n[{new} new tokens in " in out


def test_mtp_drafts_k_tokens_per_verify_forward(checkpoint_edges, capsys):
    out = text(checkpoint_edges, capsys, "--max-new-tokens", "8", "--mtp", "3")
    tail = out[out.rindex("[MTP") :]
    drafted = int(tail.split("/")[1].split(" ")[0])
    forwards = int(tail.split("drafts), ")[1].split(" ")[0])
    assert forwards > 0 and drafted == 3 * forwards


def test_empty_prompt_is_an_error(checkpoint_edges):
    with pytest.raises(SystemExit, match="no tokens"):
        main(["generate", "--model", checkpoint_edges, "--prompt", ""])


def test_streamer_holds_back_an_incomplete_character():
    """'é' arrives as two byte tokens: nothing is printed after the first, 'é' after the second; ids past the byte
    range print nothing."""
    codec = cli._Codec("unused", "bytes")
    out = io.StringIO()
    streamer = cli._TextStreamer(codec, out)
    streamer.put(encode("prompt"))
    first, second = (torch.tensor([b + BYTE_OFFSET]) for b in "é".encode())
    streamer.put(first)
    assert out.getvalue() == ""
    streamer.put(second)
    assert out.getvalue() == "é"
    streamer.put(torch.tensor([VOCAB_SIZE, VOCAB_SIZE + 5]))
    streamer.put(encode("!"))
    streamer.end()
    assert out.getvalue() == "é!\n"
    assert codec.decode([ord("H") + BYTE_OFFSET, VOCAB_SIZE, ord("i") + BYTE_OFFSET]) == "Hi"


@pytest.mark.parametrize(
    "flags,compile_kw", [([], None), (["--compile"], True), (["--compile", "aot_eager"], "aot_eager")]
)
def test_what_reaches_generate(checkpoint_edges, capsys, monkeypatch, flags, compile_kw):
    """The options handed to generate, and the speed line reporting generate's count (fewer than asked: an EOS)."""
    seen = {}

    def fake(model, ids, mask, **kwargs):
        seen.update(kwargs)
        return ids, GenerationStats(new_tokens=3, prefill_seconds=0.5, decode_seconds=1.0)

    monkeypatch.setattr(cli, "generate", fake)
    out = text(checkpoint_edges, capsys, "--max-new-tokens", "6", *flags)
    assert seen.get("compile") == compile_kw and seen["max_new_tokens"] == 6 and "do_sample" not in seen
    assert "[3 new tokens in 1.50 s" in out and "decode 3.0 tok/s" in out


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--temperature", "0", "--top-p", "0.9"], "--temperature 0 is greedy decoding, which ignores --top-p"),
        (["--temperature", "0", "--top-k", "5"], "--temperature 0 is greedy decoding, which ignores --top-k"),
        (["--mtp", "2", "--temperature", "0.7"], "--mtp decodes greedily .*: drop --temperature"),
        (["--mtp", "2", "--top-p", "0.9"], "--mtp decodes greedily .*: drop --top-p"),
    ],
)
def test_contradicting_decoding_options_are_usage_errors(checkpoint_edges, capsys, flags, said):
    """`--temperature 0 --top-p 0.9` sampled at temperature 1 although the help says 0 is greedy, and `--mtp` with a
    temperature decoded greedily without a word: both are now usage errors (exit 2) naming the flags, decoding
    nothing."""
    import re

    assert main(["generate", "--model", checkpoint_edges, "--prompt", "Hi", *flags]) == 2
    captured = capsys.readouterr()
    assert re.search(said, captured.err) and captured.out == ""


def test_a_prompt_that_is_not_utf8_is_one_line(checkpoint_edges, capsys):
    """Undecodable argv bytes arrive as lone surrogates (surrogateescape): one line, no traceback."""
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")
    assert main(["generate", "--model", checkpoint_edges, "--prompt", prompt]) == 2
    assert "--prompt is not valid UTF-8 text" in capsys.readouterr().err
