"""Each kernel op, every registered backend (reference vs fast), over sequence lengths: a table + JSON.

    python benchmarks/bench_kernels.py                 # T in {512, 1024, 2048, 4096}
    python benchmarks/bench_kernels.py --quick         # T in {512, 2048}, 3 reps
    python benchmarks/bench_kernels.py --seqlens 1024 --ops kda sparse_mqa_attention
    python benchmarks/bench_kernels.py --released [--seqlens 1024]  # GLM-5.3 widths at T = 4096, + peak memory
    python benchmarks/bench_kernels.py --released --seqlens 1024 4096 --threads 2  # + the references at 1024

Shapes follow the bench model (issue 5): KDA 4 heads x 64, MLA 4 heads x 64 with kv_lora 64 and 271 slots
(index_topk 256 + a 15-token tail), 16 experts top-4 of width 128 on hidden 256, indexer 4 heads x 32 over
T/16 pools, 4 mHC streams. Times are medians; "fwd" under no_grad, "fwd+bwd" with a random cotangent.
Results: benchmarks/results/bench_kernels.json (--released: bench_kernels_released.json; shapes, rows and the
memory measurement in released_widths.py). --released defaults to 1 repetition (each call takes seconds there)
and runs the O(T^2) dense references only up to --skip-reference-above.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from bench_config import machine, median, non_negative_int, positive_int, table, timed, write_json

from glm53.kernels import backends
from glm53.kernels.dispatch import _REGISTRY

TOPK, KPOOL = 256, 16
DEFAULT_OPS = [
    "kda",
    "sparse_attention",
    "sparse_mqa_attention",
    "moe_experts",
    "indexer_scores",
    "hc_collapse",
    "hc_mix",
    "hc_project",
    "sinkhorn",
    "causal_conv1d",
    "rms_norm",
    "gated_rms_norm",
]


def causal_topk(T: int, J: int) -> torch.Tensor:
    """[1, T, J] distinct causal key positions per query (random scores), -1 where fewer than J are visible."""
    scores = torch.rand(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -1.0)
    values, idx = scores.topk(min(J, T), dim=-1)
    idx = idx.masked_fill(values < 0, -1)
    return F.pad(idx, (0, J - idx.shape[-1]), value=-1)[None]


def inputs(op: str, T: int):
    """(positional tensors needing grad, other args) for one op at sequence length T."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    J = TOPK + KPOOL - 1
    if op == "kda":
        q, k = F.normalize(rnd(1, T, 4, 64), dim=-1), F.normalize(rnd(1, T, 4, 64), dim=-1)
        gate = -5 * torch.rand(1, T, 4, 64, generator=g)
        return [q, k, rnd(1, T, 4, 64), gate, torch.rand(1, T, 4, generator=g)], []
    if op == "sparse_attention":
        return [rnd(1, T, 4, 64), rnd(1, T, 4, 64), rnd(1, T, 4, 64)], [causal_topk(T, J), 0.125]
    if op == "sparse_mqa_attention":
        return [rnd(1, T, 4, 64), rnd(1, T, 64)], [causal_topk(T, J), 0.125]
    if op == "moe_experts":
        idx = torch.rand(T, 16, generator=g).topk(4, dim=-1).indices
        x, w = rnd(T, 256), torch.rand(T, 4, generator=g)
        return [x, w, rnd(16, 256, 256) / 16, rnd(16, 256, 128) / 11], [idx]
    if op == "indexer_scores":
        return [rnd(1, T, 4, 32), rnd(1, T, 4), rnd(1, -(-T // KPOOL), 32)], [32**-0.5]
    if op == "hc_collapse":
        return [torch.rand(1, T, 4, generator=g), rnd(1, T, 4, 256)], []
    if op == "hc_mix":
        comb, post = torch.rand(1, T, 4, 4, generator=g), 2 * torch.rand(1, T, 4, generator=g)
        return [rnd(1, T, 4, 256), comb, post, rnd(1, T, 256)], []
    if op == "hc_project":
        return [rnd(1, T, 1024), rnd(24, 1024) / 32], [1e-5]
    if op == "sinkhorn":
        return [torch.softmax(rnd(1, T, 4, 4), -1) + 1e-6], [20, 1e-6]
    if op == "rms_norm":
        return [rnd(1, T, 256), 1 + rnd(256)], [1e-5]
    if op == "gated_rms_norm":
        return [rnd(1, T, 4, 64), rnd(1, T, 4, 64), 1 + rnd(64)], [1e-5]
    if op == "causal_conv1d":
        return [rnd(1, T, 256), rnd(256, 4)], []
    raise KeyError(op)


def call(op: str, fn, tensors, extra):
    if op == "moe_experts":  # signature (x, topk_idx, topk_weight, gate_up, down, limit)
        x, w, gate_up, down = tensors
        return fn(x, extra[0], w, gate_up, down, 10.0)
    out = fn(*tensors, *extra)
    return out[0] if isinstance(out, tuple) else out


def run(op: str, backend: str, T: int, reps: int) -> dict:
    fn = _REGISTRY[op][backend]
    tensors, extra = inputs(op, T)
    with torch.no_grad():
        call(op, fn, tensors, extra)
        fwd = median([timed(lambda: call(op, fn, tensors, extra)) for _ in range(reps)])
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = call(op, fn, leaves, extra)
    cot = torch.randn_like(out)

    def step():
        torch.autograd.grad(call(op, fn, leaves, extra), leaves, cot, allow_unused=True)

    step()
    both = median([timed(step) for _ in range(reps)])
    return {"fwd_ms": round(1e3 * fwd, 2), "fwd_bwd_ms": round(1e3 * both, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T in {512, 2048}")
    ap.add_argument("--seqlens", type=positive_int, nargs="+")
    ap.add_argument("--reps", type=positive_int, default=None, help="default 3 (--released: 1)")
    ap.add_argument("--ops", nargs="+", help="default: every op (with --released: released_widths.OPS)")
    ap.add_argument(
        "--skip-recurrent-above",
        type=non_negative_int,
        default=2048,
        help="skip KDA's token-by-token reference above this T (it is a Python loop)",
    )
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="file name under benchmarks/results/")
    ap.add_argument(
        "--released",
        action="store_true",
        help="the released widths (released_widths.py) at T = 4096 (or --seqlens), with peak memory",
    )
    ap.add_argument(
        "--skip-reference-above",
        type=non_negative_int,
        default=2048,
        help="--released: skip the dense references above this T (the absorbed one is O(T^2) memory)",
    )
    args = ap.parse_args()
    args.reps = args.reps or (1 if args.released else 3)
    torch.set_num_threads(args.threads)
    if args.released:
        return released(args)
    args.ops = args.ops or DEFAULT_OPS
    seqlens = args.seqlens or ([512, 2048] if args.quick else [512, 1024, 2048, 4096])
    rows = []
    for op in args.ops:
        for T in seqlens:
            timings = {}
            for backend in backends(op):
                if op == "kda" and backend == "reference" and T > args.skip_recurrent_above:
                    continue
                timings[backend] = run(op, backend, T, args.reps)
            fast = timings.get("eager")
            for backend, t in timings.items():
                row = {"op": op, "T": T, "backend": backend, **t}
                if fast and backend != "eager":
                    row["eager_speedup_fwd_bwd"] = round(t["fwd_bwd_ms"] / fast["fwd_bwd_ms"], 2)
                rows.append(row)
                print(f"{op:22s} T={T:5d} {backend:10s} {t}", file=sys.stderr, flush=True)
    path = write_json(
        args.out or "bench_kernels.json",
        {"machine": machine(), "command": " ".join(sys.argv), "threads": args.threads, "rows": rows},
    )
    print(table(rows, ["op", "T", "backend", "fwd_ms", "fwd_bwd_ms", "eager_speedup_fwd_bwd"]))
    print(f"wrote {path}")


def released(args) -> None:
    from released_widths import OPS, released_rows

    ops = None if args.ops is None else [op for op in args.ops if op in OPS]
    rows = released_rows(args.seqlens or [4096], args.reps, args.threads, ops, args.skip_reference_above)
    path = write_json(
        args.out or "bench_kernels_released.json",
        {"machine": machine(), "command": " ".join(sys.argv), "threads": args.threads, "rows": rows},
    )
    print(table(rows, ["op", "T", "backend", "fwd_ms", "fwd_bwd_ms", "peak_mib"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
