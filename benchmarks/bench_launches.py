"""ATen ops (kernel launches, glm53.profiling.KernelLaunches) per KDA layer per training step, with the CPU's chunk
budgets and with the CUDA ones (kernels/budgets.py, simulated on CPU tensors). Not a test.

    python benchmarks/bench_launches.py                    # T = 1024 and 4096
    python benchmarks/bench_launches.py --seqlens 4096 --top 15

Legend: T tokens of one sequence. The layer is model/kda.KimiDeltaAttention at the released KDA widths (64 heads
x 128, conv 4, the -5 bounded gate) with a 512-wide residual stream (the projections' widths do not change the
op count); one step = its forward and backward (loss = sum of squares of the output). Views are not counted;
an eager CUDA op launches at least one kernel, so these are lower bounds on launches.
Results: benchmarks/results/bench_launches.json.
"""

from __future__ import annotations

import argparse

import torch
from bench_config import machine, positive_int, table, write_json

from glm53 import Glm53Config
from glm53.kernels.budgets import simulate_device
from glm53.model.kda import KimiDeltaAttention
from glm53.profiling import KernelLaunches


def kda_layer_launches(T: int, device_kind: str) -> KernelLaunches:
    config = Glm53Config(hidden_size=512, num_hidden_layers=1, vocab_size=256, pad_token_id=0)
    layer = KimiDeltaAttention(config)
    x = torch.randn(1, T, config.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with simulate_device(device_kind), KernelLaunches() as ops:
        layer(x).square().sum().backward()
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=positive_int, nargs="+", default=[1024, 4096])
    parser.add_argument("--top", type=positive_int, default=10, help="most frequent ops listed per row")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    rows = []
    for T in args.seqlens:
        for kind in ("cpu", "cuda"):
            ops = kda_layer_launches(T, kind)
            top = " ".join(f"{name}={n}" for name, n in ops.counts.most_common(args.top))
            rows.append({"T": T, "budgets": kind, "ops_per_kda_layer_step": ops.total, "top_ops": top})
            print(rows[-1], flush=True)
    print(table(rows, list(rows[0])))
    print("wrote", write_json("bench_launches.json", {"machine": machine(), "rows": rows}))


if __name__ == "__main__":
    main()
