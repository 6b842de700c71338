"""`python -m glm53 generate --model DIR --prompt TEXT`: stream a continuation, then report tokens/s.

Legend: B prompts, T tokens.
`--prompts FILE` generates for a batch of prompts (one per line, or a .jsonl file of {"prompt": ...} objects or
JSON strings), left-padded into one batch, and prints each continuation after a `### i` header. `--chat` wraps
every prompt as a user message in the tokenizer's chat template (with the assistant's generation prompt).
`--device` places the model (cpu, cuda, cuda:1, ...).
The tokenizer is a transformers tokenizer directory (`--tokenizer DIR`, else the model directory when it holds
one) or the built-in byte codec of the training presets (`--tokenizer bytes`, the fallback when the model
directory has no tokenizer files). Greedy by default; `--temperature T` > 0 or `--top-p P` < 1 samples with
`--seed S`. `--mtp K` decodes greedily with K MTP draft tokens per step and prints the acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from ..errors import Glm53Error
from ..losses import Glm53ForCausalLM
from ..peft import cli as peft_cli
from ..training import data as byte_codec
from ..training import vl_prompt
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


def _prompts_file(path: str) -> list[str]:
    """--prompts FILE -> the prompts: one per line, or per .jsonl line a {"prompt": str} object or a JSON string."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e}") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise argparse.ArgumentTypeError(f"{path} line {number}: not JSON ({e.msg})") from None
            record = record.get("prompt") if isinstance(record, dict) else record
            if not isinstance(record, str):
                raise argparse.ArgumentTypeError(
                    f"{path} line {number}: expected a JSON string or an object with a string 'prompt'"
                )
            line = record
        prompts.append(line)
    if not prompts:
        raise argparse.ArgumentTypeError(f"{path} holds no prompt")
    return prompts


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (cpu, cuda, cuda:1, ...)") from None
    if device.type == "meta" or (device.type != "cpu" and not getattr(torch, device.type).is_available()):
        raise argparse.ArgumentTypeError(f"device {text!r} is not available here")
    return device


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=existing_dir, help="an official-layout checkpoint directory")
    peft_cli.add_generate_arguments(p)  # --adapter DIR
    p.add_argument(
        "--tokenizer",
        default=None,
        type=_tokenizer,
        help="a transformers tokenizer directory or 'bytes' "
        "(default: the model directory if it holds a tokenizer, else the built-in byte codec)",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument(
        "--prompts",
        type=_prompts_file,
        metavar="FILE",
        help='a batch of prompts: one per line, or .jsonl lines of {"prompt": ...} or strings',
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the tokenizer's chat template (with the generation prompt)",
    )
    p.add_argument("--device", type=_device, default=torch.device("cpu"), help="where the model runs (default cpu)")
    p.add_argument("--max-new-tokens", type=_int_at_least(0), default=64)
    p.add_argument(
        "--temperature",
        type=_float_in(0.0, math.inf, False),
        default=None,
        help="0 = greedy (the default, unless --top-p/--top-k sample at temperature 1); > 0 samples",
    )
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, True), default=None)
    p.add_argument("--top-k", type=_int_at_least(1), default=None)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument(
        "--mtp",
        type=_int_at_least(1),
        default=None,
        metavar="K",
        help="greedy MTP speculative decoding with K draft tokens per step",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        choices=("inductor", "aot_eager", "eager"),
        help="run every step after the prefill as torch.compile of the same forward (generation/step.py; "
        "the first step compiles, which counts in the decode time printed); aot_eager and eager are "
        "torch.compile's backends without code generation (traced graphs run by ATen: for checking, not speed)",
    )
    vl_prompt.add_arguments(p)  # --image, --video, --video-fps: a vision-language --model


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

    def chat(self, text: str) -> str:
        """The prompt as a user message in the tokenizer's chat template, ready for the assistant's reply."""
        if self.hf is None or not getattr(self.hf, "chat_template", None):
            raise Glm53Error(
                "--chat needs a tokenizer with a chat template (the byte codec and this tokenizer have none)"
            )
        try:
            return self.hf.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # a template is user code (jinja): any failure is reported naming the flag
            raise Glm53Error(f"--chat: the tokenizer's chat template failed ({type(e).__name__}: {e})") from None

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


def _check_options(args: argparse.Namespace) -> str | None:
    """-> the usage error of option combinations that would silently do something else, else None."""
    sampling = [f for f, v in (("--top-p", args.top_p), ("--top-k", args.top_k)) if v is not None]
    if args.temperature == 0 and sampling:  # said explicitly (the default is None)
        return f"--temperature 0 is greedy decoding, which ignores {' and '.join(sampling)}: give --temperature > 0"
    if args.mtp is not None and ((args.temperature or 0) > 0 or sampling):
        flags = (["--temperature"] if (args.temperature or 0) > 0 else []) + sampling
        return f"--mtp decodes greedily (speculative decoding is exact for greedy only): drop {', '.join(flags)}"
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as lone surrogates (surrogateescape)
            return "--prompt is not valid UTF-8 text"
    return None


def run(args: argparse.Namespace) -> int:
    if (problem := _check_options(args)) is not None:
        print(f"glm53 generate: error: {problem}", file=sys.stderr, flush=True)
        return 2
    try:
        return _run(args)
    except (Glm53Error, OSError) as e:
        # A checkpoint or tokenizer that cannot be read, a prompt too long for the model: one line, no traceback.
        print(f"glm53 generate: error: {e}", file=sys.stderr, flush=True)
        return 1


def _batch(codec: _Codec, prompts: list[str], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoded prompts, left-padded with `pad` -> (ids [B, T], attention mask [B, T])."""
    rows = [codec.encode(p) for p in prompts]
    for i, row in enumerate(rows):
        if row.numel() == 0:
            raise Glm53Error(f"prompt {i + 1} encodes to no tokens")
    T = max(r.numel() for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, T - row.numel() :], mask[i, T - row.numel() :] = row, 1
    return ids, mask


def _run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    visual = bool(args.image or args.video)
    if visual:
        model = _vl_model(args).to(args.device)
    else:
        # the adapter is applied on the host, then the model moves to --device (parameters move in place: ties hold)
        model = peft_cli.with_adapter(args, Glm53ForCausalLM.from_pretrained(args.model)).to(args.device).eval()
    codec = _Codec(args.model, args.tokenizer)
    batch = args.prompts is not None
    if visual and batch:
        raise SystemExit("error: --image/--video take one --prompt (not --prompts)")
    prompts = args.prompts if batch else [args.prompt]
    if not batch and not codec.encode(args.prompt).numel():
        raise SystemExit("error: --prompt encodes to no tokens")
    texts = [codec.chat(p) for p in prompts] if args.chat else prompts
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids, mask = _batch(codec, texts, pad)
    embeds = None
    if visual:  # the media expanded into the prompt, their features spliced once (before the prefill)
        with torch.no_grad():
            ids, embeds = vl_prompt.vl_prompt(
                model, args.tokenizer or args.model, texts[0], args.image, args.video, args.video_fps
            )
        mask = torch.ones_like(ids)
    sample = (args.temperature or 0) > 0 or args.top_p is not None or args.top_k is not None
    options = dict(max_new_tokens=args.max_new_tokens, return_stats=True)
    if not batch:
        print(texts[0], end="", flush=True)
        options.update(streamer=_TextStreamer(codec))
    if args.mtp is not None:
        options.update(speculative="mtp", num_speculative_tokens=args.mtp)
    elif sample:
        options.update(
            do_sample=True,
            temperature=args.temperature or 1.0,
            top_p=args.top_p,
            top_k=args.top_k,
            generator=torch.Generator(args.device).manual_seed(args.seed),
        )
    if args.compile is not None:
        options.update(compile=True if args.compile == "inductor" else args.compile)
    if embeds is not None:
        options.update(inputs_embeds=embeds.to(args.device))
    out, stats = generate(model, ids.to(args.device), mask.to(args.device), **options)
    if batch:
        for i, row in enumerate(out[:, ids.shape[1] :].tolist()):
            print(f"### {i + 1}\n{texts[i]}{codec.decode(row)}", flush=True)
    total = stats.prefill_seconds + stats.decode_seconds
    prefill_rate = ids.numel() / max(stats.prefill_seconds, 1e-9)
    print(
        f"[{stats.new_tokens} new tokens in {total:.2f} s: prefill {prefill_rate:,.1f} tok/s, decode "
        f"{stats.decode_tokens_per_second:,.1f} tok/s]"
    )
    if args.mtp is not None:
        print(
            f"[MTP acceptance rate {stats.acceptance_rate:.3f} ({stats.accepted}/{stats.drafted} drafts), "
            f"{stats.verify_forwards} verify forwards]"
        )
    return 0


def _vl_model(args: argparse.Namespace):
    """The vision-language model of --model (--image / --video need one; --mtp with media is not supported)."""
    from ..config import Glm53Config
    from ..vision.config import has_vision
    from ..vision.model import Glm53ForConditionalGeneration

    if args.mtp is not None:
        raise SystemExit("error: --mtp with --image/--video is not supported (the draft would need the spliced prompt)")
    if args.tokenizer == "bytes":
        raise SystemExit("error: --image/--video need the model's tokenizer (with the image tokens), not 'bytes'")
    if not has_vision(Glm53Config.from_pretrained(args.model)):
        raise SystemExit(
            f"error: --image/--video need a vision-language --model; {args.model} is text-only (its "
            f"config.json has no vision_config)"
        )
    return Glm53ForConditionalGeneration.from_pretrained(args.model).eval()


__all__ = ["add_arguments", "run"]
