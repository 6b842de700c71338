"""Context parallelism on the bench config: per-rank peak memory and training-step time, cp 1 vs 2 vs 4 (gloo).

    python benchmarks/bench_cp.py                       # T = 16384, cp 1 2 4
    python benchmarks/bench_cp.py --seq-len 4096 --cp 1 2 --reps 2

Legend: T tokens of the one sequence, cp ranks sharing it (each holds T / cp contiguous tokens).
For each cp a fresh gloo world of cp processes (one thread each) builds the bench model (same seed), applies
`parallelize(model, mesh)` on a ("cp",) mesh with activation checkpointing (cp 1: the same code on one rank)
and runs training steps (forward with labels, backward) on `context_parallel_inputs`. Per rank: the step time
(median of `--reps` after one warm-up step), the peak RSS growth during the warm-up step (the first in a fresh
process: VmHWM reset just before it, minus the RSS before it; glibc keeps freed memory, RETAIN_ENV) and the
time spent inside the KDA and MLA layers' forwards in the last timed step (hooks: the load balance across
ranks; collectives wait inside them too). On a machine with fewer cores than ranks the ranks
share cores, so step times at cp > 1 are upper bounds there; memory per rank does not depend on it.
Results: benchmarks/results/bench_cp.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
from bench_config import bench_config, machine, median, positive_int, table, vm_bytes, write_json

RETAIN_ENV = {"MALLOC_TRIM_THRESHOLD_": "4000000000", "MALLOC_MMAP_THRESHOLD_": "4000000000"}


def _layer_timers(model) -> dict[str, float]:
    """Seconds spent in each attention kind's forwards (recomputation in backward included), via hooks."""
    from glm53.model.kda import KimiDeltaAttention
    from glm53.model.mla import MultiHeadLatentAttention

    spent = {"kda_s": 0.0, "mla_s": 0.0}
    for module in model.modules():
        kind = "kda_s" if isinstance(module, KimiDeltaAttention) else "mla_s"
        if isinstance(module, (KimiDeltaAttention, MultiHeadLatentAttention)):
            module.register_forward_pre_hook(lambda mod, *_: setattr(mod, "_began", time.perf_counter()))
            module.register_forward_hook(
                lambda mod, *_, k=kind: spent.__setitem__(k, spent[k] + time.perf_counter() - mod._began)
            )
    return spent


def rank_main(rank: int, world: int, init_file: str, T: int, reps: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from glm53 import Glm53ForCausalLM
    from glm53.parallel import context_parallel_inputs, parallelize

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800)
    )
    torch.manual_seed(0)
    model = Glm53ForCausalLM.from_config(bench_config()).train()
    parallelize(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)), activation_checkpointing=True)
    ids = torch.randint(1, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
    kwargs = context_parallel_inputs(model, ids, labels=ids)
    spent = _layer_timers(model)

    def step() -> float:
        dist.barrier()
        began = time.perf_counter()
        model(**kwargs, return_logits=False).loss.backward()  # as training loops run it: no [T, vocab] logits
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - began

    rss_before = vm_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()  # the first step in this fresh process: its peak growth is the step's (freed memory is kept)
    peak = vm_bytes("VmHWM") - rss_before
    times = []
    for _ in range(reps):
        spent.update(kda_s=0.0, mla_s=0.0)
        times.append(step())
    row = {
        "cp": world,
        "rank": rank,
        "tokens": kwargs["input_ids"].shape[1],
        "step_s": round(median(times), 3),
        "peak_MiB": round(peak / 2**20, 1),
        **{k: round(v, 3) for k, v in spent.items()},
    }
    with open(os.path.join(out_dir, f"cp{world}_rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def run_world(cp: int, T: int, reps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(cp, os.path.join(tmp, "init"), T, reps, tmp), nprocs=cp, join=True)
        rows = []
        for rank in range(cp):
            with open(os.path.join(tmp, f"cp{cp}_rank{rank}.json")) as f:
                rows.append(json.load(f))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=positive_int, default=16384, help="tokens of the sequence")
    ap.add_argument("--cp", type=positive_int, nargs="*", default=[1, 2, 4], help="context-parallel degrees to compare")
    ap.add_argument("--reps", type=positive_int, default=1, help="timed steps after the warm-up (median reported)")
    ap.add_argument("--out", default="bench_cp.json", help="file name under benchmarks/results/")
    args = ap.parse_args()
    os.environ.update(RETAIN_ENV)  # inherited by the spawned ranks: the peak is the step's, not page-fault churn
    rows = []
    for cp in args.cp:
        rows += run_world(cp, args.seq_len, args.reps)
        print(f"cp {cp} done", flush=True)
    payload = {
        "machine": machine(),
        "command": " ".join(sys.argv),
        "environment": RETAIN_ENV,
        "seq_len": args.seq_len,
        "rows": rows,
    }
    path = write_json(args.out, payload)
    print(table(rows, ["cp", "rank", "tokens", "step_s", "peak_MiB", "kda_s", "mla_s"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
