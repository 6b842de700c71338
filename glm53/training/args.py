"""argparse types for the command lines (train, demo, generate, tools): numbers and paths checked where parsed.

No tensors here. A bad value becomes argparse's usage error (exit status 2, the flag named), never a traceback
or a run with a negative learning rate.
"""

from __future__ import annotations

import argparse
import math
import os


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _at_least(parse, low, inclusive: bool = True):
    """An argparse type: `parse(text)` (a finite int or float), >= low (or > low), else a usage error."""

    def check(text: str):
        value = parse(text)
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low}, got {text}")
        return value

    return check


positive_int = _at_least(_int, 1)
non_negative_int = _at_least(_int, 0)
positive_float = _at_least(_float, 0, inclusive=False)
non_negative_float = _at_least(_float, 0)

# A sequence of one token has no next token to predict: every loss would be empty.
sequence_length = _at_least(_int, 2)


def thread_count(text: str) -> int:
    """An argparse type: CPU threads in [1, this machine's CPU count] (torch crashes on absurd counts)."""
    value, cpus = positive_int(text), os.cpu_count() or 1
    if value > cpus:
        raise argparse.ArgumentTypeError(f"must be <= {cpus} (this machine's CPU count), got {value}")
    return value


def writable_target(flag: str, path: str) -> str | None:
    """Why `path` cannot become a directory written at the end of a run (None if it can): the nearest existing
    ancestor must be a writable directory. Checked before the run, so a bad path costs no training."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{flag} {path}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path}: {parent} is not writable"
    return None


MAX_SEED = 2**32 - 1  # the trainer derives per-rank seeds from it (seed * 1_000_003 + rank): must fit int64


def existing_dir(text: str) -> str:
    """An argparse type: a path that is an existing directory (a checkpoint or tokenizer directory)."""
    if not os.path.isdir(text):
        why = "not a directory" if os.path.exists(text) else "no such directory"
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    return text


def seed_int(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SEED}], got {value}")
    return value


def unit_interval(text: str) -> float:
    """An argparse type: a number in [0, 1) (an Adam beta)."""
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def nonempty_path(text: str) -> str:
    """An argparse type: a path that is not the empty string (an unset shell variable must not mean 'none')."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"empty path {text!r} (an unset variable?)")
    return text


# The train command's flags, added by small groups (each a function of the parser), so a module adds its own
# group in one line; run.toml keys come from the parser (training/runconfig.py), so a new flag is a key too.
def add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("schedule and optimizer (training/optim.py)")
    g.add_argument(
        "--total-steps",
        type=positive_int,
        metavar="N",
        help="length of the lr schedule (default: --steps); --steps only says where this run stops",
    )
    g.add_argument(
        "--warmup",
        type=non_negative_int,
        metavar="N",
        help="linear warm-up steps (default: 5%% of the schedule, at least 1)",
    )
    g.add_argument(
        "--schedule",
        choices=("cosine", "linear", "constant"),
        default="cosine",
        help="decay after the warm-up (torch.optim.lr_scheduler)",
    )
    g.add_argument(
        "--min-lr", type=non_negative_float, metavar="LR", help="lr at the end of the schedule (default: 0.1 x --lr)"
    )
    g.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=0.01,
        help="AdamW decay (never on norms, biases, gates, A_log, dt_bias, mHC: optim.NO_DECAY)",
    )
    g.add_argument("--betas", type=unit_interval, nargs=2, default=[0.9, 0.95], metavar=("B1", "B2"))
    g.add_argument(
        "--grad-clip",
        type=non_negative_float,
        default=1.0,
        help="max global gradient norm (0: no clipping; the norm is still logged)",
    )
    g.add_argument(
        "--peak-tflops",
        type=positive_float,
        metavar="TFLOPS",
        help="the device's peak TFLOP/s, for the MFU in the metrics (default: known GPUs only)",
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run configuration, metrics, evaluation (training/runconfig.py, metrics.py)")
    g.add_argument(
        "--config",
        metavar="RUN.toml",
        type=nonempty_path,
        help="TOML file whose keys are these flags (flags given here override it)",
    )
    g.add_argument(
        "--override",
        action="append",
        metavar="KEY",
        default=None,
        help="with --resume: allow KEY (e.g. seed) to differ from the resumed run's run.toml",
    )
    g.add_argument(
        "--keep-last",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="with --save-every: keep only the K newest DIR/step-N checkpoints (0: keep all)",
    )
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to DIR/tensorboard")
    g.add_argument(
        "--eval-data",
        metavar="FILE",
        type=nonempty_path,
        help="held-out data (formats of --data): loss and perplexity every --eval-every steps",
    )
    g.add_argument(
        "--eval-every",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="evaluate every N steps and at the end (default with --eval-data: every --log-every)",
    )
    g.add_argument(
        "--cache-dir",
        metavar="DIR",
        type=nonempty_path,
        help="where tokenized --data is cached (default: DIR/cache of --save, else none)",
    )


__all__ = [
    "add_run_arguments",
    "add_schedule_arguments",
    "existing_dir",
    "non_negative_float",
    "non_negative_int",
    "nonempty_path",
    "positive_float",
    "positive_int",
    "seed_int",
    "sequence_length",
    "thread_count",
    "unit_interval",
    "writable_target",
]
