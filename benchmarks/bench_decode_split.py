"""Where glm53's eager decode step spends its time: a per-module split of `generation.step` (issue 27).

    python benchmarks/bench_decode_split.py                  # bench config, prompt 2048, 20 steps, one thread
    python benchmarks/bench_decode_split.py --prompt 512 --steps 50 --threads 2
    python benchmarks/bench_decode_split.py --threads 2 --bounds   # also: what removing mHC work would buy

The step is the model's forward on a prefilled GenerationCache (T = 1, batch 1, inference mode). Each module class
that does a block's work (KDA, MLA, MoE and its experts and router, the dense MLP) and the mHC coefficients
(`HyperConnection.coefficients`) are timed with perf_counter around their forward, summed over the steps; nested
parts (experts and router inside MoE) are shown beside their parent, not subtracted; each part's ATen calls per
call (torch.profiler, one step, a profiler range around each part) likewise. Also printed: ATen calls per step by
name (torch.profiler), the measure of dispatch overhead at T = 1, and the dispatch floor: the torch calls
the step makes from Python (torch.overrides.TorchFunctionMode; tensor attribute reads left out) times the cost
here of the cheapest such call (a view of 256 numbers: what the step would cost if every op did no work) and of a
small add (two 256-number tensors: one allocation and one kernel, what most decode ops are). Results:
benchmarks/results/bench_decode_split.json and a table on stdout.

--bounds adds upper bounds on what any rewrite of the mHC coefficients could buy (issue 27's eager target): the step
(with lm_head, as transformers' forward includes it) timed as it is, with Sinkhorn replaced by the identity, and with
every site's coefficients a constant (no projection, no gates, no Sinkhorn) -- timing measures only, their tokens
are wrong -- beside transformers 5.23's cached forward on one token (same config, eager, its own random weights:
a step's time does not depend on the values), each with its ATen calls per step. Results:
benchmarks/results/bench_decode_bounds.json.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from bench_config import bench_config, machine, positive_int, table, write_json
from torch.overrides import TorchFunctionMode

from glm53 import Glm53ForCausalLM
from glm53.generation import GenerationCache, step
from glm53.model import hyper_connection as hc
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


def wrap_parts(wrapper) -> list:
    """Replaces each TIMED method by `wrapper(label, method)` -> the originals (for `restore`)."""
    originals = []
    for label, (cls, name) in TIMED.items():
        fn = getattr(cls, name)
        originals.append((cls, name, fn))
        setattr(cls, name, wrapper(label, fn))
    return originals


def restore(originals: list) -> None:
    for cls, name, fn in originals:
        setattr(cls, name, fn)


def instrument(seconds: dict, calls: dict) -> list:
    """Wraps each TIMED method with a timer -> the originals (to restore)."""

    def timer(label, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds[label] += time.perf_counter() - start
            calls[label] += 1
            return out

        return timed

    return wrap_parts(timer)


PART = "part: "  # the profiler range name of a TIMED part


def profile_aten(run) -> tuple[list[tuple[str, int]], collections.Counter]:
    """One profiled `run()` -> (its ATen calls by name, most frequent first; the ATen calls inside each TIMED part,
    a nested part's calls counted in its parent too)."""

    def ranged(label, fn):
        def in_range(*args, **kwargs):
            with torch.profiler.record_function(PART + label):
                return fn(*args, **kwargs)

        return in_range

    originals = wrap_parts(ranged)
    try:
        with torch.profiler.profile() as prof:
            run()
    finally:
        restore(originals)
    by_name, per_part = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.name.startswith("aten::"):
            by_name[event.name] += 1
            parent = event.cpu_parent
            while parent is not None:
                if parent.name.startswith(PART):
                    per_part[parent.name[len(PART) :]] += 1
                parent = parent.cpu_parent
    return by_name.most_common(), per_part


class CountCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods called from Python (a tensor attribute read is not an op)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__":
            self.calls += 1
        return func(*args, **(kwargs or {}))


def call_us(op, repeats: int = 20000) -> float:
    """Fastest of 5 timings of `op()`, in microseconds per call."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            op()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


def timed_step(run, reps: int, steps: int) -> tuple[float, int]:
    """-> (median over `reps` of the mean seconds of `steps` calls of `run`, ATen calls in one call)."""
    for _ in range(3):
        run()
    means = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(steps):
            run()
        means.append((time.perf_counter() - start) / steps)
    by_name, _ = profile_aten(run)
    return sorted(means)[len(means) // 2], sum(n for _, n in by_name)


def constant_coefficients(site: HyperConnection, streams: torch.Tensor):
    """Stand-in for HyperConnection.coefficients in the bounds (wrong values, no work): pre 1/N, post 1, comb I."""
    B, T, n = streams.shape[0], streams.shape[1], site.n
    eye = torch.eye(n, dtype=torch.float32).expand(B, T, n, n)
    return torch.full((B, T, n), 1.0 / n), torch.ones(B, T, n), eye


def bounds(model, config, prompt: int, steps: int) -> list[dict]:
    """glm53's step + lm_head as it is and with mHC work removed, and transformers' cached forward -> rows."""
    from tests.helpers.oracle import hf_model

    ids = torch.randint(1, config.vocab_size, (1, prompt))
    token = ids[:, -1:]
    reps = 5

    def ours() -> tuple[float, int]:
        with torch.inference_mode():
            cache = GenerationCache(model, max_length=prompt + (reps + 1) * steps + 16)
            step(model, cache, ids)
            return timed_step(lambda: model.lm_head(step(model, cache, token)[:, -1]), reps, steps)

    measured = {"glm53 step + lm_head, as it is": ours()}
    sinkhorn, coefficients = hc.sinkhorn, HyperConnection.coefficients
    try:
        hc.sinkhorn = lambda x, iters, eps: x
        measured["  Sinkhorn the identity (timing only)"] = ours()
        hc.sinkhorn = sinkhorn
        HyperConnection.coefficients = constant_coefficients
        measured["  mHC coefficients constant (timing only)"] = ours()
    finally:
        hc.sinkhorn, HyperConnection.coefficients = sinkhorn, coefficients
    hf = hf_model(config, seed=0)
    with torch.no_grad():
        pkv = [hf(input_ids=ids, use_cache=True).past_key_values]

        def hf_step():
            pkv[0] = hf(input_ids=token, past_key_values=pkv[0], use_cache=True).past_key_values

        hf_s, hf_aten = timed_step(hf_step, reps, steps)
    rows = [
        dict(
            step="transformers forward, one cached token", ms=round(hf_s * 1e3, 2), aten_calls=hf_aten, speedup="1.00x"
        )
    ]
    for label, (seconds, aten) in measured.items():
        rows.append(dict(step=label, ms=round(seconds * 1e3, 2), aten_calls=aten, speedup=f"{hf_s / seconds:.2f}x"))
    rows.append(dict(step="issue 27's eager target", ms=round(hf_s * 1e3 / 3, 2), aten_calls="", speedup="3.00x"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=positive_int, default=2048)
    parser.add_argument("--steps", type=positive_int, default=20)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--bounds", action="store_true", help="also time the step with mHC work removed (see above)")
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
        aten, part_aten = profile_aten(lambda: step(model, cache, token))
        counter = CountCalls()
        with counter:
            step(model, cache, token)
        a, b = torch.zeros(256), torch.ones(256)
        floor_us = call_us(lambda: a.view(-1))  # the least a torch call does: no kernel, no allocation
        add_us = call_us(lambda: a + b)  # a small elementwise op: one allocation, one kernel
        originals = instrument(seconds, calls)
        try:
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, cache, token)
            total = (time.perf_counter() - start) / args.steps
        finally:
            restore(originals)
    rows = [
        dict(
            part=label,
            calls_per_step=calls[label] // args.steps,
            ms_per_step=round(seconds[label] / args.steps * 1e3, 2),
            share=f"{seconds[label] / args.steps / total:.1%}",
            aten_per_call=part_aten[label] // max(1, calls[label] // args.steps),
        )
        for label in TIMED
    ]
    print(f"decode step {total * 1e3:.2f} ms (prompt {args.prompt}, {args.threads} thread(s), {args.steps} steps)")
    print(table(rows, ["part", "calls_per_step", "ms_per_step", "share", "aten_per_call"]))
    print(f"ATen calls per step: {sum(n for _, n in aten)}; the most frequent:")
    print(table([dict(op=k, calls=n) for k, n in aten[:8]], ["op", "calls"]))
    floor_ms, add_ms = counter.calls * floor_us / 1e3, counter.calls * add_us / 1e3
    print(
        f"torch calls from Python per step: {counter.calls}. At the cost of a view ({floor_us:.2f} us, the least a "
        f"call does) they take {floor_ms:.2f} ms, {floor_ms / (total * 1e3):.0%} of the step; at the cost of a small "
        f"add ({add_us:.2f} us) {add_ms:.2f} ms, {add_ms / (total * 1e3):.0%}"
    )
    write_json(
        "bench_decode_split.json",
        dict(
            machine=machine(),
            args=vars(args),
            step_ms=total * 1e3,
            parts=rows,
            aten_calls_per_step=dict(aten),
            python_torch_calls_per_step=counter.calls,
            view_call_us=floor_us,
            small_add_call_us=add_us,
            calls_at_view_cost_ms=floor_ms,
            calls_at_add_cost_ms=add_ms,
        ),
    )
    if args.bounds:
        rows = bounds(model, config, args.prompt, args.steps)
        print(f"\nUpper bounds on the mHC coefficients' share (prompt {args.prompt}, {args.threads} thread(s))")
        print(table(rows, ["step", "ms", "aten_calls", "speedup"]))
        write_json("bench_decode_bounds.json", dict(machine=machine(), args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
