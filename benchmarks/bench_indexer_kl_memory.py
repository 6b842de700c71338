"""Peak memory of one MLA layer's forward + backward with the indexer KL, stored [B, T, P] record vs recomputed.

    python benchmarks/bench_indexer_kl_memory.py                          # T = 8K, 16K, 32K at the bench widths
    python benchmarks/bench_indexer_kl_memory.py --seqlens 1024 2048 --mode sparse
    python benchmarks/bench_indexer_kl_memory.py --seqlens 8192 --variants recompute --compile aot_eager
    python benchmarks/bench_indexer_kl_memory.py --seqlens 8192 --variants recompute --documents 8

One MultiHeadLatentAttention layer (a full indexer, B = 1, fp32, CPU) runs forward with the indexer KL's record
(`ForwardContext(record_indexer=True)`), then `indexer_kl_terms` on its stats plus a linear function of its output,
and backward. "stored": `set_numerics(indexer_kl_recompute=False)`, the layer keeps [B, T, P] fp32 scores and pool
mass and [B, T, P] bool masks (P = T / index_kpool); "recompute": the default, O(T) inputs and the blocked op
(losses/indexer_kl.py). The [B, T, P] tensors' size does not depend on the layer's widths, so the quadratic term
shows at narrow widths; the linear terms (the MLA's own activations) scale with them. Defaults: hidden 256,
4 heads of 64 (q_lora 192, kv_lora 128), indexer 4 heads of 32, k-pool 4 (the release's), top-k 256: the released
widths (64 heads x 256, hidden 4096, indexer 32 x 128) do not fit this 24 GiB shared machine at 32K in fp32 (the
per-head keys alone are 2 GiB per layer there) nor run in minutes on 2 cores.

Each point runs in a fresh child process: it builds the layer and its input, records its RSS, resets VmHWM, runs the
step and reports the peak RSS growth (what the step allocated at its worst moment, parameters excluded).
`--compile BACKEND`: the step (the layer's forward and the indexer KL) runs as torch.compile(backend=BACKEND,
static shapes) of one function, forward and backward traced (the recomputing op is a custom op there). The child
first compiles and runs it at T = 64 (imports and compiler state paid), then resets VmHWM and measures the step
at T, its own compilation included (fake tensors: its memory does not grow with T).
`--documents N`: the row packed as N documents of T / N tokens (cu_seqlens; the last takes the remainder).
Results: benchmarks/results/bench_indexer_kl_memory.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench_config import ROOT, positive_int

CHILD = r"""
import sys, torch
sys.path.insert(0, {root!r})
from glm53 import Glm53Config
from glm53.losses import indexer_kl_terms
from glm53.model.context import ForwardContext
from glm53.model.mla import MultiHeadLatentAttention
torch.set_num_threads({threads})
T, variant, mode, documents = {seqlen}, {variant!r}, {mode!r}, {documents}
config = Glm53Config.tiny(
    hidden_size={hidden}, num_attention_heads={heads}, num_key_value_heads={heads}, qk_nope_head_dim={head_dim},
    v_head_dim={head_dim}, q_lora_rank={q_lora}, kv_lora_rank={kv_lora}, index_n_heads={index_heads},
    index_head_dim={index_head_dim}, index_kpool=4, index_topk={topk}, layer_types=["indexed_attention"] * 4,
)
torch.manual_seed(0)
layer = MultiHeadLatentAttention(config, 0)
layer.init_weights()
layer.kl_recompute = variant == "recompute"
def boundaries(T):
    if documents == 1:
        return None
    return torch.tensor([i * (T // documents) for i in range(documents)] + [T])
def step(x, g, cu_seqlens):
    valid = torch.ones(x.shape[:2], dtype=torch.bool)
    ctx = ForwardContext(valid=valid, cu_seqlens=cu_seqlens, collect_stats=True, record_indexer=True).for_layer()
    out, _ = layer(x, ctx)
    kl = indexer_kl_terms([ctx.stats], valid, mode)[0]
    return (out * g).mean() + kl, kl.detach()
def inputs(T):
    return torch.randn(1, T, config.hidden_size), torch.randn(1, T, config.hidden_size)
if {backend!r} != "none":
    step = torch.compile(step, backend={backend!r}, dynamic=False)
    step(*inputs(64), boundaries(64))[0].backward()
    layer.zero_grad(set_to_none=True)
torch.manual_seed(1)  # the measured inputs: the same with and without the warm-up's draw
x, g = inputs(T)
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM
base = rss("VmRSS:")
cu_seqlens = boundaries(T)
loss, kl = step(x, g, cu_seqlens)
loss.backward()
print(rss("VmHWM:") - base, float(kl))
"""

VARIANTS = ("stored", "recompute")


def run(variant: str, seqlen: int, args) -> tuple[int, float, float]:
    code = CHILD.format(
        root=ROOT,
        threads=args.threads,
        seqlen=seqlen,
        variant=variant,
        mode=args.mode,
        hidden=args.hidden,
        heads=args.heads,
        head_dim=args.head_dim,
        q_lora=args.q_lora,
        kv_lora=args.kv_lora,
        index_heads=args.index_heads,
        index_head_dim=args.index_head_dim,
        topk=args.topk,
        backend=args.compile,
        documents=args.documents,
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), float(out[1]), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", nargs="+", type=positive_int, default=[8192, 16384, 32768])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--mode", choices=("dense", "sparse"), default="dense")
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--q-lora", type=positive_int, default=192)
    p.add_argument("--kv-lora", type=positive_int, default=128)
    p.add_argument("--index-heads", type=positive_int, default=4)
    p.add_argument("--index-head-dim", type=positive_int, default=32)
    p.add_argument("--topk", type=positive_int, default=256)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--compile", default="none", choices=("none", "aot_eager", "inductor"), help="torch.compile backend")
    p.add_argument("--documents", type=positive_int, default=1, help="packed documents per row (1: unpacked)")
    p.add_argument("--out", default="bench_indexer_kl_memory.json")
    args = p.parse_args()
    rows = {}
    for T in args.seqlens:  # one at a time: each peak is measured alone
        for v in args.variants:
            rows[(v, T)] = run(v, T, args)
            peak, kl, secs = rows[(v, T)]
            print(f"  {v:>9} T={T}: {peak / 2**20:.1f} MiB, KL {kl:.6f}, {secs:.0f} s", flush=True)
    print(
        f"one MLA layer fwd+bwd with the indexer KL ({args.mode}), B=1 fp32 CPU, hidden {args.hidden}, "
        f"{args.heads}x{args.head_dim} heads, indexer {args.index_heads}x{args.index_head_dim}, k-pool 4, "
        f"compile {args.compile}, {args.documents} document(s)"
    )
    print(
        f"{'T':>6}  {'[T, P] fp32 MiB':>15}"
        + "".join(f"  {v + ' MiB':>14}" for v in args.variants)
        + "  recompute/stored  MiB per 1K tokens (recompute)"
    )
    for T in args.seqlens:
        cells = "".join(f"  {rows[(v, T)][0] / 2**20:14.1f}" for v in args.variants)
        ratio = ""
        if set(VARIANTS) <= set(args.variants):
            ratio = f"  {rows[('recompute', T)][0] / rows[('stored', T)][0]:16.3f}"
        per_k = ""
        if "recompute" in args.variants:
            per_k = f"  {rows[('recompute', T)][0] / 2**20 / (T / 1024):10.2f}"
        print(f"{T:>6}  {T * (T // 4) * 4 / 2**20:15.1f}{cells}{ratio}{per_k}")
    result = {
        "command": "python benchmarks/bench_indexer_kl_memory.py " + " ".join(sys.argv[1:]),
        "mode": args.mode,
        "compile": args.compile,
        "documents": args.documents,
        "widths": {
            k: getattr(args, k)
            for k in ("hidden", "heads", "head_dim", "q_lora", "kv_lora", "index_heads", "index_head_dim", "topk")
        },
        "points": [
            {"variant": v, "seqlen": T, "peak_bytes": peak, "kl": kl, "seconds": secs}
            for (v, T), (peak, kl, secs) in rows.items()
        ],
    }
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", args.out), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
