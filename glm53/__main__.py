"""Command line: `python -m glm53 train` (the main job: glm53/training/), `python -m glm53 generate`
(glm53/generation/cli.py)."""

from __future__ import annotations

import argparse
import sys

from .generation import cli as generate_cli
from .training import cli as train_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm53")
    sub = parser.add_subparsers(dest="command", required=True)
    p = train_parser = sub.add_parser(
        "train", help="train a preset on the built-in corpus; save/resume official checkpoints"
    )
    train_cli.add_arguments(p)
    p.set_defaults(func=train_cli.train)
    p = sub.add_parser("generate", help="stream a continuation of --prompt from a checkpoint, then tokens/s")
    generate_cli.add_arguments(p)
    p.set_defaults(func=generate_cli.run)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.command == "train":  # --config and the resumed run's run.toml (training/runconfig.py)
        args = train_cli.resolve(train_parser, argv[1:], args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
