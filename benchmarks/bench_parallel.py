"""Bytes communicated per MoE layer per training step: FSDP only vs expert parallelism, at world 4 (gloo).

    python benchmarks/bench_parallel.py [--tokens 1024]

One MoE layer of the bench config (benchmarks/bench_config.py) on 4 spawned CPU/gloo ranks, parallelized as
`glm53.parallel.parallelize` does it: "fsdp4" (dp 4: experts FSDP-sharded with the rest), "dp2xep2" and "ep4"
(experts Shard(0) over ep with all-to-all dispatch, FSDP over dp for the experts and over dp x ep for the router
and shared expert). Every rank runs forward + backward on its own `--tokens` tokens; the collectives it issues
are counted at dispatch (glm53.parallel.comm.CommBytes: bytes leaving the rank). The analytic counts of
`glm53.tools.plan.moe_comm_bytes` (uniform routing) are printed beside them, then for the released config at
several layouts. Then the composed layouts (bench_composed.py): tp x ep, cp x ep, cp x tp, dp x cp at world 4
and dp x tp x ep, tp x ep x cp at world 8, the model-parallel bytes each rank sends per MoE, MLA and KDA layer
counted against glm53.tools.comm_model; and the planner's per-rank memory and bytes per layer for the released
model at 131,072 tokens, cp x ep against dp x cp alone. Writes benchmarks/results/bench_parallel.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.multiprocessing as mp
import torch.nn as nn
from bench_config import bench_config, machine, positive_int, write_json

from glm53 import Glm53Config
from glm53.tools.plan import moe_comm_bytes

WORLD = 4
LAYOUTS = {"fsdp4": (4, 1), "dp2xep2": (2, 2), "ep4": (1, 4)}  # name -> (dp, ep)
RELEASED = [(64, 1), (8, 8), (2, 32), (1, 64)]  # released config, 64 ranks
MB = 1e6


class _Root(nn.Module):
    """The FSDP root around the MoE unit (a root unit keeps its parameters gathered between forward and backward)."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x)


def shard_moe(moe, dp: int, ep: int):
    """FSDP (and EP) on one MoE module the way parallelize shards a block's MoE; -> the root module to call
    (the MoE is a non-root unit, so it reshards after forward like a decoder block)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from glm53.parallel.expert import apply_expert_parallel, expert_shard_placement
    from glm53.parallel.mesh import flat_mesh

    if ep == 1:
        mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        fully_shard(moe.experts, mesh=mesh, shard_placement_fn=expert_shard_placement(dp, ep_sharded=False))
        fully_shard(moe, mesh=mesh)
        return fully_shard(_Root(moe), mesh=mesh)
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    apply_expert_parallel(moe, mesh["ep"])
    fully_shard(moe.experts, mesh=mesh["dp"], shard_placement_fn=expert_shard_placement(dp, ep_sharded=True))
    flat = flat_mesh(mesh, ("dp", "ep"))
    fully_shard(moe, mesh=flat)
    return fully_shard(_Root(moe), mesh=flat)


def _worker(rank: int, init_file: str, tokens: int, results) -> None:
    import torch.distributed as dist

    from glm53.model.moe import MoE
    from glm53.parallel.comm import CommBytes

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    config = bench_config()
    out = {}
    for name, (dp, ep) in LAYOUTS.items():
        torch.manual_seed(0)
        moe = MoE(config)
        moe.init_weights()
        root = shard_moe(moe, dp, ep)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, config.hidden_size, generator=g, requires_grad=True)  # its gradient crosses too
        with CommBytes() as comm:
            root(x[None]).square().mean().backward()
        out[name] = dict(bytes=dict(comm.bytes), calls=dict(comm.calls))
        dist.barrier()
    results.put((rank, out))
    dist.destroy_process_group()


def measure(tokens: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, os.path.join(tmp, "init"), tokens, results)) for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=300) for _ in procs)
        for p in procs:
            p.join()
    return [got[r] for r in range(WORLD)]


def _row(name: str, sent: dict, analytic: dict) -> str:
    kinds = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
    cells = " ".join(f"{sent.get(k, 0) / MB:>10.3f}" for k in kinds)
    total = sum(sent.values()) / MB
    return f"| {name:<22} | {cells} | {total:>9.3f} | {sum(analytic.values()) / MB:>9.3f} |"


KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
LONG = [(2, 1, 1, 16), (1, 1, 8, 4), (1, 1, 16, 2), (1, 2, 8, 2)]  # released model at 131,072 tokens: (dp, tp, ep, cp)


def composed(seq: int) -> dict:
    """Counted vs analytic model-parallel bytes per layer on every composed layout (mean over ranks)."""
    from bench_composed import COMPOSED, analytic, bench_model_config, measure

    config, out = bench_model_config(), {}
    print(
        f"\ncomposed layouts (tiny hybrid model, hidden 64, one sequence of {seq} tokens per data rank, fp32): "
        "bytes sent per rank per layer per step, model-parallel collectives only (FSDP's: its own row)"
    )
    print("| layout        | layer | counted (all_gather / reduce_scatter / all_to_all / all_reduce) | analytic |")
    for world, layouts in COMPOSED.items():
        ranks = measure(world, 1, seq)
        for name, (dp, tp, ep, cp) in layouts.items():
            rows = {}
            for key in sorted(ranks[0][name]):
                sent = {k: sum(r[name].get(key, {}).get(k, 0) for r in ranks) / world for k in KINDS}
                layer = key.split(".")[-1]
                ana = analytic(config, layer, dp, tp, ep, cp, 1, seq) if layer in ("moe", "mla", "kda") else None
                rows[key] = dict(counted=sent, analytic=ana)
                cells = " / ".join(f"{sent[k]:.0f}" for k in KINDS)
                ana_cells = " / ".join(f"{ana[k]}" for k in KINDS) if ana else "-"
                print(f"| {name:<13} | {key:<5} | {cells:<63} | {ana_cells} |")
            out[name] = dict(world=world, degrees=dict(dp=dp, tp=tp, ep=ep, cp=cp), layers=rows)
    return out


def long_context() -> dict:
    """The planner for the released model at 131,072 tokens (bf16, activation checkpointing): cp x ep vs dp x cp."""
    from glm53.tools.plan import GIB, parse_args, plan

    print("\nreleased model, 131,072 tokens per sequence, bf16, activation checkpointing (glm53.tools.plan): per rank")
    print("| layout             | ranks | total GiB | experts GiB | MoE layer GB sent | MLA layer GB | KDA layer GB |")
    out = {}
    for dp, tp, ep, cp in LONG:
        args = parse_args(
            [
                "--dp",
                str(dp),
                "--tp",
                str(tp),
                "--ep",
                str(ep),
                "--cp",
                str(cp),
                "--seq-len",
                "131072",
                "--activation-checkpointing",
                "--device-gib",
                "141",
            ]
        )
        r = plan(args)
        name = f"dp{dp}xtp{tp}xep{ep}xcp{cp}"
        layer = {k: sum(v.values()) for k, v in r["layers"].items()}
        out[name] = dict(total_gib=r["total"] / GIB, expert_gib=r["measured"]["expert"] / GIB, layers=r["layers"])
        print(
            f"| {name:<18} | {dp * tp * ep * cp:>5} | {r['total'] / GIB:>9.1f} | {r['measured']['expert'] / GIB:>11.1f} "
            f"| {layer['moe'] / 1e9:>17.2f} | {layer['mla'] / 1e9:>12.2f} | {layer['kda'] / 1e9:>12.2f} |"
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens per rank")
    p.add_argument("--seq", type=positive_int, default=64, help="composed layouts: tokens per data rank's sequence")
    args = p.parse_args()
    ranks = measure(args.tokens)
    config = bench_config()
    print(
        f"bench config, world {WORLD}, {args.tokens} tokens per rank, fp32: MB sent per rank (mean over ranks) "
        f"per MoE layer per step; analytic = glm53.tools.plan.moe_comm_bytes (uniform routing)"
    )
    print("| layout                 | all_gather reduce_sc. all_to_all all_reduce |   total   |  analytic |")
    rows = {}
    for name, (dp, ep) in LAYOUTS.items():
        analytic = moe_comm_bytes(config, dp, ep, args.tokens, 4)
        kinds = {k for r in ranks for k in r[name]["bytes"]}
        sent = {k: sum(r[name]["bytes"].get(k, 0) for r in ranks) / WORLD for k in kinds}  # mean over ranks
        rows[name] = dict(
            measured=ranks[0][name], per_rank_total=[sum(r[name]["bytes"].values()) for r in ranks], analytic=analytic
        )
        print(_row(name, sent, analytic))
    released = Glm53Config()
    print(
        f"\nreleased config, bf16, 4096 tokens per rank, {RELEASED[0][0]} ranks: GB sent per rank per MoE layer "
        f"per step (analytic)"
    )
    rel = {}
    for dp, ep in RELEASED:
        b = moe_comm_bytes(released, dp, ep, 4096, 2)
        rel[f"dp{dp}xep{ep}"] = b
        print(
            f"| dp {dp:>3} x ep {ep:>3} | "
            + " ".join(f"{k} {v / 1e9:.3f}" for k, v in b.items())
            + f" | total {sum(b.values()) / 1e9:.3f} |"
        )
    composed_rows, long_rows = composed(args.seq), long_context()
    path = write_json(
        "bench_parallel.json",
        dict(
            machine=machine(),
            tokens=args.tokens,
            world=WORLD,
            bench_config=rows,
            released=rel,
            composed=composed_rows,
            long_context=long_rows,
        ),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
