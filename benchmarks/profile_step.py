"""Where one glm53 training step goes: op categories, kernels and modules, top ops (torch.profiler). Not a test.

    python benchmarks/profile_step.py                     # bench config, T = 2048, 1 thread
    python benchmarks/profile_step.py --seqlen 512 --threads 2 --top 25
    python benchmarks/profile_step.py --compile           # blocks compiled by inductor (glm53/model/compile.py)

Legend: T time (tokens of the one sequence), P active matmul parameters (bench_model.active_matmul_params).
The step is bench_model's (CE over the returned logits, backward). Timings use the thread's CPU time, which a
shared machine inflates far less than wall time (exact only with --threads 1). Shares are of the profiler's
summed self time. "GEMM" = aten::mm / addmm / _grouped_mm, the matmuls MFU counts (6 * P * T FLOPs); "batched
small matmuls" = bmm / baddbmm / triangular solves (KDA's intra-chunk work, sparse attention, mHC's per-token
N x N mixes), which MFU does not count. Regions: inclusive time of each kernel op ("K:"), module forward ("M:")
and autograd backward node, forward and backward apart. Set the retaining allocator as bench_model does
(MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_), else page faults dominate.
"By owner" splits the same self time by who ran it: the inside of each glm53 custom op (opaque to torch.compile:
its elementwise work is never fused), inductor's generated kernels and graph wrappers, GEMMs and other ATen calls
outside custom ops. With --compile the regions are not labelled (the labels would sit inside compiled graphs).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_config import bench_config, positive_int
from bench_model import active_matmul_params, seeded_ids
from torch.profiler import ProfilerActivity, profile, record_function

from glm53 import Glm53ForCausalLM
from glm53.kernels import dispatch
from glm53.model import hyper_connection, kda, mla, mlp, moe, norm

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::_grouped_mm")
SMALL_MATMUL_OPS = ("aten::bmm", "aten::baddbmm", "aten::linalg_solve_triangular")
COPY_OPS = (
    "aten::copy_",
    "aten::fill_",
    "aten::cat",
    "aten::stack",
    "aten::index_select",
    "aten::index",
    "aten::index_add_",
    "aten::scatter_add_",
    "aten::index_put_",
    "aten::flip",
    "aten::constant_pad_nd",
)


def label_regions() -> None:
    """Wrap every kernel call and the main modules' forwards in profiler ranges (this process only)."""
    chosen = dispatch.kernel

    def kernel(op):
        fn = chosen(op)

        def labelled(*args, **kwargs):
            with record_function("K:" + op):
                return fn(*args, **kwargs)

        return labelled

    for module in (hyper_connection, kda, mla, moe):
        module.kernel = kernel
    for cls, name in (
        (hyper_connection.HyperConnection, "coefficients"),
        (kda.KimiDeltaAttention, "forward"),
        (moe.Router, "forward"),
        (moe.MoE, "forward"),
        (mla.MultiHeadLatentAttention, "forward"),
        (norm.RMSNorm, "forward"),
        (mlp.MLP, "forward"),
    ):
        setattr(cls, name, _labelled(getattr(cls, name), f"M:{cls.__name__}.{name}"))


def _labelled(method, label):
    def wrapper(self, *args, **kwargs):
        with record_function(label):
            return method(self, *args, **kwargs)

    return wrapper


def cpu_gemm_peak(n: int = 1024, reps: int = 5) -> float:
    """fp32 GEMM FLOP/s on this thread's CPU time (bench_config.gemm_peak_flops uses wall time)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        a @ b
        best = min(best, time.thread_time() - start)
    return 2 * n**3 / best


def category(name: str) -> str:
    if name in GEMM_OPS:
        return "GEMM (counted by MFU)"
    if name in SMALL_MATMUL_OPS:
        return "batched small matmuls"
    if name in COPY_OPS:
        return "copies / fills / gathers"
    if "cpp_fused" in name:
        return "inductor generated kernels"
    return "elementwise / reductions / other aten" if name.startswith("aten::") else "autograd + Python overhead"


def owner(event) -> str:
    """Who ran a profiler event: the outermost glm53 custom op around it, inductor, or eager ATen outside both."""
    op, parent = None, event
    while parent is not None:
        if parent.name.startswith("glm53::"):
            op = parent.name
        parent = parent.cpu_parent
    if op is not None:
        return "inside custom op " + op.removeprefix("glm53::").removesuffix("_backward") + " (fwd+bwd)"
    if "cpp_fused" in event.name:
        return "inductor generated kernels"
    if "CompiledFxGraph" in event.name or "Compiled" in event.name or "Dynamo" in event.name:
        return "inductor graph wrappers / dynamo guards"
    if event.name in GEMM_OPS:
        return "GEMMs outside custom ops"
    if event.name in SMALL_MATMUL_OPS:
        return "batched small matmuls outside custom ops"
    return "other ATen outside custom ops" if event.name.startswith("aten::") else "autograd + Python overhead"


def report_owners(events) -> None:
    shares: dict[str, float] = {}
    for e in events:
        shares[owner(e)] = shares.get(owner(e), 0.0) + e.self_cpu_time_total
    total = sum(shares.values())
    print("\nby owner (self time):")
    for name, t in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {name:55s} {t / 1e3:8.1f} ms {t / total:6.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=positive_int, default=2048)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--top", type=positive_int, default=15)
    ap.add_argument("--compile", action="store_true", help="compile every block with inductor (static shapes)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = bench_config()
    model = Glm53ForCausalLM(config)
    ids = seeded_ids(config, args.seqlen)

    def step():
        model.train()
        model.zero_grad(set_to_none=True)
        with record_function("R:forward"):
            logits = model(ids).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        with record_function("R:backward"):
            loss.backward()

    if args.compile:
        from glm53.model.compile import compile_blocks

        torch._inductor.config.cpp.enable_kernel_profile = True  # each generated kernel a profiler event
        compile_blocks(model)
    else:
        label_regions()
    start = time.perf_counter()
    step()
    print(f"first step (compilation included with --compile) {time.perf_counter() - start:.1f} s", flush=True)
    times = []
    for _ in range(3):
        start = time.thread_time()
        step()
        times.append(time.thread_time() - start)
    peak, best = cpu_gemm_peak(), min(times)
    flops = 6 * active_matmul_params(config) * args.seqlen
    print(
        f"T={args.seqlen} threads={args.threads}: step {best:.3f} s CPU (of {[round(t, 3) for t in times]}), "
        f"GEMM peak {peak / 1e9:.1f} GFLOP/s, MFU {flops / best / peak:.1%}"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    report(prof.key_averages(), args.top, flops, peak, best)
    report_owners(prof.events())


def report(events, top: int, flops: float, peak: float, step_s: float) -> None:
    total = sum(e.self_cpu_time_total for e in events)
    shares: dict[str, float] = {}
    for e in events:
        shares[category(e.key)] = shares.get(category(e.key), 0.0) + e.self_cpu_time_total
    print(f"\nprofiled self time {total / 1e3:.0f} ms; by category:")
    for name, t in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {t / 1e3:8.1f} ms {t / total:6.1%}")
    gemm = shares.get("GEMM (counted by MFU)", 0.0) / total * step_s  # the GEMMs' share of the timed step
    if gemm:
        print(f"counted FLOPs / GEMM time = {flops / gemm / peak:.0%} of the GEMM peak (MFU if nothing else ran)")
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)
    print(f"\ntop {top} ops by self time:")
    for e in [e for e in ranked if not e.key.startswith(("K:", "M:", "R:"))][:top]:
        print(
            f"  {e.key[:48]:48s} {e.self_cpu_time_total / 1e3:8.1f} ms {e.self_cpu_time_total / total:6.1%} "
            f"{e.count:6d} calls"
        )
    regions = [
        e
        for e in events
        if e.key.startswith(("K:", "M:", "R:")) or e.key.startswith("autograd::engine::evaluate_function")
    ]
    print(f"\nregions (inclusive time; forward K:/M:, backward autograd nodes), top {top + 10}:")
    for e in sorted(regions, key=lambda e: -e.cpu_time_total)[: top + 10]:
        name = e.key.replace("autograd::engine::evaluate_function: ", "bwd ")
        print(f"  {name[:70]:70s} {e.cpu_time_total / 1e3:8.1f} ms {e.cpu_time_total / total:6.1%} {e.count:5d}")


if __name__ == "__main__":
    main()
