"""`python -m glm53 train`: train a preset on the built-in byte-level corpus, save and resume checkpoints.

    python -m glm53 train --preset tiny --steps 120 --seed 0 --save runs/tiny
    python -m glm53 train --resume runs/tiny --steps 200            # continues at step 121
    torchrun --nproc-per-node 4 -m glm53 train --dp 2 --tp 2 ...     # through glm53.parallel

Every step: forward with labels (lm + MTP + router balance + indexer KL losses, see model.py), backward,
gradient clipping, AdamW, then the aux-loss-free router bias update from the step's expert loads.
`--save DIR` writes the final checkpoint to DIR and, with `--save-every N`, intermediate ones to DIR/step-N.
A checkpoint directory holds the model in the official layout (`config.json` + `model.safetensors`, MTP layers
included, written by save_pretrained) and `trainer_state.pt` (step, optimizer, data and torch RNG states; read
with weights_only=True).
Under torchrun the ranks form a (dp, tp) DeviceMesh, rank = dp_rank * tp + tp_rank; each dp rank draws its own
batches (tp ranks of one dp group read the same ones), the loss is computed under loss_parallel_context, the
expert loads are summed over dp ranks before the bias update, and checkpoints hold full tensors (optimizer
state keyed by parameter name, every rank's RNG states), so a run resumes on the same --dp x --tp layout.
This module holds no collectives: glm53.parallel (parallelize, runtime) does the distributed work.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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

VOCAB_MULTIPLE = 64  # the byte vocabulary rounded up so it splits evenly over --tp 2, 4, 8 (rows never used)
PRESETS: dict[str, Callable[[], Glm53Config]] = {
    # Every training feature on: one MTP layer, indexer KL (dense warm-up), balance loss (default coefficient).
    "tiny": lambda: Glm53Config.tiny(vocab_size=-(-VOCAB_SIZE // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
                                     num_nextn_predict_layers=1, indexer_loss_weight=1.0),
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


def save_run(model: Glm53ForCausalLM, path: str, trainer_state: dict, par=None) -> None:
    """Write the official layout (atomic, via save_pretrained) and trainer_state.pt beside it.

    Under torchrun (`par` is glm53.parallel.runtime) every rank gathers the sharded parameters and the optimizer
    state to full tensors; rank 0 writes them with every rank's RNG states, then all ranks wait for it.
    """
    if par is None:
        model.save_pretrained(path, overwrite=True)
        torch.save(trainer_state, os.path.join(path, TRAINER_STATE))
        return
    state = par.full_state(model)
    optimizer = par.full_optimizer_state(model, trainer_state["optimizer"])
    trainer_state = {**trainer_state, "optimizer": optimizer, "rank_rng": par.gather_objects(trainer_state["rank_rng"])}
    if par.rank() == 0:
        with torch.device("meta"):
            plain = Glm53ForCausalLM(model.config)
        plain.load_state_dict(state, assign=True)
        plain.save_pretrained(path, overwrite=True)
        torch.save(trainer_state, os.path.join(path, TRAINER_STATE))
    par.barrier()


def load_trainer_state(path: str) -> dict:
    file = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--resume {path}: no {TRAINER_STATE} (was it saved by `glm53 train`?)")
    return torch.load(file, weights_only=True)


def _check_world(args: argparse.Namespace) -> int:
    """Check --dp * --tp against torchrun's WORLD_SIZE; -> the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.dp < 1 or args.tp < 1:
        raise SystemExit(f"--dp and --tp must be >= 1, got --dp {args.dp} --tp {args.tp}")
    if args.dp * args.tp != world:
        n = args.dp * args.tp
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} = {n} processes, but WORLD_SIZE is {world}: launch with "
                         f"`torchrun --nproc-per-node {n} -m glm53 train ...`")  # fmt: skip
    return world


def _parallel_runtime():
    # Imported lazily: glm53.parallel is the only place with torch.distributed.
    try:
        from .parallel import runtime
    except ImportError as e:
        raise SystemExit(f"--dp/--tp need glm53.parallel, which is not available in this install ({e})") from None
    return runtime


def _parallelize(model: Glm53ForCausalLM, mesh, args: argparse.Namespace) -> Glm53ForCausalLM:
    from .parallel import parallelize

    model = parallelize(model, mesh, activation_checkpointing=args.activation_checkpointing)
    if getattr(model, "expert_load_reduce", None) is None:
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
    par = _parallel_runtime() if _check_world(args) > 1 else None
    try:
        return _train(args, par)
    finally:
        torch.set_num_threads(threads)
        if par is not None:
            # Free the parallel model and optimizer while the process group is alive: FSDP/DTensor objects sit in
            # reference cycles, and when the garbage collector only reached them at interpreter exit, after the
            # group was destroyed, gloo's threads aborted the process ("terminate called without an active
            # exception") in about one resumed run in ten.
            gc.collect()
            par.shutdown()


def _train(args: argparse.Namespace, par) -> int:
    """One process, or (`par` = glm53.parallel.runtime) one rank of a torchrun (dp, tp) grid."""
    if args.save_every and not args.save:
        raise SystemExit("--save-every needs --save DIR")
    mesh = par.init_mesh(args.dp, args.tp) if par is not None else None
    rank = par.rank() if par is not None else 0
    dp_rank = par.local_rank(mesh, "dp") if par is not None else 0
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.resume:
        model = Glm53ForCausalLM.from_pretrained(args.resume)
        state = load_trainer_state(args.resume)
        saved = state.get("layout", [1, 1])  # [dp, tp]
        if list(saved) != [args.dp, args.tp]:
            raise SystemExit(f"--resume {args.resume} was saved with --dp {saved[0]} --tp {saved[1]} (its data and "
                             f"RNG states are per rank); resume with the same layout")  # fmt: skip
    else:
        model = Glm53ForCausalLM(PRESETS[args.preset]())
        state = None
    if par is not None:
        model = _parallelize(model, mesh, args)  # TP -> activation checkpointing -> FSDP
    elif args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    # Each data-parallel rank draws its own batches; the TP ranks of one dp group draw the same ones.
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + dp_rank)
    start = 0
    if state is not None:
        if par is None:
            optimizer.load_state_dict(state["optimizer"])
            rng = state
        else:
            par.load_full_optimizer_state(model, optimizer, state["optimizer"])
            rng = state["rank_rng"][rank]
        generator.set_state(rng["data_rng"])
        torch.set_rng_state(rng["torch_rng"])
        start = int(state["step"])
    log = rank == 0
    if log:
        params = sum(p.numel() for p in model.parameters())
        how = f"resuming {args.resume} at step {start}" if state else f"preset {args.preset}, seed {args.seed}"
        layout = f", dp {args.dp} x tp {args.tp}" if par is not None else ""
        print(f"glm53 train: {how}, {params:,} parameters{layout}, {args.steps} steps of {args.batch_size}x"
              f"{args.seq_len} tokens", flush=True)  # fmt: skip
    if start >= args.steps and log:
        print(f"already at step {start} >= --steps {args.steps}; nothing to do", flush=True)
    loss_context = _loss_context(model, par)
    data = batches(encode(corpus_text()), args.batch_size, args.seq_len, generator)
    tty = sys.stderr.isatty()
    began, tokens = time.perf_counter(), 0
    for step in range(start + 1, args.steps + 1):
        ids = next(data)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        optimizer.zero_grad(set_to_none=True)
        with loss_context():  # the vocab-parallel cross-entropy under TP (forward and backward)
            out = model(ids, labels=ids)
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        model.update_router_bias(args.bias_rate)  # loads summed over dp ranks by model.expert_load_reduce
        tokens += ids.numel() * args.dp
        rate = tokens / (time.perf_counter() - began)
        loss_value = out.loss if par is None else par.mean_over(out.loss, mesh, "dp")
        loss = loss_value.item()  # NOTE: syncs
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
            trainer_state = _trainer_state(step, optimizer, generator, par, (args.dp, args.tp))
            save_run(model, os.path.join(args.save, f"step-{step}"), trainer_state, par)
    if args.save:
        trainer_state = _trainer_state(max(start, args.steps), optimizer, generator, par, (args.dp, args.tp))
        save_run(model, args.save, trainer_state, par)
        if log:
            print(f"saved {args.save} (official layout + {TRAINER_STATE})", flush=True)
    return 0


def _loss_context(model: Glm53ForCausalLM, par) -> Callable[[], contextlib.AbstractContextManager]:
    if par is None:
        return contextlib.nullcontext
    from .parallel import loss_parallel_context

    return lambda: loss_parallel_context(model)


def _trainer_state(step: int, optimizer: torch.optim.Optimizer, generator: torch.Generator, par,
                   layout: tuple[int, int]) -> dict:  # fmt: skip
    """Single process: the optimizer's state dict and the RNG states. Distributed: the optimizer itself (save_run
    gathers its full state) and this rank's RNG states (gathered from every rank into `rank_rng`)."""
    rng = {"data_rng": generator.get_state(), "torch_rng": torch.get_rng_state()}
    if par is None:
        return {"step": step, "optimizer": optimizer.state_dict(), **rng}
    return {"step": step, "optimizer": optimizer, "rank_rng": rng, "layout": list(layout)}
