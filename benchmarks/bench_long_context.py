"""Long context on the bench config (issue 15): forward time scaling and training-step memory per token.

    python benchmarks/bench_long_context.py                       # forward at 16K/32K, memory at 4K..32K
    python benchmarks/bench_long_context.py --forward 8192 16384 --memory 2048 4096 8192

Forward: glm53 alone (transformers' eager attention builds [T, T] masks per layer and cannot run 32K here), no
grad, median of `--reps` after one warm-up; the target is T(32768) / T(16384) <= 2.1 (linear would be 2.0). Each
allocator setting of `--allocators` times in its own fresh child: "retain" (RETAIN_ENV, the fair setting of
bench_model.py) and "default" (glibc's defaults: every tensor over its 32 MiB mmap ceiling is mapped afresh and
page-faulted on each allocation, and at 32K a [T, 256] fp32 activation crosses that line while at 16K it does not,
so this ratio carries an allocator step on top of the model's own growth).
Memory: one training step (the model's own loss with labels, activation checkpointing on, every loss part the
config enables) in a fresh child process per T; peak RSS growth (VmHWM reset just before the step, minus the RSS
before it) divided by T. The target is "flat from 4K to 32K": the 32K / 4K ratio of bytes per token near 1.
glibc keeps freed memory as in bench_model.py (RETAIN_ENV) so the peak is the step's, not page-fault churn.
Results: benchmarks/results/bench_long_context.json and tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from bench_config import ROOT, bench_config, machine, median, positive_int, table, timed, vm_bytes, write_json

from glm53 import Glm53ForCausalLM

RETAIN_ENV = {"MALLOC_TRIM_THRESHOLD_": "4000000000", "MALLOC_MMAP_THRESHOLD_": "4000000000"}


def seeded_ids(vocab: int, T: int) -> torch.Tensor:
    return torch.randint(1, vocab, (1, T), generator=torch.Generator().manual_seed(T))


def build_model() -> Glm53ForCausalLM:
    torch.manual_seed(0)
    return Glm53ForCausalLM.from_config(bench_config())


def memory_child(T: int) -> None:
    """One checkpointed training step in this fresh process; prints its peak RSS growth in bytes."""
    model = build_model().train()
    model.gradient_checkpointing_enable()
    ids = seeded_ids(model.config.vocab_size, T)
    rss_before = vm_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = model(ids, labels=ids, **_no_logits(model))
    out.loss.backward()
    print(json.dumps({"peak_bytes": vm_bytes("VmHWM") - rss_before}))


def _no_logits(model) -> dict:
    """return_logits=False where the model supports it (the chunked loss never builds [B, T, V] logits)."""
    import inspect

    return {"return_logits": False} if "return_logits" in inspect.signature(model.forward).parameters else {}


def measure_memory(T: int, threads: int) -> int:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **RETAIN_ENV)
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", str(T)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


def forward_in_child(seqlens: list[int], reps: int, threads: int, allocator: str) -> list[dict]:
    """forward_times in a fresh process with the named allocator setting ("retain" or "default")."""
    env = {k: v for k, v in os.environ.items() if k not in RETAIN_ENV}
    env.update(OMP_NUM_THREADS=str(threads), **(RETAIN_ENV if allocator == "retain" else {}))
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--forward-child",
        "--forward",
        *map(str, seqlens),
        "--reps",
        str(reps),
        "--threads",
        str(threads),
    ]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def forward_times(seqlens: list[int], reps: int) -> list[dict]:
    model = build_model().eval()
    rows = []
    for T in seqlens:
        ids = seeded_ids(model.config.vocab_size, T)
        with torch.no_grad():
            model(ids)  # warm-up
            times = [timed(lambda: model(ids)) for _ in range(reps)]
        rows.append(
            {
                "T": T,
                "fwd_s": round(median(times), 3),
                "tok_s": round(T / median(times), 1),
                "times_s": [round(t, 3) for t in times],
            }
        )
        print(f"forward T={T}: {rows[-1]['fwd_s']} s", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forward", type=positive_int, nargs="*", default=[16384, 32768], help="T for the forward timings")
    ap.add_argument("--memory", type=positive_int, nargs="*", default=[4096, 8192, 16384, 32768], help="T for memory")
    ap.add_argument("--reps", type=positive_int, default=2, help="forward repetitions per T (median reported)")
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    ap.add_argument("--out", default="bench_long_context.json", help="file name under benchmarks/results/")
    ap.add_argument(
        "--allocators",
        nargs="*",
        choices=["retain", "default"],
        default=["retain", "default"],
        help="allocator settings to time the forward under, each in a fresh child (first: the headline)",
    )
    ap.add_argument("--memory-child", type=positive_int, help=argparse.SUPPRESS)
    ap.add_argument("--forward-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args.memory_child)
    if args.forward_child:
        return print(json.dumps(forward_times(args.forward, args.reps)))
    by_allocator = {}
    for allocator in args.allocators:
        print(f"forward, {allocator} allocator:", flush=True)
        by_allocator[allocator] = forward_in_child(args.forward, args.reps, args.threads, allocator)
    fwd = by_allocator[args.allocators[0]] if args.allocators else []
    memory = []
    for T in args.memory:
        peak = measure_memory(T, args.threads)
        memory.append({"T": T, "peak_MiB": round(peak / 2**20, 1), "bytes_per_token": round(peak / T)})
        print(f"training step T={T}: {memory[-1]['peak_MiB']} MiB", flush=True)
    for row in memory:
        row["per_token_vs_first"] = round(row["bytes_per_token"] / memory[0]["bytes_per_token"], 3)
    ratios = {
        a: round(rows[-1]["fwd_s"] / rows[-2]["fwd_s"], 3) if len(rows) >= 2 else None
        for a, rows in by_allocator.items()
    }
    payload = {
        "machine": machine(),
        "command": " ".join(sys.argv),
        "environment": RETAIN_ENV,
        "forward_allocator": args.allocators[0] if args.allocators else None,
        "forward": fwd,
        "forward_ratio_last_two": ratios.get(args.allocators[0]) if args.allocators else None,
        "forward_by_allocator": by_allocator,
        "forward_ratio_by_allocator": ratios,
        "memory": memory,
    }
    path = write_json(args.out, payload)
    for allocator, rows in by_allocator.items():
        print(f"forward, {allocator} allocator:")
        print(table(rows, ["T", "fwd_s", "tok_s"]))
        if ratios[allocator] is not None:
            print(f"forward T={rows[-1]['T']} / T={rows[-2]['T']}: {ratios[allocator]}")
    print(table(memory, ["T", "peak_MiB", "bytes_per_token", "per_token_vs_first"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
