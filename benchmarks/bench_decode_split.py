"""Where glm53's eager decode step spends its time: a per-module split of `generation.step` (issue 27).

    python benchmarks/bench_decode_split.py                  # bench config, prompt 2048, 20 steps, one thread
    python benchmarks/bench_decode_split.py --prompt 512 --steps 50 --threads 2

The step is the model's forward on a prefilled GenerationCache (T = 1, batch 1, inference mode). Each module class
that does a block's work (KDA, MLA, MoE and its experts and router, the dense MLP) and the mHC coefficients
(`HyperConnection.coefficients`) are timed with perf_counter around their forward, summed over the steps; nested
parts (experts and router inside MoE) are shown beside their parent, not subtracted. Also printed: ATen calls per
step by name (torch.profiler), the measure of dispatch overhead at T = 1. Results:
benchmarks/results/bench_decode_split.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from bench_config import bench_config, machine, positive_int, table, write_json

from glm53 import Glm53ForCausalLM
from glm53.generation import GenerationCache, step
from glm53.model.hyper_connection import HyperConnection
from glm53.model.kda import KimiDeltaAttention
from glm53.model.mla import MultiHeadLatentAttention
from glm53.model.mlp import MLP
from glm53.model.moe import Experts, MoE, Router

TIMED = {
    "mHC coefficients": (HyperConnection, "coefficients"),
    "KDA layer": (KimiDeltaAttention, "forward"),
    "MLA layer": (MultiHeadLatentAttention, "forward"),
    "MoE block": (MoE, "forward"),
    "  routed experts": (Experts, "forward"),
    "  router": (Router, "forward"),
    "dense / shared MLP": (MLP, "forward"),
}


def instrument(seconds: dict, calls: dict) -> list:
    """Wraps each TIMED method with a timer -> the originals (to restore)."""
    originals = []
    for label, (cls, name) in TIMED.items():
        fn = getattr(cls, name)
        originals.append((cls, name, fn))

        def timed(*args, _fn=fn, _label=label, **kwargs):
            start = time.perf_counter()
            out = _fn(*args, **kwargs)
            seconds[_label] += time.perf_counter() - start
            calls[_label] += 1
            return out

        setattr(cls, name, timed)
    return originals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=positive_int, default=2048)
    parser.add_argument("--steps", type=positive_int, default=20)
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = bench_config()
    model = Glm53ForCausalLM(config).eval()
    ids = torch.randint(1, config.vocab_size, (1, args.prompt))
    seconds, calls = collections.defaultdict(float), collections.defaultdict(int)
    with torch.inference_mode():
        cache = GenerationCache(model, max_length=args.prompt + args.steps + 8)
        model.model(ids, torch.ones_like(ids), cache=cache)
        token = ids[:, -1:]
        for _ in range(3):
            step(model, cache, token)
        with torch.profiler.profile() as prof:
            step(model, cache, token)
        aten = sorted(
            ((e.key, e.count) for e in prof.key_averages() if e.key.startswith("aten::")), key=lambda kv: -kv[1]
        )
        originals = instrument(seconds, calls)
        try:
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, cache, token)
            total = (time.perf_counter() - start) / args.steps
        finally:
            for cls, name, fn in originals:
                setattr(cls, name, fn)
    rows = [
        dict(
            part=label,
            calls_per_step=calls[label] // args.steps,
            ms_per_step=round(seconds[label] / args.steps * 1e3, 2),
            share=f"{seconds[label] / args.steps / total:.1%}",
        )
        for label in TIMED
    ]
    print(f"decode step {total * 1e3:.2f} ms (prompt {args.prompt}, {args.threads} thread(s), {args.steps} steps)")
    print(table(rows, ["part", "calls_per_step", "ms_per_step", "share"]))
    print(f"ATen calls per step: {sum(n for _, n in aten)}; the most frequent:")
    print(table([dict(op=k, calls=n) for k, n in aten[:8]], ["op", "calls"]))
    write_json(
        "bench_decode_split.json",
        dict(
            machine=machine(),
            args=vars(args),
            step_ms=total * 1e3,
            parts=rows,
            aten_calls_per_step=dict(aten),
        ),
    )


if __name__ == "__main__":
    main()
