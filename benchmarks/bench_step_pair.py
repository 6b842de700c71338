"""Paired training-step time of two glm53 trees (e.g. an old commit and the new one), alternating processes.

    python benchmarks/bench_step_pair.py OLD_TREE NEW_TREE --rounds 4 --T 256 --steps 5

Each round runs one child process per tree (old, new, old, new, ...); a child builds `bench_config()` from seed 0,
runs one warm-up step, then `--steps` training steps (forward with labels, return_logits=False, backward: what
the trainer does) and reports the median step in CPU time of the process (`time.process_time`, one thread) and in
wall time. CPU time is what makes a paired comparison usable on a shared, oversubscribed machine: waiting for a
core does not count, the work does. The ratio new / old is the median of the per-round ratios; the spread is their
min and max. Results: benchmarks/results/bench_step_pair.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_config import positive_int

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from bench_config import bench_config
from glm53 import Glm53ForCausalLM
torch.set_num_threads(1)
torch.manual_seed(0)
model = Glm53ForCausalLM(bench_config()).train()
ids = torch.randint(1, model.config.vocab_size, (1, {T}), generator=torch.Generator().manual_seed({T}))
def step():
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, return_logits=False).loss.backward()
step()
cpu, wall = [], []
for _ in range({steps}):
    c, w = time.process_time(), time.perf_counter()
    step()
    cpu.append(time.process_time() - c)
    wall.append(time.perf_counter() - w)
print(json.dumps({{"cpu": sorted(cpu)[len(cpu) // 2], "wall": sorted(wall)[len(wall) // 2]}}))
"""


def run_child(tree: str, T: int, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    code = CHILD.format(bench=os.path.join(tree, "benchmarks"), T=T, steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tree, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=positive_int, default=4)
    ap.add_argument("--T", type=positive_int, default=256)
    ap.add_argument("--steps", type=positive_int, default=5)
    ap.add_argument("--out", default="bench_step_pair.json")
    args = ap.parse_args()
    for tree in (args.old, args.new):
        if not os.path.isfile(os.path.join(tree, "glm53", "__init__.py")):
            ap.error(f"{tree} is not a glm53 tree (no glm53/__init__.py in it)")
    rounds = []
    for i in range(args.rounds):
        old, new = run_child(args.old, args.T, args.steps), run_child(args.new, args.T, args.steps)
        ratios = {"cpu_ratio": new["cpu"] / old["cpu"], "wall_ratio": new["wall"] / old["wall"]}
        rounds.append({"old": old, "new": new, **ratios})
        print(
            f"round {i}: old cpu {old['cpu']:.3f}s wall {old['wall']:.3f}s | new cpu {new['cpu']:.3f}s wall "
            f"{new['wall']:.3f}s | new/old cpu {rounds[-1]['cpu_ratio']:.3f} wall {rounds[-1]['wall_ratio']:.3f}",
            flush=True,
        )
    cpu = [r["cpu_ratio"] for r in rounds]
    wall = [r["wall_ratio"] for r in rounds]
    summary = {
        "T": args.T,
        "steps": args.steps,
        "rounds": rounds,
        "cpu_ratio_median": statistics.median(cpu),
        "cpu_ratio_min": min(cpu),
        "cpu_ratio_max": max(cpu),
        "wall_ratio_median": statistics.median(wall),
        "wall_ratio_min": min(wall),
        "wall_ratio_max": max(wall),
        "command": " ".join(sys.argv),
    }
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results", args.out)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nnew/old step time, median of {args.rounds} paired rounds (min .. max):")
    print(f"  CPU time  {summary['cpu_ratio_median']:.3f}  ({min(cpu):.3f} .. {max(cpu):.3f})")
    print(f"  wall time {summary['wall_ratio_median']:.3f}  ({min(wall):.3f} .. {max(wall):.3f})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
