"""The benchmark model (issue 5) and helpers shared by the benchmark scripts. Not a test."""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from glm53 import Glm53Config  # noqa: E402

RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")


def bench_config() -> Glm53Config:
    """vocab 4096, hidden 256, 8 layers (6 KDA + 2 MLA), 16 experts top-4, index_topk 256 / kpool 16."""
    return Glm53Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=16,
        num_experts_per_tok=4,
        index_topk=256,
        index_kpool=16,
        index_n_heads=4,
        index_head_dim=32,
        linear_num_heads=4,
        linear_head_dim=64,
        pad_token_id=0,
    )


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def positive_int(text: str) -> int:
    """argparse type for counts and lengths: a usage error (not a traceback later) unless an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type for thresholds where 0 means "none": an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def vm_bytes(field: str) -> int:
    """A /proc/self/status memory field of this process in bytes (VmRSS now, VmHWM the peak since reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_json(name: str, payload: dict) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def gemm_peak_flops(n: int = 1024, reps: int = 5) -> float:
    """The machine's fp32 GEMM rate (FLOP/s) measured now: the best of `reps` n x n x n matmuls."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(timed(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / best
