"""The training loop behind `python -m glm53 train` (cli.py): setup, resume, step, log, save.

Every step: forward with labels (lm + MTP + router balance + indexer KL losses, glm53/model/model.py), backward,
gradient clipping, AdamW, then the aux-loss-free router bias update from the step's expert loads.
`--save DIR` writes the final checkpoint to DIR and, with `--save-every N`, intermediate ones to DIR/step-N
(state.py). Under torchrun the ranks form a (dp, tp) DeviceMesh, rank = dp_rank * tp + tp_rank; each dp rank
draws its own batches (tp ranks of one dp group read the same ones), the loss is computed under
loss_parallel_context, the expert loads are summed over dp ranks before the bias update, and checkpoints hold
full tensors, so a run resumes on the same --dp x --tp layout. This module holds no collectives: glm53.parallel
(parallelize, runtime) does the distributed work.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from ..config import Glm53Config
from ..model.model import Glm53ForCausalLM
from ..parallel import loss_parallel_context, parallelize
from ..utils import ceil_div
from .data import VOCAB_SIZE, batches, corpus_text, encode
from .state import TRAINER_STATE, load_trainer_state, restore_optimizer, save_run, trainer_state

GRAD_CLIP = 1.0  # max global gradient norm
BETAS = (0.9, 0.95)  # AdamW betas (DeepSeek-V3's)
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.05  # linear warm-up over this share of --steps, then cosine decay
MIN_LR_FRACTION = 0.1  # the cosine ends at this fraction of --lr
BAR_WIDTH = 24

VOCAB_MULTIPLE = 64  # the byte vocabulary rounded up so it splits evenly over --tp 2, 4, 8 (rows never used)
PRESETS: dict[str, Callable[[], Glm53Config]] = {
    # Every training feature on: one MTP layer, indexer KL (dense warm-up), balance loss (default coefficient).
    "tiny": lambda: Glm53Config.tiny(vocab_size=ceil_div(VOCAB_SIZE, VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
                                     num_nextn_predict_layers=1, indexer_loss_weight=1.0),
}


def lr_at(step: int, total: int, peak: float) -> float:
    """Learning rate of 1-based `step`: linear warm-up, then cosine to MIN_LR_FRACTION * peak."""
    warmup = max(1, int(WARMUP_FRACTION * total))
    if step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


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


class Trainer:
    """One process, or (`par` = glm53.parallel.runtime) one rank of a torchrun (dp, tp) grid."""

    def __init__(self, args: argparse.Namespace, par=None) -> None:
        self.args, self.par = args, par
        self.mesh = par.init_mesh(args.dp, args.tp) if par is not None else None
        self.rank = par.rank() if par is not None else 0
        self.log_rank = self.rank == 0
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        self.state = self._load_resume_state()
        self.model = self._build_model()
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        # Each data-parallel rank draws its own batches; the TP ranks of one dp group draw the same ones.
        dp_rank = par.local_rank(self.mesh, "dp") if par is not None else 0
        self.generator = torch.Generator().manual_seed(args.seed * 1_000_003 + dp_rank)
        self.start = self._resume()

    # ------------------------------------------------------------------------------------------------ setup
    def _load_resume_state(self) -> dict | None:
        args = self.args
        if not args.resume:
            return None
        state = load_trainer_state(args.resume)
        saved = state.get("layout", [1, 1])  # [dp, tp]
        if list(saved) != [args.dp, args.tp]:
            raise SystemExit(f"--resume {args.resume} was saved with --dp {saved[0]} --tp {saved[1]} (its data and "
                             f"RNG states are per rank); resume with the same layout")  # fmt: skip
        return state

    def _build_model(self) -> Glm53ForCausalLM:
        args = self.args
        if args.resume:
            model = Glm53ForCausalLM.from_pretrained(args.resume)
        else:
            model = Glm53ForCausalLM(PRESETS[args.preset]())
        if self.par is not None:
            model = parallelize(model, self.mesh, activation_checkpointing=args.activation_checkpointing)
        elif args.activation_checkpointing:
            model.gradient_checkpointing_enable()
        return model

    def _resume(self) -> int:
        """Restore the optimizer and RNG states of a resumed run; -> the step it stopped at (0 when fresh)."""
        if self.state is None:
            return 0
        if self.par is None:
            restore_optimizer(self.optimizer, self.state["optimizer"], self.args.resume)
            rng = self.state
        else:
            self.par.load_full_optimizer_state(self.model, self.optimizer, self.state["optimizer"])
            rng = self.state["rank_rng"][self.rank]
        self.generator.set_state(rng["data_rng"])
        torch.set_rng_state(rng["torch_rng"])
        return int(self.state["step"])

    # ------------------------------------------------------------------------------------------------- step
    def _loss_context(self) -> contextlib.AbstractContextManager:
        """The vocab-parallel cross-entropy under TP (forward and backward); a no-op otherwise."""
        return loss_parallel_context(self.model) if self.par is not None else contextlib.nullcontext()

    def step(self, step: int, ids: torch.Tensor):
        """One optimizer step on `ids` [B, T] -> the model output (losses)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.args.steps, self.args.lr)
        self.optimizer.zero_grad(set_to_none=True)
        with self._loss_context():
            out = self.model(ids, labels=ids)
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.model.update_router_bias(self.args.bias_rate)  # loads summed over dp ranks by model.expert_load_reduce
        return out

    # -------------------------------------------------------------------------------------------------- log
    def _announce(self) -> None:
        args = self.args
        params = sum(p.numel() for p in self.model.parameters())
        how = f"resuming {args.resume} at step {self.start}" if self.state else f"preset {args.preset}, seed {args.seed}"
        layout = f", dp {args.dp} x tp {args.tp}" if self.par is not None else ""
        print(f"glm53 train: {how}, {params:,} parameters{layout}, {args.steps} steps of {args.batch_size}x"
              f"{args.seq_len} tokens", flush=True)  # fmt: skip
        if self.start >= args.steps:
            print(f"already at step {self.start} >= --steps {args.steps}; nothing to do", flush=True)

    def _log(self, step: int, out, loss: float, rate: float) -> None:
        args, tty = self.args, sys.stderr.isatty()
        if tty:
            print("\r" + _progress(step, args.steps, loss, rate), end="", file=sys.stderr, flush=True)
        if step % args.log_every == 0 or step == args.steps or step == self.start + 1:
            if tty:
                print(file=sys.stderr)
            else:
                print(_progress(step, args.steps, loss, rate), file=sys.stderr, flush=True)
            print(f"step {step:5d}  loss {loss:.4f}  {_describe(out)}  lr {lr_at(step, args.steps, args.lr):.2e}  "
                  f"{rate:,.0f} tok/s", flush=True)  # fmt: skip

    # ------------------------------------------------------------------------------------------------- save
    def save(self, path: str, step: int) -> None:
        state = trainer_state(step, self.optimizer, self.generator, self.par, (self.args.dp, self.args.tp))
        save_run(self.model, path, state, self.par)

    # -------------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        args, par = self.args, self.par
        if self.log_rank:
            self._announce()
        data = batches(encode(corpus_text()), args.batch_size, args.seq_len, self.generator)
        began, tokens = time.perf_counter(), 0
        for step in range(self.start + 1, args.steps + 1):
            ids = next(data)
            out = self.step(step, ids)
            tokens += ids.numel() * args.dp
            rate = tokens / (time.perf_counter() - began)
            loss_value = out.loss if par is None else par.mean_over(out.loss, self.mesh, "dp")
            loss = loss_value.item()  # NOTE: syncs
            if not math.isfinite(loss):
                raise SystemExit(f"step {step}: loss is {loss}; stopping")
            if self.log_rank:
                self._log(step, out, loss, rate)
            if args.save and args.save_every and step % args.save_every == 0 and step != args.steps:
                self.save(os.path.join(args.save, f"step-{step}"), step)
        if args.save:
            self.save(args.save, max(self.start, args.steps))
            if self.log_rank:
                print(f"saved {args.save} (official layout + {TRAINER_STATE})", flush=True)
        return 0


__all__ = ["Trainer", "PRESETS", "lr_at", "GRAD_CLIP"]
