"""Edges of `python -m glm53 generate` (generation/cli.py): the streamed text is exactly the greedy continuation,
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
    path = tmp_path_factory.mktemp("gen-edges") / "ckpt"
    tiny_model(vocab_size=VOCAB_SIZE + 63, num_nextn_predict_layers=1).save_pretrained(path)
    return str(path)


def text(checkpoint, capsys, *flags) -> str:
    """The CLI's output for --prompt Hi and `flags`."""
    assert main(["generate", "--model", checkpoint, "--prompt", "Hi", *flags]) == 0
    return capsys.readouterr().out


def streamed(out: str) -> str:
    return out[: out.rindex("\n[")]


def test_streamed_text_is_the_greedy_continuation(checkpoint, capsys):
    """Prompt, then the decoded greedy tokens (from generate on the same checkpoint), a newline and the speed line."""
    model = Glm53ForCausalLM.from_pretrained(checkpoint).eval()
    ids = encode("Hi")[None]
    new = model.generate(ids, max_new_tokens=12)[0, ids.shape[1] :].tolist()
    want = "Hi" + cli._Codec(checkpoint, "bytes").decode(new)
    out = text(checkpoint, capsys, "--max-new-tokens", "12")
    assert out.startswith(want + "\n[12 new tokens in ") and len(want) > 2


def test_default_is_64_greedy_tokens(checkpoint, capsys):
    out = text(checkpoint, capsys)
    assert "\n[64 new tokens in " in out
    assert streamed(out) == streamed(text(checkpoint, capsys, "--max-new-tokens", "64", "--temperature", "0"))


def test_seed_top_k_and_top_p_each_sample(checkpoint, capsys):
    """--top-k or --top-p alone samples (temperature 1), reproducibly per --seed; --top-k 1 is greedy."""
    greedy = streamed(text(checkpoint, capsys, "--max-new-tokens", "12"))
    k50 = [streamed(text(checkpoint, capsys, "--max-new-tokens", "12", "--top-k", "50", "--seed", s)) for s in "334"]
    assert k50[0] == k50[1] != k50[2] and greedy not in k50
    top1 = text(checkpoint, capsys, "--max-new-tokens", "12", "--top-k", "1", "--temperature", "1.5", "--seed", "5")
    assert streamed(top1) == greedy
    p = [streamed(text(checkpoint, capsys, "--max-new-tokens", "12", "--top-p", "0.95", "--seed", s)) for s in "77"]
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
def test_numbers_at_their_limits_are_accepted(checkpoint, capsys, flag, value):
    new = "0" if flag == "--max-new-tokens" else "2"
    out = text(checkpoint, capsys, "--max-new-tokens", new, flag, value)
    assert f"\n[{new} new tokens in " in out


def test_mtp_drafts_k_tokens_per_verify_forward(checkpoint, capsys):
    out = text(checkpoint, capsys, "--max-new-tokens", "8", "--mtp", "3")
    tail = out[out.rindex("[MTP") :]
    drafted = int(tail.split("/")[1].split(" ")[0])
    forwards = int(tail.split("drafts), ")[1].split(" ")[0])
    assert forwards > 0 and drafted == 3 * forwards


def test_empty_prompt_is_an_error(checkpoint):
    with pytest.raises(SystemExit, match="no tokens"):
        main(["generate", "--model", checkpoint, "--prompt", ""])


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
def test_what_reaches_generate(checkpoint, capsys, monkeypatch, flags, compile_kw):
    """The options handed to generate, and the speed line reporting generate's count (fewer than asked: an EOS)."""
    seen = {}

    def fake(model, ids, mask, **kwargs):
        seen.update(kwargs)
        return ids, GenerationStats(new_tokens=3, prefill_seconds=0.5, decode_seconds=1.0)

    monkeypatch.setattr(cli, "generate", fake)
    out = text(checkpoint, capsys, "--max-new-tokens", "6", *flags)
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
def test_contradicting_decoding_options_are_usage_errors(checkpoint, capsys, flags, said):
    """`--temperature 0 --top-p 0.9` sampled at temperature 1 although the help says 0 is greedy, and `--mtp` with a
    temperature decoded greedily without a word: both are now usage errors (exit 2) naming the flags, decoding
    nothing."""
    import re

    assert main(["generate", "--model", checkpoint, "--prompt", "Hi", *flags]) == 2
    captured = capsys.readouterr()
    assert re.search(said, captured.err) and captured.out == ""


def test_a_prompt_that_is_not_utf8_is_one_line(checkpoint, capsys):
    """Undecodable argv bytes arrive as lone surrogates (surrogateescape): one line, no traceback."""
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")
    assert main(["generate", "--model", checkpoint, "--prompt", prompt]) == 2
    assert "--prompt is not valid UTF-8 text" in capsys.readouterr().err
