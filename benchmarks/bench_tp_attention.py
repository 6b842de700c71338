"""Per-layer time of one MLA layer (forward + backward) on one process and under tensor parallelism (tp2, gloo),
in both attention forms: absorbed (attend in the kv latent; the default, also under TP) and per head.

    python benchmarks/bench_tp_attention.py                 # bench widths (bench_config), T = 2048, 3 reps
    python benchmarks/bench_tp_attention.py --seqlen 1024 --reps 5

Each configuration times `self_attn(x, ctx)` and its backward with a fixed cotangent on the bench model's first
MLA layer, median of --reps after one warm-up; under tp2 every rank runs its heads and the reported time is the
slower rank's. Results: benchmarks/results/bench_tp_attention.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.multiprocessing as mp
from bench_config import bench_config, machine, median, positive_int, table, timed, write_json

from glm53 import Glm53ForCausalLM
from glm53.model.context import ForwardContext


def mla_layer(model: Glm53ForCausalLM):
    return next(layer.self_attn for layer in model.model.layers if not layer.is_linear)


def time_layer(attn, T: int, D: int, reps: int) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, D, generator=g)
    cot = torch.randn(1, T, D, generator=g)
    ctx = ForwardContext(valid=torch.ones(1, T, dtype=torch.bool))

    def step():
        xi = x.clone().requires_grad_()
        out, _ = attn(xi, ctx)
        (out * cot).sum().backward()

    step()  # warm-up
    return median([timed(step) for _ in range(reps)])


def worker(rank: int, world: int, port: int, T: int, reps: int, absorb: bool, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from glm53.parallel import parallelize, runtime

    mesh = runtime.init_mesh(1, world)
    torch.manual_seed(0)
    model = parallelize(Glm53ForCausalLM(bench_config()), mesh)
    model.set_numerics(mla_absorb=absorb)
    seconds = time_layer(mla_layer(model), T, bench_config().hidden_size, reps)
    queue.put((rank, seconds))
    runtime.barrier()
    runtime.shutdown()


def run_tp(world: int, T: int, reps: int, absorb: bool, port: int) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, T, reps, absorb, queue)) for r in range(world)]
    for p in procs:
        p.start()
    times = [queue.get()[1] for _ in procs]
    for p in procs:
        p.join()
    return max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=positive_int, default=2048)
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--out", default="bench_tp_attention.json")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one thread per rank, and the same for the one-process runs
    torch.manual_seed(0)
    model = Glm53ForCausalLM(bench_config())
    rows = []
    for i, absorb in enumerate((True, False)):
        model.set_numerics(mla_absorb=absorb)
        one = time_layer(mla_layer(model), args.seqlen, bench_config().hidden_size, args.reps)
        tp2 = run_tp(2, args.seqlen, args.reps, absorb, 29600 + i)
        rows.append(
            {
                "form": "absorbed" if absorb else "per-head",
                "T": args.seqlen,
                "one_process_s": round(one, 4),
                "tp2_s": round(tp2, 4),
                "tp2_over_one": round(tp2 / one, 3),
            }
        )
    print(table(rows, ["form", "T", "one_process_s", "tp2_s", "tp2_over_one"]))
    path = write_json(args.out, {"machine": machine(), "command": " ".join(sys.argv), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
