"""The training loop behind `python -m glm53 train` (cli.py): setup, resume, step, log, save.

Every step: forward with labels (lm + MTP + router balance + indexer KL losses, glm53/model/model.py) and backward
for each of the --grad-accum micro-batches, every loss part divided by its count over the whole global batch
(losses/counts.py), then gradient clipping, AdamW, and the aux-loss-free router bias update from the step's
expert loads. Data: the built-in byte corpus, or --data FILE packed into rows (finetune.py) from an --init model.
`--save DIR` writes the final checkpoint to DIR and, with `--save-every N`, intermediate ones to DIR/step-N
(state.py). Under torchrun the ranks form a (dp, tp) DeviceMesh, rank = dp_rank * tp + tp_rank; each dp rank
draws its own batches (tp ranks of one dp group read the same ones), the loss is computed under
loss_parallel_context, the expert loads are summed over dp ranks before the bias update, and checkpoints are DCP
shards (every rank its own) plus the official layout, resumable on any --dp x --tp layout or in one process
(state.py, distributed.py). This module holds no collectives: glm53.parallel does the distributed work.
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
from ..model.compile import compile_blocks
from ..losses import Glm53ForCausalLM
from ..parallel import clip_grad_norm_ as parallel_clip_grad_norm_
from ..parallel import loss_parallel_context, parallelize
from ..parallel.run_checkpoint import device_type, has_run_state
from ..peft import cli as peft_cli
from ..utils import ceil_div
from .data import VOCAB_SIZE, batches, corpus_text, encode
from .data.documents import DataError
from . import vl_finetune
from .distributed import forward_inputs, init_parallel_model
from .finetune import FileData, init_model, model_inputs
from .state import TRAINER_STATE, load_trainer_state, restore_optimizer, resume_distributed, save_run, trainer_state

GRAD_CLIP = 1.0  # max global gradient norm
BETAS = (0.9, 0.95)  # AdamW betas (DeepSeek-V3's)
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.05  # linear warm-up over this share of --steps, then cosine decay
MIN_LR_FRACTION = 0.1  # the cosine ends at this fraction of --lr
BAR_WIDTH = 24
LOSS_PARTS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss")

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


def _describe(parts: dict[str, float]) -> str:
    text = [f"lm {parts['lm_loss']:.4f}"]
    for name in ("mtp_loss", "aux_loss", "indexer_loss"):
        if name in parts:
            text.append(f"{name.removesuffix('_loss')} {parts[name]:.4g}")
    return "  ".join(text)


def _layout(args: argparse.Namespace) -> list[int]:
    """The parallel layout saved with a checkpoint: [dp, tp], with ep appended when it exceeds 1."""
    return [args.dp, args.tp] + ([args.ep] if args.ep > 1 else [])


class Trainer:
    """One process, or (`par` = glm53.parallel.runtime) one rank of a torchrun (dp, tp) grid."""

    def __init__(self, args: argparse.Namespace, par=None) -> None:
        self.args, self.par = args, par
        self.mesh = par.init_mesh(args.dp, args.tp, device_type(args.device), ep=args.ep, cp=args.cp) if par is not None else None
        self.device = self.mesh.device_type if par is not None else "cpu"
        self.rank = par.rank() if par is not None else 0
        self.log_rank = self.rank == 0
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        self.state = self._load_resume_state()
        self.vl_record = vl_finetune.first_vl_record(args.data)  # image/video data: the VL model (vl_finetune.py)
        vl_finetune.check_args(args, self.vl_record)
        self.model = self._build_model()
        self.model.train()
        # Frozen parameters (--freeze) get no optimizer state.
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        # Each data-parallel rank draws its own batches; the TP ranks of one dp group draw the same ones.
        # Expert-parallel ranks read their own batches too (data rank = dp_rank * ep + ep_rank).
        self.dp_rank = (par.local_rank(self.mesh, "dp") * args.ep + par.local_rank(self.mesh, "ep")
                        if par is not None else 0)  # fmt: skip
        self.generator = torch.Generator().manual_seed(args.seed * 1_000_003 + self.dp_rank)
        self.start = self._resume()
        self.data = self._file_data(self.dp_rank)

    # ------------------------------------------------------------------------------------------------ setup
    def _load_resume_state(self) -> dict | None:
        args = self.args
        if not args.resume:
            return None
        if (lora := peft_cli.resume_state(args)) is not None:  # a LoRA run: adapter + trainer state
            return lora
        if has_run_state(args.resume):
            return {"dcp": args.resume}  # a torchrun run, any layout (one process too): state.resume_distributed
        state = load_trainer_state(args.resume)
        saved = state.get("layout", [1, 1])  # [dp, tp] (+ [ep] when ep > 1)
        if list(saved) != _layout(args):
            raise SystemExit(f"--resume {args.resume} was saved with layout {list(saved)} ([dp, tp] or [dp, tp, ep]; "
                             f"its data and RNG states are per rank); resume with the same layout")  # fmt: skip
        return state

    def _build_model(self) -> Glm53ForCausalLM:
        args = self.args
        if self.par is not None and self.vl_record is not None:
            vl_finetune.check_vl_checkpoint(args.init or args.resume, self.vl_record)
            model = init_parallel_model(args, self.mesh, PRESETS[args.preset], vl_finetune.vl_model_class())
            vl_finetune.apply_freeze(model, args.freeze)
            return model
        if self.par is not None:
            return init_parallel_model(args, self.mesh, PRESETS[args.preset])
        if self.vl_record is not None:
            model = vl_finetune.init_model(args.init or args.resume, self.vl_record)
            vl_finetune.apply_freeze(model, args.freeze)
        elif (lora := peft_cli.build_model(args, PRESETS[args.preset])) is not None:  # LoRA / frozen / FP8 base
            model = lora
        elif args.resume and has_run_state(args.resume):  # a torchrun run: DCP fills the weights in _resume
            model = Glm53ForCausalLM(Glm53Config.from_pretrained(args.resume))
        elif args.resume:
            model = Glm53ForCausalLM.from_pretrained(args.resume)
        elif args.init:
            model = init_model(args.init)
        else:
            model = Glm53ForCausalLM(PRESETS[args.preset]())
        if self.par is not None:
            model = parallelize(model, self.mesh, activation_checkpointing=args.activation_checkpointing)
        elif args.activation_checkpointing:
            model.gradient_checkpointing_enable()
        if args.compile:
            compile_blocks(model, backend=args.compile)
        return model

    def _resume(self) -> int:
        """Restore the optimizer and RNG states of a resumed run; -> the step it stopped at (0 when fresh)."""
        if self.state is None:
            return 0
        if "dcp" in self.state:
            step, data = resume_distributed(self.state["dcp"], self.model, self.optimizer, self.par,
                                            tuple(_layout(self.args)), self.dp_rank, self.generator)  # fmt: skip
            if data is not None:
                self.state["data"] = data
            return step
        if self.par is None:
            restore_optimizer(self.optimizer, self.state["optimizer"], self.args.resume)
            rng = self.state
        else:
            self.par.load_full_optimizer_state(self.model, self.optimizer, self.state["optimizer"])
            rng = self.state["rank_rng"][self.rank]
        self.generator.set_state(rng["data_rng"])
        torch.set_rng_state(rng["torch_rng"])
        return int(self.state["step"])

    def _file_data(self, dp_rank: int) -> FileData | None:
        """The --data source (None for the built-in corpus), at the resumed run's data position."""
        args, resumed_data = self.args, self.state is not None and "data" in self.state
        if not args.data:
            if resumed_data:
                raise SystemExit(f"--resume {args.resume} was trained on --data; pass the same --data FILE")
            return None
        if self.state is not None and not resumed_data:
            raise SystemExit(f"--resume {args.resume} was trained on the built-in corpus, not on --data")
        config = self.model.config
        try:
            if self.vl_record is not None:
                data = vl_finetune.VLFileData(args, args.tokenizer or args.init or args.resume, self.model,
                                              args.dp * args.ep, dp_rank)  # fmt: skip
            else:
                data = FileData(args, args.tokenizer or args.init or args.resume, config.vocab_size,
                                config.pad_token_id or 0, args.dp * args.ep, dp_rank)  # fmt: skip
        except DataError as e:  # a bad file or record: the message (file and line), not a traceback
            raise SystemExit(f"glm53 train: {e}") from None
        if resumed_data:
            data.load_state_dict(self.state["data"], args.resume)
        return data

    def next_micro_batches(self, corpus) -> list[dict[str, torch.Tensor]]:
        """The model inputs of one optimizer step: --grad-accum micro-batches of this rank."""
        if self.data is None:
            return [dict(input_ids=ids, labels=ids) for ids in (next(corpus) for _ in range(self.args.grad_accum))]
        inputs = vl_finetune.model_inputs if self.vl_record is not None else model_inputs
        return [inputs(self.model, b) for b in self.data.next_step()]

    # ------------------------------------------------------------------------------------------------- step
    def _loss_context(self) -> contextlib.AbstractContextManager:
        """The vocab-parallel cross-entropy under TP (forward and backward); a no-op otherwise."""
        return loss_parallel_context(self.model) if self.par is not None else contextlib.nullcontext()

    def step(self, step: int, micro: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One optimizer step on this rank's micro-batches (model inputs with labels) -> this rank's share of each
        loss part (summed over the micro-batches; the mean over dp ranks is the global batch's loss).

        Every part is normalised by the global batch's counts (micro-batches and dp ranks together), so the step's
        gradient is one forward's on the whole global batch, whatever the masks and packing."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.args.steps, self.args.lr)
        self.optimizer.zero_grad(set_to_none=True)
        counts = [self.model.loss_counts(m["labels"], m.get("attention_mask"), m.get("position_ids")) for m in micro]
        den = sum(counts[1:], counts[0])
        if self.par is not None:
            # every dp x ep rank reads its own batches: the global batch's counts over both dimensions
            den = self.par.loss_denominators(self.par.loss_denominators(den, self.mesh, "dp"), self.mesh, "ep")
        parts: dict[str, torch.Tensor] = {}
        for inputs in micro:
            with self._loss_context():
                out = self.model(**forward_inputs(self.model, inputs, den, self.args.cp), return_logits=False)
                out.loss.backward()
            for name in LOSS_PARTS:
                if getattr(out, name) is not None:
                    parts[name] = parts.get(name, 0) + getattr(out, name).detach()
        if self.par is not None:  # gradients on two meshes under EP
            parallel_clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.model.update_router_bias(self.args.bias_rate)  # loads summed over dp ranks by model.expert_load_reduce
        return parts

    # -------------------------------------------------------------------------------------------------- log
    def _announce(self) -> None:
        args = self.args
        params = sum(p.numel() for p in self.model.parameters())
        how = f"resuming {args.resume} at step {self.start}" if self.state else f"preset {args.preset}, seed {args.seed}"
        how = f"fine-tuning {args.init}, seed {args.seed}" if args.init else how
        ep = f" x ep {args.ep}" if args.ep > 1 else ""
        ep += f" x cp {args.cp}" if args.cp > 1 else ""
        layout = f", dp {args.dp} x tp {args.tp}{ep}" if self.par is not None else ""
        accum = f"{args.grad_accum}x" if args.grad_accum > 1 else ""
        print(f"glm53 train: {how}, {params:,} parameters{layout}, {args.steps} steps of {accum}{args.batch_size}x"
              f"{args.seq_len} tokens", flush=True)  # fmt: skip
        if self.data is not None:
            print(self.data.describe(), flush=True)
        if self.start >= args.steps:
            print(f"already at step {self.start} >= --steps {args.steps}; nothing to do", flush=True)

    def _log(self, step: int, parts: dict[str, float], loss: float, rate: float) -> None:
        args, tty = self.args, sys.stderr.isatty()
        if tty:
            print("\r" + _progress(step, args.steps, loss, rate), end="", file=sys.stderr, flush=True)
        if step % args.log_every == 0 or step == args.steps or step == self.start + 1:
            if tty:
                print(file=sys.stderr)
            else:
                print(_progress(step, args.steps, loss, rate), file=sys.stderr, flush=True)
            media = f"  {self.data.step_media_tokens} image tokens" if self.vl_record is not None else ""
            print(f"step {step:5d}  loss {loss:.4f}  {_describe(parts)}  lr {lr_at(step, args.steps, args.lr):.2e}  "
                  f"{rate:,.0f} tok/s{media}", flush=True)  # fmt: skip

    # ------------------------------------------------------------------------------------------------- save
    def save(self, path: str, step: int) -> None:
        data = self.data.state_dict() if self.data is not None else None
        state = trainer_state(step, self.optimizer, self.generator, self.par, tuple(_layout(self.args)), data)
        if self.par is not None:
            state["dp_rank"] = self.dp_rank
        if not peft_cli.save_run(self.model, path, state):  # a LoRA run saves its adapter, not the base
            save_run(self.model, path, state, self.par, export=not self.args.no_export)
        if self.data is not None and self.rank == 0:
            self.data.tokenizer.save(path)  # a resumed or downstream run finds the tokenizer beside the weights

    # -------------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        args, par = self.args, self.par
        if self.log_rank:
            self._announce()
        data = batches(encode(corpus_text()), args.batch_size, args.seq_len, self.generator)
        began, tokens = time.perf_counter(), 0
        for step in range(self.start + 1, args.steps + 1):
            micro = [{k: v.to(self.device) for k, v in m.items()} for m in self.next_micro_batches(data)]
            parts = self.step(step, micro)
            tokens += sum(int(m.get("attention_mask", m["input_ids"]).ne(0).sum()) for m in micro) * args.dp * args.ep
            rate = tokens / (time.perf_counter() - began)
            values = torch.stack(list(parts.values()))
            # every dp x ep rank trained on its own batches
            values = values if par is None else par.mean_over(par.mean_over(values, self.mesh, "dp"), self.mesh, "ep")
            parts = dict(zip(parts, values.tolist()))  # NOTE: syncs
            loss = parts["loss"]
            if not math.isfinite(loss):
                raise SystemExit(f"step {step}: loss is {loss}; stopping")
            if self.log_rank:
                self._log(step, parts, loss, rate)
            if args.save and args.save_every and step % args.save_every == 0 and step != args.steps:
                self.save(os.path.join(args.save, f"step-{step}"), step)
        if args.save:
            self.save(args.save, max(self.start, args.steps))
            if self.log_rank:
                what = f"official layout + {TRAINER_STATE}" if par is None else \
                    ("DCP train_state/" if args.no_export else "official layout + DCP train_state/")
                print(f"saved {args.save} ({what})", flush=True)
        if self.data is not None and self.log_rank:
            print(self.data.summary(), flush=True)
        peft_cli.export_merged(args, self.model)  # --export-merged DIR
        return 0


__all__ = ["Trainer", "PRESETS", "lr_at", "GRAD_CLIP"]
