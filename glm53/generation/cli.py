"""`python -m glm53 generate --model DIR --prompt TEXT`: stream a continuation, then report tokens/s.

Legend: T tokens.
The tokenizer is a transformers tokenizer directory (`--tokenizer DIR`, else the model directory when it holds
one) or the built-in byte codec of the training presets (`--tokenizer bytes`, the fallback when the model
directory has no tokenizer files). Greedy by default; `--temperature T` > 0 or `--top-p P` < 1 samples with
`--seed S`. `--mtp K` decodes greedily with K MTP draft tokens per step and prints the acceptance rate.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from ..errors import Glm53Error
from ..model.model import Glm53ForCausalLM
from ..peft import cli as peft_cli
from ..training import data as byte_codec
from ..training.args import existing_dir, seed_int
from .loop import generate

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _float_in(low: float, high: float, low_open: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or not (value > low if low_open else value >= low) or not value <= high:
            raise argparse.ArgumentTypeError(f"must lie in {'(' if low_open else '['}{low}, {high}], got {value}")
        return value

    return parse


def _tokenizer(text: str) -> str:
    return text if text == "bytes" else existing_dir(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=existing_dir, help="an official-layout checkpoint directory")
    peft_cli.add_generate_arguments(p)  # --adapter DIR
    p.add_argument("--tokenizer", default=None, type=_tokenizer, help="a transformers tokenizer directory or 'bytes' "
                   "(default: the model directory if it holds a tokenizer, else the built-in byte codec)")  # fmt: skip
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=_int_at_least(0), default=64)
    p.add_argument("--temperature", type=_float_in(0.0, math.inf, False), default=0.0,
                   help="0 = greedy (default); > 0 samples")  # fmt: skip
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, True), default=None)
    p.add_argument("--top-k", type=_int_at_least(1), default=None)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--mtp", type=_int_at_least(1), default=None, metavar="K",
                   help="greedy MTP speculative decoding with K draft tokens per step")  # fmt: skip
    p.add_argument("--compile", nargs="?", const="inductor", default=None, choices=("inductor", "aot_eager"),
                   help="decode through torch.compile'd graphs (decode_compiled.py; with --mtp the verify and draft "
                        "steps: verify_compiled.py, mtp_compiled.py; the first step compiles, which counts in the "
                        "decode time printed)")  # fmt: skip


class _Codec:
    """encode(text) -> [T] ids and decode(ids) -> text, for a transformers tokenizer or the byte codec."""

    def __init__(self, model_dir: str, tokenizer: str | None) -> None:
        if tokenizer is None:
            has = any(os.path.exists(os.path.join(model_dir, f)) for f in TOKENIZER_FILES)
            tokenizer = model_dir if has else "bytes"
        self.hf = None
        if tokenizer != "bytes" and not any(os.path.exists(os.path.join(tokenizer, f)) for f in TOKENIZER_FILES):
            raise OSError(f"--tokenizer {tokenizer}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})")
        if tokenizer != "bytes":
            from transformers import AutoTokenizer

            try:
                self.hf = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
            except (OSError, ValueError) as e:  # transformers' own errors, re-raised naming the flag
                raise OSError(f"--tokenizer {tokenizer}: cannot load a tokenizer there ({e})") from e

    def encode(self, text: str) -> torch.Tensor:
        if self.hf is None:
            return byte_codec.encode(text)
        return torch.tensor(self.hf(text)["input_ids"], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        if self.hf is None:  # ids past the byte range (a vocabulary padded for tensor parallelism) print nothing
            byte_ids = [i for i in ids if i < byte_codec.VOCAB_SIZE]
            return byte_codec.decode(torch.tensor(byte_ids, dtype=torch.long))
        return self.hf.decode(ids, skip_special_tokens=True)


class _TextStreamer:
    """Prints the text of the new tokens as they come (holding back an incomplete multi-byte character)."""

    def __init__(self, codec: _Codec, out=None) -> None:
        self.codec, self.out = codec, out if out is not None else sys.stdout
        self.ids: list[int] = []
        self.printed = 0
        self.prompt_seen = False

    def put(self, ids: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first put is the prompt
            self.prompt_seen = True
            return
        self.ids.extend(ids.flatten().tolist())
        text = self.codec.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)

    def end(self) -> None:
        text = self.codec.decode(self.ids)
        self.out.write(text[self.printed :] + "\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (Glm53Error, OSError) as e:
        # A checkpoint or tokenizer that cannot be read, a prompt too long for the model: one line, no traceback.
        print(f"glm53 generate: error: {e}", file=sys.stderr, flush=True)
        return 1


def _run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    model = peft_cli.with_adapter(args, Glm53ForCausalLM.from_pretrained(args.model)).eval()
    codec = _Codec(args.model, args.tokenizer)
    ids = codec.encode(args.prompt)[None]
    if ids.shape[1] == 0:
        raise SystemExit("error: --prompt encodes to no tokens")
    sample = args.temperature > 0 or args.top_p is not None or args.top_k is not None
    print(args.prompt, end="", flush=True)
    options = dict(max_new_tokens=args.max_new_tokens, streamer=_TextStreamer(codec), return_stats=True)
    if args.mtp is not None:
        options.update(speculative="mtp", num_speculative_tokens=args.mtp)
    elif sample:
        options.update(do_sample=True, temperature=args.temperature or 1.0, top_p=args.top_p, top_k=args.top_k,
                       generator=torch.Generator().manual_seed(args.seed))  # fmt: skip
    if args.compile is not None:
        options.update(compile=True if args.compile == "inductor" else args.compile)
    _, stats = generate(model, ids, None, **options)
    total = stats.prefill_seconds + stats.decode_seconds
    prefill_rate = ids.shape[1] / max(stats.prefill_seconds, 1e-9)
    print(f"[{stats.new_tokens} new tokens in {total:.2f} s: prefill {prefill_rate:,.1f} tok/s, decode "
          f"{stats.decode_tokens_per_second:,.1f} tok/s]")  # fmt: skip
    if args.mtp is not None:
        print(f"[MTP acceptance rate {stats.acceptance_rate:.3f} ({stats.accepted}/{stats.drafted} drafts), "
              f"{stats.verify_forwards} verify forwards]")  # fmt: skip
    return 0


__all__ = ["add_arguments", "run"]
