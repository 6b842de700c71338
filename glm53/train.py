"""`python -m glm53 train`: train a preset on the built-in byte-level corpus, save and resume checkpoints.

    python -m glm53 train --preset tiny --steps 120 --seed 0 --save runs/tiny
    python -m glm53 train --resume runs/tiny --steps 200            # continues at step 121
    torchrun --nproc-per-node 4 -m glm53 train --dp 2 --tp 2 ...     # through glm53.parallel

Every step: forward with labels (lm + MTP + router balance + indexer KL losses, see model.py), backward,
gradient clipping, AdamW, then the aux-loss-free router bias update from the step's expert loads.
`--save DIR` writes the final checkpoint to DIR and, with `--save-every N`, intermediate ones to DIR/step-N.
A checkpoint directory holds the model in the official layout (`config.json` + `model.safetensors`, MTP layers
included) and `trainer_state.pt` (step, optimizer, data and torch RNG states; read with weights_only=True).
Under torchrun the ranks form a (dp, tp) grid, rank = dp_rank * tp + tp_rank; tp ranks of one dp group read
the same batches. This module holds no collectives: `glm53.parallel.parallelize` does the distributed work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from .config import Glm53Config
from .data import VOCAB_SIZE, batches, corpus_text, encode
from .model import Glm53ForCausalLM

TRAINER_STATE = "trainer_state.pt"
GRAD_CLIP = 1.0  # max global gradient norm
BETAS = (0.9, 0.95)  # AdamW betas (DeepSeek-V3's)
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.05  # linear warm-up over this share of --steps, then cosine decay
MIN_LR_FRACTION = 0.1  # the cosine ends at this fraction of --lr
BAR_WIDTH = 24

PRESETS: dict[str, Callable[[], Glm53Config]] = {
    # Every training feature on: one MTP layer, indexer KL (dense warm-up), balance loss (default coefficient).
    "tiny": lambda: Glm53Config.tiny(vocab_size=VOCAB_SIZE, num_nextn_predict_layers=1, indexer_loss_weight=1.0),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model preset (ignored with --resume)")
    p.add_argument("--steps", type=int, default=120, help="train until this step (counting resumed steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step and data-parallel rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bias-rate", type=float, default=1e-3, help="aux-loss-free router bias update rate")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save", help="directory to write the final checkpoint to")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps to DIR/step-N (needs --save)")
    p.add_argument("--resume", help="checkpoint directory to continue from (model, optimizer, step)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads (tiny models run fastest on 1: thread hand-offs cost more than the ops)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (torchrun)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (torchrun)")


def lr_at(step: int, total: int, peak: float) -> float:
    """Learning rate of 1-based `step`: linear warm-up, then cosine to MIN_LR_FRACTION * peak."""
    warmup = max(1, int(WARMUP_FRACTION * total))
    if step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(model: Glm53ForCausalLM, path: str, trainer_state: dict | None = None, rank: int = 0) -> None:
    """Write the official layout (config.json, model.safetensors) and, given, trainer_state.pt.

    Uses glm53.checkpoint.iter_official_state (main model + MTP layers). Sharded (DTensor) parameters are
    gathered with full_tensor() on every rank; rank 0 writes the model, each rank its own trainer state.
    """
    from safetensors.torch import save_file

    from .checkpoint import SINGLE_FILE, iter_official_state

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for key, tensor in iter_official_state(model):
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensors[key] = tensor.detach().to("cpu").contiguous().clone()  # views share storage: safetensors refuses
    if rank == 0:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(model.config.to_official_dict(), f, indent=2)
    if trainer_state is not None:
        torch.save(trainer_state, os.path.join(path, _state_file(rank)))


def load_trainer_state(path: str, rank: int = 0) -> dict:
    file = os.path.join(path, _state_file(rank))
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--resume {path}: no {os.path.basename(file)} (was it saved by `glm53 train`?)")
    return torch.load(file, weights_only=True)


def _state_file(rank: int) -> str:
    return TRAINER_STATE if rank == 0 else f"trainer_state.rank{rank}.pt"


def _distributed(args: argparse.Namespace) -> tuple[int, int]:
    """-> (rank, dp_rank) from torchrun's environment; checks --dp * --tp against the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.dp < 1 or args.tp < 1:
        raise SystemExit(f"--dp and --tp must be >= 1, got --dp {args.dp} --tp {args.tp}")
    if args.dp * args.tp != world:
        n = args.dp * args.tp
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} = {n} processes, but WORLD_SIZE is {world}: launch with "
                         f"`torchrun --nproc-per-node {n} -m glm53 train ...`")  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))
    return rank, rank // args.tp


def _parallelize(model: Glm53ForCausalLM, args: argparse.Namespace) -> Glm53ForCausalLM:
    # Imported lazily: glm53.parallel is the only place with torch.distributed.
    try:
        from .parallel import parallelize
    except ImportError as e:
        raise SystemExit(f"--dp/--tp need glm53.parallel, which is not available in this install ({e})") from None
    model = parallelize(model, dp=args.dp, tp=args.tp)
    if args.dp > 1 and getattr(model, "expert_load_reduce", None) is None:
        # Without the sum over data-parallel ranks each rank would move its router biases differently.
        raise SystemExit("glm53.parallel.parallelize did not set model.expert_load_reduce (the expert-load all-reduce)")
    return model


def _progress(step: int, total: int, loss: float, rate: float) -> str:
    done = BAR_WIDTH * step // max(total, 1)
    return f"[{'#' * done}{'.' * (BAR_WIDTH - done)}] {step}/{total} loss {loss:.4f} {rate:,.0f} tok/s"


def _describe(out) -> str:
    parts = [f"lm {out.lm_loss.item():.4f}"]
    for name in ("mtp_loss", "aux_loss", "indexer_loss"):
        value = getattr(out, name)
        if value is not None:
            parts.append(f"{name.removesuffix('_loss')} {value.item():.4g}")
    return "  ".join(parts)


def train(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)


def _train(args: argparse.Namespace) -> int:
    rank, dp_rank = _distributed(args)
    if args.save_every and not args.save:
        raise SystemExit("--save-every needs --save DIR")
    torch.manual_seed(args.seed)
    if args.resume:
        model = Glm53ForCausalLM.from_pretrained(args.resume)
        state = load_trainer_state(args.resume, rank)
    else:
        model = Glm53ForCausalLM(PRESETS[args.preset]())
        state = None
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()  # before FSDP wrapping (torchtitan's order: TP, AC, FSDP)
    if args.dp * args.tp > 1:
        model = _parallelize(model, args)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + dp_rank)
    start = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        start = int(state["step"])
    log = rank == 0
    if log:
        params = sum(p.numel() for p in model.parameters())
        how = f"resuming {args.resume} at step {start}" if state else f"preset {args.preset}, seed {args.seed}"
        print(f"glm53 train: {how}, {params:,} parameters, {args.steps} steps of {args.batch_size}x{args.seq_len} "
              f"tokens", flush=True)  # fmt: skip
    if start >= args.steps:
        print(f"already at step {start} >= --steps {args.steps}; nothing to do", flush=True)
    data = batches(encode(corpus_text()), args.batch_size, args.seq_len, generator)
    tty = sys.stderr.isatty()
    began, tokens = time.perf_counter(), 0
    for step in range(start + 1, args.steps + 1):
        ids = next(data)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        out = model(ids, labels=ids)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        model.update_router_bias(args.bias_rate)
        tokens += ids.numel()
        rate = tokens / (time.perf_counter() - began)
        loss = out.loss.item()  # NOTE: syncs
        if not math.isfinite(loss):
            raise SystemExit(f"step {step}: loss is {loss}; stopping")
        logging_step = step % args.log_every == 0 or step == args.steps or step == start + 1
        if log and tty:
            print("\r" + _progress(step, args.steps, loss, rate), end="", file=sys.stderr, flush=True)
        if log and logging_step:
            if tty:
                print(file=sys.stderr)
            else:
                print(_progress(step, args.steps, loss, rate), file=sys.stderr, flush=True)
            print(f"step {step:5d}  loss {loss:.4f}  {_describe(out)}  lr {lr_at(step, args.steps, args.lr):.2e}  "
                  f"{rate:,.0f} tok/s", flush=True)  # fmt: skip
        if args.save and args.save_every and step % args.save_every == 0 and step != args.steps:
            save_checkpoint(model, os.path.join(args.save, f"step-{step}"), _trainer_state(step, optimizer, generator),
                            rank)  # fmt: skip
    if args.save:
        save_checkpoint(model, args.save, _trainer_state(max(start, args.steps), optimizer, generator), rank)
        if log:
            print(f"saved {args.save} (official layout + {TRAINER_STATE})", flush=True)
    return 0


def _trainer_state(step: int, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> dict:
    return {"step": step, "optimizer": optimizer.state_dict(), "data_rng": generator.get_state(),
            "torch_rng": torch.get_rng_state()}  # fmt: skip
