"""The training loop behind `python -m glm53 train` (cli.py): setup, resume, step, log, save.

Every step: forward with labels (lm + MTP + router balance + indexer KL losses, glm53/losses/) and backward for
each --grad-accum micro-batch, every loss part divided by its count over the global batch (losses/counts.py), then
gradient clipping, AdamW and the aux-loss-free router bias update. Data: the built-in byte corpus, or --data FILE
packed into rows (finetune.py; image/video records: vl_finetune.py) from an --init model. `--save DIR` writes the
final checkpoint to DIR and, with `--save-every N`, DIR/step-N (state.py). Under torchrun each dp rank draws its
own batches, and checkpoints are DCP shards (every rank its own) plus the official layout, resumable on any layout
or in one process (state.py, distributed.py). This module holds no collectives: glm53.parallel does that work.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable

import torch

from ..config import Glm53Config
from ..losses import Glm53ForCausalLM
from ..model.compile import compile_blocks
from ..parallel import clip_grad_norm_ as parallel_clip_grad_norm_
from ..parallel import loss_parallel_context
from ..parallel.run_checkpoint import device_type, has_run_state
from ..peft import cli as peft_cli
from ..utils import ceil_div
from . import runconfig, vl_finetune
from .announce import announce
from .data import VOCAB_SIZE, batches, corpus_text, encode
from .data.documents import DataError
from .distributed import forward_inputs, init_parallel_model
from .finetune import FileData, eval_batches, init_model, model_inputs
from .metrics import (
    Recorder,
    describe_parts,
    expert_load_stats,
    flops_per_token,
    peak_flops,
    peak_memory_bytes,
    progress_text,
    step_record,
)
from .optim import MIN_LR_FRACTION, WARMUP_FRACTION, build_optimizer, build_scheduler, lr_at
from .run_files import check_tokenizer_files, prune_steps, save_conflict, write_tokenizer
from .state import TRAINER_STATE, load_trainer_state, restore_optimizer, resume_distributed, save_run, trainer_state
from .stopping import Interrupted, SignalStop

GRAD_CLIP = 1.0  # the default --grad-clip: max global gradient norm
LOSS_PARTS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss")

VOCAB_MULTIPLE = 64  # the byte vocabulary rounded up so it splits evenly over --tp 2, 4, 8 (rows never used)
PRESETS: dict[str, Callable[[], Glm53Config]] = {
    # Every training feature on: one MTP layer, indexer KL (dense warm-up), balance loss (default coefficient).
    "tiny": lambda: Glm53Config.tiny(
        vocab_size=ceil_div(VOCAB_SIZE, VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        num_nextn_predict_layers=1,
        indexer_loss_weight=1.0,
    ),
}


def _layout(args: argparse.Namespace) -> list[int]:
    """The parallel layout saved with a checkpoint: [dp, tp], with ep appended when it exceeds 1."""
    return [args.dp, args.tp] + ([args.ep] if args.ep > 1 else [])


class Trainer:
    """One process, or (`par` = glm53.parallel.runtime) one rank of a torchrun (dp, tp) grid."""

    def __init__(self, args: argparse.Namespace, par=None) -> None:
        self.args, self.par = args, par
        self.mesh = (
            par.init_mesh(args.dp, args.tp, device_type(args.device), ep=args.ep, cp=args.cp)
            if par is not None
            else None
        )
        self.device = self.mesh.device_type if par is not None else args.device
        self.rank = par.rank() if par is not None else 0
        self.log_rank = self.rank == 0
        # one process with --bf16: fp32 master weights and AdamW state, bf16 compute (autocast)
        self.autocast = torch.bfloat16 if args.bf16 and par is None else None
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        self.state = self._load_resume_state()
        self.vl_record = vl_finetune.first_vl_record(args.data)  # image/video data: the VL model (vl_finetune.py)
        vl_finetune.check_args(args, self.vl_record, distributed=par is not None)
        self.model = self._build_model()
        self.model.train()
        self.optimizer = build_optimizer(self.model, args)  # trainable parameters only: frozen ones get no state
        self.scheduler = build_scheduler(self.optimizer, args)
        # Each data-parallel rank draws its own batches; the TP ranks of one dp group draw the same ones.
        # Expert-parallel ranks read their own batches too (data rank = dp_rank * ep + ep_rank).
        self.dp_rank = (
            par.local_rank(self.mesh, "dp") * args.ep + par.local_rank(self.mesh, "ep") if par is not None else 0
        )
        self.generator = torch.Generator().manual_seed(args.seed * 1_000_003 + self.dp_rank)
        self.start = self._resume()
        self.data = self._file_data(self.dp_rank)
        self.eval_rows = self._eval_rows()
        self.flops_per_token = flops_per_token(self.model)
        self.stopper = SignalStop(self.log_rank)  # SIGINT / SIGTERM: finish the step, save, stop
        self.last_saved: str | None = args.resume
        self.run_config_stat = None

    # ------------------------------------------------------------------------------------------------ setup
    def _load_resume_state(self) -> dict | None:
        args = self.args
        if not args.resume:
            return None
        if has_run_state(args.resume):  # a torchrun run (a LoRA one too), any layout (one process too)
            return {"dcp": args.resume}  # state.resume_distributed
        if (lora := peft_cli.resume_state(args)) is not None:  # a one-process LoRA run: adapter + trainer state
            return lora
        state = load_trainer_state(args.resume)
        saved = state.get("layout", [1, 1])  # [dp, tp] (+ [ep] when ep > 1)
        if list(saved) != _layout(args):
            raise SystemExit(
                f"--resume {args.resume} was saved with layout {list(saved)} ([dp, tp] or [dp, tp, ep]; "
                f"its data and RNG states are per rank); resume with the same layout"
            )
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
        lora = None
        if self.vl_record is not None:  # the VL model, through glm53.peft with LoRA / --base-dtype flags
            model, peft = vl_finetune.build_model(args, self.vl_record)
            lora = model if peft else None
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
        # Trained weights are fp32 masters whatever the checkpoint stores: bf16 weights would round most updates
        # away. A frozen base (LoRA, --freeze) keeps its own dtype: it is never updated.
        trained = [p for p in model.parameters() if p.requires_grad]
        self.loaded_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in trained})
        if lora is None:
            model.float()
        else:
            for p in trained:
                p.data = p.data.float()
        model.to(self.device)
        if args.activation_checkpointing:
            model.gradient_checkpointing_enable()
        if args.compile:
            compile_blocks(model, backend=args.compile)
        return model

    def _resume(self) -> int:
        """Restore the optimizer, schedule and RNG states of a resumed run; -> its step (0 when fresh)."""
        if self.state is None:
            return 0
        if "dcp" in self.state:
            step, data = resume_distributed(
                self.state["dcp"],
                self.model,
                self.optimizer,
                self.par,
                tuple(_layout(self.args)),
                self.dp_rank,
                self.generator,
            )
            if data is not None:
                self.state["data"] = data
            self._replay_schedule(step)
            return step
        if self.par is None:
            restore_optimizer(self.optimizer, self.state["optimizer"], self.args.resume)
            rng = self.state
        else:
            self.par.load_full_optimizer_state(self.model, self.optimizer, self.state["optimizer"])
            rng = self.state["rank_rng"][self.rank]
        self.generator.set_state(rng["data_rng"])
        torch.set_rng_state(rng["torch_rng"])
        step = int(self.state["step"])
        if self.par is None and "scheduler" in self.state:
            self.scheduler.load_state_dict(self.state["scheduler"])
        else:
            self._replay_schedule(step)
        return step

    def _replay_schedule(self, step: int) -> None:
        """The schedule after `step` steps (the same arithmetic a straight run did: exact)."""
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):
                self.scheduler.step()

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
                data = vl_finetune.VLFileData(
                    args, args.tokenizer or args.init or args.resume, self.model, args.dp * args.ep, dp_rank
                )
            else:
                data = FileData(
                    args,
                    args.tokenizer or args.init or args.resume,
                    config.vocab_size,
                    config.pad_token_id or 0,
                    args.dp * args.ep,
                    dp_rank,
                    par=self.par,
                )
        except DataError as e:  # a bad file or record: the message (file and line), not a traceback
            raise SystemExit(f"glm53 train: {e}") from None
        if resumed_data:
            data.load_state_dict(self.state["data"], args.resume)
        return data

    def _eval_rows(self):
        """This rank's share of the --eval-data rows (packed once), or None."""
        args = self.args
        if not getattr(args, "eval_data", None):
            return None
        if self.data is None:
            raise SystemExit("--eval-data needs --data (it is tokenized with the run's tokenizer)")
        try:
            if self.vl_record is not None:  # image/video records: the VL rows, pixels of this rank's rows only
                return self.data.eval_batches(args.eval_data, args.batch_size)
            return eval_batches(
                args.eval_data, self.data.tokenizer, args.seq_len, args.batch_size, args.dp * args.ep, self.dp_rank
            )
        except DataError as e:
            raise SystemExit(f"glm53 train: {e}") from None

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

    def _compute_context(self) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=self.autocast)

    def _global_counts(self, den, reduce):
        if self.par is None:
            return den
        return reduce(reduce(den, self.mesh, "dp"), self.mesh, "ep")

    def step(self, step: int, micro: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One optimizer step on this rank's micro-batches (model inputs with labels) -> this rank's share of each
        loss part (summed over the micro-batches; the mean over dp ranks is the global batch's loss).

        Every part is normalised by the global batch's counts (micro-batches and dp ranks together), so the step's
        gradient is one forward's on the whole global batch, whatever the masks and packing. The lr is the
        scheduler's (stepped after the optimizer); the global gradient norm before clipping is `self.grad_norm`."""
        self.optimizer.zero_grad(set_to_none=True)
        counts = [self.model.loss_counts(m["labels"], m.get("attention_mask"), m.get("position_ids")) for m in micro]
        den = sum(counts[1:], counts[0])
        if self.par is not None:
            # every dp x ep rank reads its own batches: the global batch's counts over both dimensions
            den = self._global_counts(den, self.par.loss_denominators)
        parts: dict[str, torch.Tensor] = {}
        for inputs in micro:
            with self._loss_context():
                with self._compute_context():
                    out = self.model(**forward_inputs(self.model, inputs, den, self.args.cp), return_logits=False)
                out.loss.backward()
            for name in LOSS_PARTS:
                if getattr(out, name) is not None:
                    parts[name] = parts.get(name, 0) + getattr(out, name).detach().float()
        if self.par is not None and self.vl_record is not None:  # no image on any rank: None, as one process's
            media = self._global_counts(vl_finetune.media_count(micro, self.device), self.par.sum_over)
            vl_finetune.drop_dummy_tower_grads(self.model, media)
        clip = self.args.grad_clip if self.args.grad_clip > 0 else math.inf
        if self.par is not None:  # gradients on two meshes under EP
            self.grad_norm = parallel_clip_grad_norm_(self.model.parameters(), clip)
        else:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.expert_loads = expert_load_stats(self.model)
        self.model.update_router_bias(self.args.bias_rate)  # loads summed over dp ranks by model.expert_load_reduce
        return parts

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out next-token loss (every target token of --eval-data, over every rank) and its perplexity."""
        rows, was_training = self.eval_rows, self.model.training
        make = vl_finetune.model_inputs if self.vl_record is not None else model_inputs
        inputs = [{k: v.to(self.device) for k, v in make(self.model, b).items()} for b in rows]
        counts = [self.model.loss_counts(i["labels"], i["attention_mask"], i.get("position_ids")) for i in inputs]
        den = sum(counts[1:], counts[0]) if counts else None
        if self.par is not None:
            den = self._global_counts(den, lambda c, m, d: type(c).from_stacked(self.par.sum_over(c.stacked(), m, d)))
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for i in inputs:
            with self._loss_context(), self._compute_context():
                total += self.model(**i, loss_denominators=den, return_logits=False).lm_loss.float()
        self.model.train(was_training)
        if self.par is not None:
            total = self._global_counts(total, self.par.sum_over)
        loss = float(total)
        out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}
        if self.vl_record is not None:  # the held-out image/video placeholder tokens, counted apart (all ranks)
            media = torch.tensor(float(sum(b.media_tokens() for b in rows)), device=self.device)
            out["eval_image_tokens"] = int(self._global_counts(media, self.par.sum_over) if self.par else media)
        return out

    # -------------------------------------------------------------------------------------------------- log
    def _log(self, step: int, parts: dict[str, float], loss: float, rate: float) -> None:
        args = self.args
        self.recorder.progress(step, loss, rate)
        if self._is_log_step(step):
            if self.recorder.bar is None:
                print(progress_text(step, args.steps, loss, rate), file=sys.stderr, flush=True)
            media = f"  {self.data.step_media_tokens} image tokens" if self.vl_record is not None else ""
            self.recorder.write_line(
                f"step {step:5d}  loss {loss:.4f}  {describe_parts(parts)}  lr {self.lr:.2e}  {rate:,.0f} tok/s{media}"
            )

    def _is_log_step(self, step: int) -> bool:
        return step % self.args.log_every == 0 or step == self.args.steps or step == self.start + 1

    def _metrics(self, step: int, parts: dict, tokens: int, rates: list[float], padding: float, elapsed: float) -> dict:
        peak = peak_flops(self.args.peak_tflops, self.device)
        memory, loads = peak_memory_bytes(self.device), self.expert_loads
        values = (self.lr, float(self.grad_norm), tokens, rates, self.flops_per_token, peak, elapsed, memory)
        return step_record(step, parts, *values, padding, loads)

    # ------------------------------------------------------------------------------------------------- save
    def save(self, path: str, step: int) -> str:
        """Save the run at `step` into `path` (or, when another job's checkpoint appeared there, beside it) -> where."""
        args = self.args
        if self._agree(save_conflict(path, self.run_config_stat, self.last_saved)):
            path = f"{path.rstrip(os.sep)}.step-{step}-{os.getpid()}"
            if self.log_rank:
                print(
                    f"glm53 train: {args.save} now holds a checkpoint this run did not write; saving into {path} "
                    f"instead",
                    file=sys.stderr,
                    flush=True,
                )
        data = self.data.state_dict() if self.data is not None else None
        state = trainer_state(step, self.optimizer, self.generator, self.par, tuple(_layout(args)), data)
        if self.par is not None:
            state["dp_rank"] = self.dp_rank
        else:
            state["scheduler"] = self.scheduler.state_dict()
        try:
            if self.par is not None or not peft_cli.save_run(self.model, path, state):  # LoRA: the adapter only
                save_run(self.model, path, state, self.par, export=not args.no_export)
        except OSError as e:
            kept = f"the last complete checkpoint is {self.last_saved}" if self.last_saved else "nothing was saved"
            raise OSError(f"saving step {step} to {path} failed ({e.strerror or e}); {kept}") from e
        if self.log_rank:
            if self.data is not None:
                write_tokenizer(self.data.tokenizer, path)  # a resumed or downstream run finds it beside the weights
            if self.args.train_parser is not None:
                runconfig.write(path, runconfig.stored(args, self.args.train_parser))
        self.last_saved = path
        return path

    def _agree(self, flag: bool) -> bool:
        """Whether any rank says `flag` (every rank gets the same answer)."""
        if self.par is None:
            return bool(flag)
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        for dim in ("dp", "ep", "tp", "cp"):
            value = self.par.sum_over(value, self.mesh, dim)
        return bool(value.item() > 0)

    def _start_run_dir(self) -> None:
        """Write DIR/run.toml at the start (rank 0) and check DIR's tokenizer files are this run's."""
        args = self.args
        if not args.save or not self.log_rank:
            return
        if self.data is not None:
            check_tokenizer_files(self.data.tokenizer, args.save)
        if args.train_parser is not None:
            runconfig.write(args.save, runconfig.stored(args, args.train_parser))
            st = os.stat(os.path.join(args.save, runconfig.RUN_CONFIG))
            self.run_config_stat = (st.st_ino, st.st_dev)

    # -------------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        self._start_run_dir()
        self.recorder = Recorder(self.args.save, self.args.tensorboard, self.args.steps, self.start, self.log_rank)
        if self.log_rank:
            announce(self)
        try:
            with self.stopper:
                return self._loop()
        finally:
            self.recorder.close()

    def _loop(self) -> int:
        args, par = self.args, self.par
        # the built-in corpus only when it is the data (its length must not limit a --data run's --seq-len)
        corpus = (
            batches(encode(corpus_text()), args.batch_size, args.seq_len, self.generator) if self.data is None else None
        )
        began, tokens, step, rank_tokens = time.perf_counter(), 0, self.start, None
        eval_every = args.eval_every or args.log_every
        for step in range(self.start + 1, args.steps + 1):
            micro = [{k: v.to(self.device) for k, v in m.items()} for m in self.next_micro_batches(corpus)]
            parts = self.step(step, micro)
            mine = sum(int(m.get("attention_mask", m["input_ids"]).ne(0).sum()) for m in micro)
            slots = sum(m["input_ids"].numel() for m in micro)
            elapsed = time.perf_counter() - began
            values = torch.stack(list(parts.values()) + [torch.tensor(float(mine), device=self.device)])
            per_rank = torch.tensor([float(mine)])
            if par is not None:  # every dp x ep rank trained on its own batches
                per_rank = torch.zeros(args.dp * args.ep, device=self.device)
                per_rank[self.dp_rank] = mine
                per_rank = self._global_counts(per_rank, par.sum_over) / args.tp  # tp ranks count the same rows
                values = par.mean_over(par.mean_over(values, self.mesh, "dp"), self.mesh, "ep")
            got = values.tolist()  # NOTE: syncs
            parts = dict(zip(parts, got[:-1]))
            rank_tokens = per_rank.cpu() if rank_tokens is None else rank_tokens + per_rank.cpu()
            step_tokens = int(rank_tokens.sum()) - tokens
            tokens += step_tokens
            rate = tokens / elapsed
            loss = parts["loss"]
            if not math.isfinite(loss):
                raise SystemExit(f"step {step}: loss is {loss}; stopping")
            if self.log_rank:
                self._log(step, parts, loss, rate)
            evaluated = self.eval_rows is not None and (step % eval_every == 0 or step == args.steps)
            extra = self.evaluate() if evaluated else {}
            if (self._is_log_step(step) or evaluated) and self.log_rank:
                rates = (rank_tokens / elapsed).tolist()
                self.recorder.record(
                    {**self._metrics(step, parts, step_tokens, rates, 1 - mine / max(slots, 1), elapsed), **extra}
                )
                if evaluated:
                    media = f"  {extra['eval_image_tokens']} image tokens" if "eval_image_tokens" in extra else ""
                    self.recorder.write_line(
                        f"eval  step {step:5d}  loss {extra['eval_loss']:.4f}  perplexity "
                        f"{extra['eval_perplexity']:.3f}{media}"
                    )
            if self._agree(self.stopper.signum is not None):
                return self._stop(step)
            if args.save and args.save_every and step % args.save_every == 0 and step != args.steps:
                self.save(os.path.join(args.save, f"step-{step}"), step)
                if args.keep_last and self.log_rank:
                    prune_steps(args.save, args.keep_last)
        if args.save:
            self.save(args.save, max(self.start, args.steps))
            if self.log_rank:
                what = (
                    f"official layout + {TRAINER_STATE}"
                    if par is None
                    else ("DCP train_state/" if args.no_export else "official layout + DCP train_state/")
                )
                print(f"saved {args.save} ({what})", flush=True)
        if self.data is not None and self.log_rank:
            print(self.data.summary(), flush=True)
        peft_cli.export_merged(args, self.model)  # --export-merged DIR
        return 0

    def _stop(self, step: int) -> int:
        name = signal.Signals(self.stopper.signum or signal.SIGTERM)
        status = 128 + int(name)
        if not self.args.save:
            raise Interrupted(f"{name.name} at step {step}: stopped; nothing saved (no --save)", status)
        where = self.save(self.args.save, step)
        raise Interrupted(f"{name.name} at step {step}: saved {where}; continue with --resume {where}", status)


__all__ = ["Trainer", "Interrupted", "PRESETS", "lr_at", "GRAD_CLIP", "MIN_LR_FRACTION", "WARMUP_FRACTION"]
