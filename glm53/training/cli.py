"""`python -m glm53 train`: the command line of the trainer (trainer.py does the work).

python -m glm53 train --preset tiny --steps 120 --seed 0 --save runs/tiny
python -m glm53 train --resume runs/tiny --steps 200            # continues at step 121
torchrun --nproc-per-node 4 -m glm53 train --dp 2 --tp 2 ...     # through glm53.parallel
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

from .. import parallel
from ..errors import Glm53Error
from ..model.compile import BACKENDS
from ..peft import cli as peft_cli
from . import finetune, runconfig, vl_finetune
from .args import (
    add_run_arguments,
    add_schedule_arguments,
    non_negative_float,
    non_negative_int,
    nonempty_path,
    positive_float,
    positive_int,
    seed_int,
    sequence_length,
    thread_count,
    writable_target,
)
from .metrics import METRICS
from .trainer import PRESETS, Interrupted, Trainer

# Errors that mean "fix your input", reported as one line with exit status 1 (argparse's own are status 2).
USER_ERRORS = (Glm53Error, OSError)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model preset (ignored with --resume)")
    p.add_argument("--steps", type=positive_int, default=120, help="train until this step (counting resumed steps)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step and data-parallel rank")
    p.add_argument("--seq-len", type=sequence_length, default=64, help="tokens per row (>= 2: one next-token target)")
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--bias-rate", type=non_negative_float, default=1e-3, help="aux-loss-free router bias update rate")
    p.add_argument("--log-every", type=positive_int, default=10)
    p.add_argument(
        "--save",
        type=nonempty_path,
        help="run directory: the final checkpoint, run.toml, metrics.jsonl (default with --resume: the "
        "resumed directory)",
    )
    p.add_argument(
        "--save-every", type=non_negative_int, default=0, help="also save every N steps to DIR/step-N (needs --save)"
    )
    p.add_argument(
        "--resume",
        type=nonempty_path,
        help="checkpoint directory to continue from (model, optimizer, schedule, step; its run.toml)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="let --save replace a checkpoint already in DIR (not needed when DIR is also --resume)",
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        choices=BACKENDS,
        metavar="BACKEND",
        help="torch.compile every block (glm53.model.compile.compile_blocks; parallel runs too); "
        "BACKEND defaults to inductor, aot_eager only traces",
    )
    p.add_argument(
        "--threads",
        type=thread_count,
        default=1,
        help="CPU intra-op threads (tiny models run fastest on 1: thread hand-offs cost more than the ops)",
    )
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel degree (torchrun)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (torchrun)")
    p.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="expert-parallel degree (torchrun): routed experts over ep ranks, each reading its own batches",
    )
    p.add_argument(
        "--cp",
        type=positive_int,
        default=1,
        help="context-parallel degree (torchrun): every rank one slice of each sequence",
    )
    finetune.add_arguments(p)  # --init, --data, --tokenizer, --grad-accum
    peft_cli.add_lora_arguments(p)  # --lora-rank/-alpha/-dropout/-targets, --base-dtype, --freeze, --export-merged
    vl_finetune.add_arguments(p)  # --media-root, --strict, image/video budgets (--freeze: peft_cli's, also VL groups)
    # torchrun runs (glm53/training/distributed.py): GPUs, bf16, DCP checkpoints; --init reads only each rank's shards
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one process on the current GPU, or under torchrun nccl with one GPU per rank",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 compute, fp32 master weights and optimizer state (one process: autocast; torchrun "
        "--dp, --cp or --ep > 1: FSDP2's bf16 policy)",
    )
    p.add_argument(
        "--no-export",
        action="store_true",
        help="torchrun --save: write only the DCP training state (no official-layout copy)",
    )
    add_schedule_arguments(p)
    add_run_arguments(p)


def _check_world(args: argparse.Namespace) -> int:
    """Check --dp * --cp * --ep * --tp against torchrun's WORLD_SIZE; -> the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dims = dict(dp=args.dp, cp=args.cp, ep=args.ep, tp=args.tp)
    if min(dims.values()) < 1:
        given = " ".join(f"--{k} {v}" for k, v in dims.items())
        raise SystemExit(f"--dp, --cp, --ep and --tp must be >= 1, got {given}")
    n = args.dp * args.cp * args.ep * args.tp
    if n != world:
        product = " x ".join(f"--{k} {v}" for k, v in dims.items())
        raise SystemExit(
            f"{product} = {n} processes, but WORLD_SIZE is {world}: launch with "
            f"`torchrun --nproc-per-node {n} -m glm53 train ...`"
        )
    return world


CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "trainer_state.pt",
    "train_state",
    runconfig.RUN_CONFIG,
    METRICS,
)


def _checkpoint_in(path: str) -> str | None:
    """The first file of a checkpoint (official layout, trainer state or DCP state) found directly in `path`."""
    if not os.path.isdir(path):
        return None
    return next((name for name in CHECKPOINT_FILES if os.path.lexists(os.path.join(path, name))), None)


def _same_dir(a: str, b: str | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def resolve(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace) -> argparse.Namespace:
    """Apply --config and a resumed run's run.toml (runconfig.py); errors exit with one line, status 2."""
    try:
        args, notes = runconfig.resolve(parser, argv, args)
    except runconfig.RunConfigError as e:
        parser.error(str(e))
    args.config_notes = notes
    args.train_parser = parser
    return args


def _check_paths(args: argparse.Namespace) -> None:
    if args.resume and not args.save:
        args.save = args.resume  # continue into the resumed directory (said in the log)
        args.save_from_resume = True
    if args.save_every and not args.save:
        raise SystemExit("--save-every needs --save DIR")
    if args.keep_last and not args.save_every:
        raise SystemExit("--keep-last needs --save-every N (it prunes DIR/step-N checkpoints)")
    if args.tensorboard and not args.save:
        raise SystemExit("--tensorboard needs --save DIR (events go to DIR/tensorboard)")
    if args.eval_every and not args.eval_data:
        raise SystemExit("--eval-every needs --eval-data FILE")
    if args.save and os.path.lexists(args.save) and not os.path.isdir(args.save):
        # Checked before training: the save at the end would refuse to replace a file anyway.
        raise SystemExit(f"glm53 train: error: --save {args.save} exists and is not a directory")
    if args.save and (why := writable_target("--save", args.save)):
        raise SystemExit(f"glm53 train: error: {why}")
    found = _checkpoint_in(args.save) if args.save and not args.overwrite else None
    if found and not _same_dir(args.save, args.resume):
        # A fresh run must not silently replace another run's trained weights.
        raise SystemExit(
            f"glm53 train: error: --save {args.save} already holds a checkpoint ({found}): continue it "
            "with --resume on the same directory, or pass --overwrite to replace it"
        )


def _check_experts(args: argparse.Namespace) -> None:
    """--ep must divide the routed experts: checked before any process group exists, said by rank 0 only."""
    from ..config import Glm53Config

    source = args.resume or args.init
    try:
        config = Glm53Config.from_pretrained(source) if source else PRESETS[args.preset]()
    except USER_ERRORS:
        return  # the trainer reports an unreadable checkpoint itself
    experts = config.n_routed_experts
    if experts % args.ep:
        if os.environ.get("RANK", "0") != "0":
            raise SystemExit(1)
        raise SystemExit(
            f"glm53 train: error: --ep {args.ep} does not divide the {experts} routed experts "
            f"(n_routed_experts of {source or 'preset ' + args.preset}); use an --ep that divides "
            f"{experts}"
        )


def train(args: argparse.Namespace) -> int:
    """Run `glm53 train` with parsed `args`: one process, or one rank of a torchrun (dp, tp) grid."""
    if not hasattr(args, "config_notes"):  # called without resolve() (tests, scripts): flags only
        args.config_notes, args.train_parser = [], None
    _check_paths(args)
    finetune.check_args(args)
    world = _check_world(args)
    if args.no_export and world == 1:
        raise SystemExit("--no-export is a torchrun option (run with --dp/--tp under torchrun)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to torch here")
    if args.bf16 and world > 1 and args.dp * args.cp * args.ep == 1:  # FSDP runs over dp x cp x ep (mesh.py)
        raise SystemExit(
            "--bf16 under torchrun is FSDP2's mixed precision, and a --tp-only layout has no FSDP: add --dp, --cp "
            "or --ep > 1"
        )
    if world > 1 and args.ep > 1:
        _check_experts(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    par = parallel.runtime if world > 1 else None
    try:
        return Trainer(args, par).run()
    except Interrupted as e:
        print(f"glm53 train: {e}", file=sys.stderr, flush=True)
        return e.status
    except KeyboardInterrupt:  # a second Ctrl-C while saving, or one before the loop began
        print("glm53 train: interrupted; nothing more was saved", file=sys.stderr, flush=True)
        return 130
    except USER_ERRORS as e:
        # Bad input (a checkpoint, a config, a file in the way, a full disk) is the user's to fix: one line.
        print(f"glm53 train: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        torch.set_num_threads(threads)
        if par is not None:
            # FSDP/DTensor objects sit in reference cycles: collect them while the process group is alive, or
            # gloo's threads can abort the process at exit.
            gc.collect()
            par.shutdown()


__all__ = ["add_arguments", "resolve", "train"]
