"""Command line: `python -m glm53 train` (the main job: glm53/training/), `python -m glm53 generate`
(glm53/generation/cli.py) and `python -m glm53 demo`."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .config import Glm53Config
from .errors import Glm53Error
from .generation import cli as generate_cli
from .losses import Glm53ForCausalLM
from .training import cli as train_cli
from .training.args import positive_float, positive_int, seed_int, sequence_length
from .training.data import VOCAB_SIZE, batches, corpus_text, encode


def demo(args: argparse.Namespace) -> int:
    """Build the tiny preset, run a forward and a few AdamW steps on the built-in corpus, print the loss."""
    torch.manual_seed(args.seed)
    config = Glm53Config.tiny(vocab_size=VOCAB_SIZE)
    model = Glm53ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"glm53 demo: tiny preset, {config.num_hidden_layers} layers ({config.layer_types.count('linear_attention')}"
          f" KDA + {len(config.attention_layers)} MLA), {params:,} parameters")  # fmt: skip
    tokens = encode(corpus_text())
    data = batches(tokens, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = next(data)
        loss = model(ids, labels=ids, return_logits=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        rate = step * ids.numel() / (time.perf_counter() - start)
        print(f"step {step:3d}  loss {loss.item():.4f}  {rate:,.0f} tok/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm53")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="forward + a few optimizer steps of the tiny preset on the built-in corpus")
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seq-len", type=sequence_length, default=64)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.set_defaults(func=demo)
    p = sub.add_parser("train", help="train a preset on the built-in corpus; save/resume official checkpoints")
    train_cli.add_arguments(p)
    p.set_defaults(func=train_cli.train)
    p = sub.add_parser("generate", help="stream a continuation of --prompt from a checkpoint, then tokens/s")
    generate_cli.add_arguments(p)
    p.set_defaults(func=generate_cli.run)
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            return demo(args)
        except Glm53Error as e:  # a --seq-len longer than the corpus: one line, no traceback
            print(f"glm53 demo: error: {e}", file=sys.stderr, flush=True)
            return 1
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
