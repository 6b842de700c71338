"""What `glm53 train` records: one JSON line per logging step (DIR/metrics.jsonl), TensorBoard, the tqdm bar.

No collectives here (the trainer reduces before it hands values over). Fields of a metrics line:
    step, loss and every loss part (lm_loss, mtp_loss, aux_loss, indexer_loss when present), lr,
    grad_norm (the global norm before clipping: clip_grad_norm_'s return), tokens (the step's non-padding tokens
    over every rank), tokens_per_s (global, since the start of this invocation), tokens_per_s_rank (per data rank),
    flops_per_token (6 x the parameters a token multiplies through), mfu (achieved / --peak-tflops; null when
    no peak is known), peak_memory_bytes (CUDA max allocated, or the process's peak RSS on CPU),
    expert_load_min / _max / _mean (tokens per routed expert over the step's routers, this rank),
    padding (share of padding tokens in the step's rows), time (seconds since the start), and the eval_* keys
    on evaluation steps.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch

METRICS = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
BAR_WIDTH = 24  # the printed progress bar's width (the line printed when stderr is not a TTY)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16 peaks, for the MFU on known GPUs


def active_matmul_params(model: torch.nn.Module) -> int:
    """Parameters one token multiplies through: routed experts count top-k / E of theirs, embeddings none."""
    config = getattr(model, "config", None)
    share = (config.num_experts_per_tok / config.n_routed_experts) if getattr(config, "n_routed_experts", 0) else 1
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or p.dim() < 2:
            continue
        total += int(p.numel() * share) if "experts.gate_up_proj" in name or "experts.down_proj" in name else p.numel()
    return total


def flops_per_token(model: torch.nn.Module) -> int:
    """Training FLOPs per token: 2 (multiply-add) x 3 (forward, two backward GEMMs) per matmul parameter; attention
    scores are not counted (a lower bound, as in benchmarks/bench_model.py)."""
    return 6 * active_matmul_params(model)


def mfu(flops_per_tok: int, tokens_per_s: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak (None without a peak)."""
    return None if not peak_flops else flops_per_tok * tokens_per_s / peak_flops


def peak_memory_bytes(device: str) -> int:
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def expert_load_stats(model: torch.nn.Module) -> dict[str, float]:
    """min / max / mean tokens per routed expert over every router's counted load (call before the bias update)."""
    loads = [r.counted_load for r in getattr(model, "routers", lambda: [])() if r.counted_load is not None]
    if not loads:
        return {}
    flat = torch.cat([torch.as_tensor(x).float().flatten().cpu() for x in loads])
    return {
        "expert_load_min": float(flat.min()),
        "expert_load_max": float(flat.max()),
        "expert_load_mean": float(flat.mean()),
    }


def progress_text(step: int, total: int, loss: float, rate: float) -> str:
    done = BAR_WIDTH * step // max(total, 1)
    return f"[{'#' * done}{'.' * (BAR_WIDTH - done)}] {step}/{total} loss {loss:.4f} {rate:,.0f} tok/s"


def describe_parts(parts: dict[str, float]) -> str:
    """The loss parts of a log line: `lm 2.3456  mtp 2.5  aux 0.01  indexer 0.3` (the parts the run has)."""
    text = [f"lm {parts['lm_loss']:.4f}"]
    for name in ("mtp_loss", "aux_loss", "indexer_loss"):
        if name in parts:
            text.append(f"{name.removesuffix('_loss')} {parts[name]:.4g}")
    return "  ".join(text)


def peak_flops(peak_tflops: float | None, device: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s for the MFU: --peak-tflops, else a known GPU's, else None."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device == "cuda":
        name = torch.cuda.get_device_name()
        return next((t * 1e12 for k, t in PEAK_TFLOPS.items() if k in name), None)
    return None


def step_record(
    step: int,
    parts: dict,
    lr: float,
    grad_norm: float,
    tokens: int,
    rates: list[float],
    flops_per_tok: int,
    peak: float | None,
    elapsed: float,
    peak_memory: int,
    padding: float,
    expert_loads: dict,
) -> dict:
    """One metrics.jsonl line: the loss parts, lr, grad norm before clipping, tokens/s (global, per rank), MFU..."""
    rate = sum(rates)
    return {
        "step": step,
        **parts,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": rate,
        "tokens_per_s_rank": rates,
        "flops_per_token": flops_per_tok,
        "mfu": mfu(flops_per_tok, rate, peak),
        "time": elapsed,
        "peak_memory_bytes": peak_memory,
        "padding": padding,
        **expert_loads,
    }


class Recorder:
    """Rank 0's metrics file, TensorBoard writer and progress bar (all inert on other ranks)."""

    def __init__(self, run_dir: str | None, tensorboard: bool, total: int, start: int, active: bool) -> None:
        self.active, self.file, self.writer, self.bar = active, None, None, None
        if not active:
            return
        if run_dir is not None:
            os.makedirs(run_dir, exist_ok=True)
            self.file = open(os.path.join(run_dir, METRICS), "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise SystemExit(
                    "--tensorboard needs the tensorboard package: pip install 'glm53[tensorboard]'"
                ) from None
            self.writer = SummaryWriter(os.path.join(run_dir, TENSORBOARD_DIR))
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, file=sys.stderr, dynamic_ncols=True, unit="step")

    def progress(self, step: int, loss: float, rate: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(f"loss {loss:.4f} {rate:,.0f} tok/s", refresh=False)

    def record(self, values: dict) -> None:
        if not self.active:
            return
        if self.file is not None:
            self.file.write(json.dumps(values, sort_keys=True) + "\n")
            self.file.flush()
        if self.writer is not None:
            for key, value in values.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(
                        f"train/{key}" if not key.startswith("eval_") else f"eval/{key[5:]}", value, values["step"]
                    )
            self.writer.flush()

    def write_line(self, text: str) -> None:
        """A printed line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for thing in (self.bar, self.writer, self.file):
            if thing is not None:
                thing.close()
        self.bar = self.writer = self.file = None


__all__ = [
    "METRICS",
    "Recorder",
    "TENSORBOARD_DIR",
    "active_matmul_params",
    "expert_load_stats",
    "flops_per_token",
    "mfu",
    "peak_memory_bytes",
]
