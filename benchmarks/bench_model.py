"""glm53 (fast eager kernels) vs transformers 5.23 eager glm5_next: same weights, same CPU, one paired run.

    python benchmarks/bench_model.py                      # T in {512, 1024, 2048, 4096}, 3 reps, memory at 2048
    python benchmarks/bench_model.py --quick              # T in {512, 2048}, glm53 scaling at 4096/8192
    python benchmarks/bench_model.py --seqlens 1024 2048 --reps 5
    python benchmarks/bench_model.py --quick --compile      # adds glm53 compiled per block (inductor) as a third model

Allocator: by default both models run with glibc told to keep freed memory (RETAIN_ENV below; without it
transformers' step is dominated by page faults, see RESULTS.md), the fair headline; `--allocator default` runs
glibc's defaults, and `--also-default` adds that run (a child process) to the same report. The script re-executes
itself when the environment does not match the requested allocator (glibc reads it at start-up).
Before timing, both models' logits on the same ids must agree (else the run aborts). For each T both models first
run one untimed forward and step (warm-up); then they alternate (glm53, transformers, glm53, ...) and ratios are
medians of the per-pair ratios; the fp32 GEMM peak is measured again before every repetition and its median and
spread are reported. Forward runs under no_grad;
forward+backward is one training step's loss.backward() (CE on the logits). Peak memory of a training step is the peak RSS growth of a fresh child process running one step
(VmHWM, reset just before the step, minus the RSS just before it). MFU = 6 * active matmul parameters * tokens / step time /
fp32 GEMM peak measured in the same run (attention/KDA score flops are not counted: a lower bound).
`--compile`: a copy of glm53 with every block's forward compiled by inductor (glm53.model.compile.compile_blocks,
static shapes: one compile per T and mode) joins the alternation; its first forward and first step at each T are
timed on their own and reported as compile time (first call minus the steady-state median) with inductor's cache
in a fresh folder (cold: no kernel reused from an earlier run), and its logits must equal eager glm53's at every T
before timing. A recompilation inside the timed steps aborts the run (it would hide in the medians). Every block
kind compiles as one graph (glm53/model/compile.py).
Results: benchmarks/results/bench_model.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from bench_config import (
    ROOT,
    bench_config,
    gemm_peak_flops,
    machine,
    median,
    positive_int,
    table,
    timed,
    vm_bytes,
    write_json,
)

from glm53 import Glm53ForCausalLM
from glm53.kernels import chosen_backend

RETAIN_ENV = {"MALLOC_TRIM_THRESHOLD_": "4000000000", "MALLOC_MMAP_THRESHOLD_": "4000000000"}
LOGITS_RTOL = 1e-3  # relative L2 difference of the two models' logits that aborts the run

OPS = (
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
)


def build_pair(path: str):
    """transformers model with random weights saved to `path`, and glm53 loaded from it (the same weights)."""
    from tests.helpers.oracle import hf_model

    config = bench_config()
    hf = hf_model(config, seed=0)
    hf.save_pretrained(path)
    return hf, Glm53ForCausalLM.from_pretrained(path), config


def logits_of(model, ids, is_hf: bool) -> torch.Tensor:
    return model(input_ids=ids).logits if is_hf else model(ids).logits


def forward(model, ids, is_hf):
    model.eval()
    with torch.no_grad():
        logits_of(model, ids, is_hf)


def check_same_logits(hf, ours, config) -> float:
    """Relative L2 difference of the two models' logits on seeded ids; raises when they disagree."""
    ids = torch.randint(1, config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = logits_of(hf.eval(), ids, True).float(), logits_of(ours.eval(), ids, False).float()
    rel = float((a - b).norm() / b.norm())
    if rel > LOGITS_RTOL:
        raise SystemExit(f"glm53 and transformers disagree before timing: relative logits difference {rel:.2e}")
    return rel


def seeded_ids(config, T: int) -> torch.Tensor:
    """The same token ids for both models (and every child process) at length T."""
    return torch.randint(1, config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))


def ensure_allocator(allocator: str) -> None:
    """Re-execute this script with the environment `allocator` asks for, unless it already has it."""
    env = dict(os.environ)
    if allocator == "retain":
        env.update(RETAIN_ENV)
    else:
        for key in RETAIN_ENV:
            env.pop(key, None)
    if env != dict(os.environ):
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


def compiled_copy(model, cache_dir: str):
    """A copy of glm53 with every block compiled by inductor (static shapes, so every T compiles its own graphs).

    Inductor's on-disk cache goes to `cache_dir` (fresh), so the reported compile time is a cold compile.
    """
    from glm53.model.compile import compile_blocks

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir

    # block kinds x {eval, train} x T, plus the frames MLA's graph breaks resume in, exceed dynamo's default of 8
    torch._dynamo.config.recompile_limit = 64
    return compile_blocks(copy.deepcopy(model), backend="inductor", dynamic=False)


def warm_up_compiled(compiled, ours, ids) -> dict:
    """First forward and step of the compiled copy at this T (compilation included); its logits must be eager's."""
    first_fwd = timed(lambda: forward(compiled, ids, False))
    first_step = timed(lambda: train_step(compiled, ids, False))
    with torch.no_grad():
        a, b = logits_of(compiled.eval(), ids, False), logits_of(ours.eval(), ids, False)
    rel = float((a - b).norm() / b.norm())
    if rel > LOGITS_RTOL:
        raise SystemExit(
            f"compiled glm53 disagrees with eager glm53 at T={ids.shape[1]}: relative difference {rel:.2e}"
        )
    return {"first_fwd_s": first_fwd, "first_step_s": first_step, "logits_rel_diff": rel}


def compiled_columns(times: dict, ratio, first: dict) -> dict:
    """The compiled model's entries of one T's row; compile time = first call minus the steady-state median."""
    T_fwd, T_step = median(times["compiled_fwd"]), median(times["compiled_step"])
    return {
        "compiled_step_speedup_vs_hf": round(ratio("hf_step", "compiled_step"), 2),
        "compiled_step_speedup_vs_eager": round(ratio("glm53_step", "compiled_step"), 2),
        "compiled_fwd_speedup_vs_eager": round(ratio("glm53_fwd", "compiled_fwd"), 2),
        "compile_fwd_s": round(first["first_fwd_s"] - T_fwd, 1),
        "compile_step_s": round(first["first_step_s"] - T_step, 1),
        "compiled_logits_rel_diff": first["logits_rel_diff"],
    }


def train_step(model, ids, is_hf):
    model.train()
    model.zero_grad(set_to_none=True)
    logits = logits_of(model, ids, is_hf)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()


def active_matmul_params(config) -> int:
    """Parameters one token multiplies through (routed experts: top-k of them; embeddings excluded, head included)."""
    from glm53 import Glm53ForCausalLM as M

    with torch.device("meta"):
        model = M(config)
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or p.dim() < 2:
            continue
        if "experts.gate_up_proj" in name or "experts.down_proj" in name:
            total += p.numel() * config.num_experts_per_tok // config.n_routed_experts
        else:
            total += p.numel()
    return total


def memory_child(path: str, which: str, T: int) -> None:
    """Run one training step in this (fresh) process and print its peak RSS growth in bytes.

    Only the measured model is loaded; the peak counter (VmHWM) is reset just before the step (Linux
    /proc/self/clear_refs "5"), so loading does not count.
    """
    if which == "transformers":
        from transformers import Glm5NextForConditionalGeneration

        model, is_hf = Glm5NextForConditionalGeneration.from_pretrained(path, attn_implementation="eager"), True
    else:
        model, is_hf = Glm53ForCausalLM.from_pretrained(path), False
    ids = seeded_ids(bench_config(), T)
    rss_before = vm_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    train_step(model, ids, is_hf)
    print(json.dumps({"peak_bytes": vm_bytes("VmHWM") - rss_before}))


def measure_memory(path: str, which: str, T: int, threads: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", which, "--path", path, "--seqlens", str(T)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T in {512, 2048}, 3 reps, scaling 4096 -> 8192")
    ap.add_argument("--seqlens", type=positive_int, nargs="+", help="sequence lengths for the paired comparison")
    ap.add_argument("--reps", type=positive_int, default=3, help="paired repetitions per T (median reported)")
    ap.add_argument("--memory-seqlens", type=positive_int, nargs="*", default=[2048], help="T for the peak-memory runs")
    ap.add_argument("--scaling-seqlens", type=positive_int, nargs=2, default=[4096, 8192], help="glm53 forward T ratio")
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    ap.add_argument("--out", default="bench_model.json", help="file name under benchmarks/results/")
    ap.add_argument(
        "--allocator",
        choices=["retain", "default"],
        default="retain",
        help="glibc keeps freed memory (fair, default) or glibc defaults",
    )
    ap.add_argument("--also-default", action="store_true", help="also run with the default allocator (a child)")
    ap.add_argument("--compile", action="store_true", help="add glm53 with per-block inductor compile to the run")
    ap.add_argument("--memory-child", choices=["glm53", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ensure_allocator(args.allocator)
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args.path, args.memory_child, args.seqlens[0])
    if args.also_default:
        child_out = args.out.replace(".json", "") + "_default_allocator.json"
        argv = [a for a in sys.argv[1:] if a != "--also-default"]
        argv = [*argv[: argv.index("--out")], *argv[argv.index("--out") + 2 :]] if "--out" in argv else argv
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--allocator", "default", "--out", child_out]
        env = {k: v for k, v in os.environ.items() if k not in RETAIN_ENV}
        print(subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout, flush=True)
    seqlens = args.seqlens or ([512, 2048] if args.quick else [512, 1024, 2048, 4096])
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="glm53-bench-")
    hf, ours, config = build_pair(tmp)
    backends = {op: chosen_backend(op) for op in OPS}
    logits_rel = check_same_logits(hf, ours, config)
    compiled = compiled_copy(ours, os.path.join(tmp, "inductor")) if args.compile else None
    peaks = []
    flops_per_token = 6 * active_matmul_params(config)
    rows = []
    for T in seqlens:
        ids = seeded_ids(config, T)
        times = {k: [] for k in ("glm53_fwd", "hf_fwd", "glm53_step", "hf_step", "compiled_fwd", "compiled_step")}
        for model, is_hf in ((ours, False), (hf, True)):  # warm-up both (allocator, lazy init, first-call logging)
            forward(model, ids, is_hf), train_step(model, ids, is_hf)
        first = warm_up_compiled(compiled, ours, ids) if compiled is not None else None
        for _ in range(args.reps):
            peaks.append(gemm_peak_flops())
            times["glm53_fwd"].append(timed(lambda: forward(ours, ids, False)))
            times["hf_fwd"].append(timed(lambda: forward(hf, ids, True)))
            times["glm53_step"].append(timed(lambda: train_step(ours, ids, False)))
            times["hf_step"].append(timed(lambda: train_step(hf, ids, True)))
            if compiled is not None:
                with torch.compiler.set_stance("fail_on_recompile"):
                    times["compiled_fwd"].append(timed(lambda: forward(compiled, ids, False)))
                    times["compiled_step"].append(timed(lambda: train_step(compiled, ids, False)))
        ratio = lambda a, b: median([x / y for x, y in zip(times[a], times[b])])  # noqa: E731
        step = median(times["glm53_step"])
        rows.append(
            {
                "T": T,
                "glm53_fwd_tok_s": round(T / median(times["glm53_fwd"]), 1),
                "hf_fwd_tok_s": round(T / median(times["hf_fwd"]), 1),
                "fwd_speedup": round(ratio("hf_fwd", "glm53_fwd"), 2),
                "glm53_step_tok_s": round(T / step, 1),
                "hf_step_tok_s": round(T / median(times["hf_step"]), 1),
                "step_speedup": round(ratio("hf_step", "glm53_step"), 2),
                "glm53_mfu_pct": round(100 * flops_per_token * T / step / median(peaks), 2),
                "times_s": {k: [round(x, 4) for x in v] for k, v in times.items() if v},
            }
        )
        if compiled is not None:
            rows[-1].update(compiled_columns(times, ratio, first))
            rows[-1]["compiled_mfu_pct"] = round(
                100 * flops_per_token * T / median(times["compiled_step"]) / median(peaks), 2
            )
        print(f"T={T}: step speed-up {rows[-1]['step_speedup']}x, forward {rows[-1]['fwd_speedup']}x", flush=True)
    memory = []
    for T in args.memory_seqlens:
        m_ours = measure_memory(tmp, "glm53", T, args.threads)
        m_hf = measure_memory(tmp, "transformers", T, args.threads)
        memory.append(
            {
                "T": T,
                "glm53_MiB": round(m_ours / 2**20, 1),
                "hf_MiB": round(m_hf / 2**20, 1),
                "ratio": round(m_ours / m_hf, 3),
            }
        )
    T4, T8 = args.scaling_seqlens
    scale_times = {T4: [], T8: []}
    for _ in range(args.reps):
        for T in (T4, T8):
            ids = seeded_ids(config, T)
            scale_times[T].append(timed(lambda: forward(ours, ids, False)))
    scaling = {
        "T": [T4, T8],
        "glm53_fwd_s": [median(scale_times[T4]), median(scale_times[T8])],
        "ratio": round(median(scale_times[T8]) / median(scale_times[T4]), 3),
    }
    payload = {
        "machine": machine(),
        "command": " ".join(sys.argv),
        "backends": backends,
        "allocator": args.allocator,
        "environment": {k: os.environ.get(k) for k in RETAIN_ENV},
        "logits_rel_diff": logits_rel,
        "gemm_peak_gflops": round(median(peaks) / 1e9, 2),
        "gemm_peak_gflops_all": [round(p / 1e9, 1) for p in peaks],
        "model_flops_per_token": flops_per_token,
        "paired": rows,
        "memory": memory,
        "scaling": scaling,
    }
    path = write_json(args.out, payload)
    cols = [
        "T",
        "glm53_fwd_tok_s",
        "hf_fwd_tok_s",
        "fwd_speedup",
        "glm53_step_tok_s",
        "hf_step_tok_s",
        "step_speedup",
        "glm53_mfu_pct",
    ]
    print(
        f"\nallocator: {args.allocator}; backends: {backends}; logits agree to {logits_rel:.1e}; threads {args.threads}"
    )
    print(f"fp32 GEMM peak median {payload['gemm_peak_gflops']} GFLOP/s, measured {payload['gemm_peak_gflops_all']}")
    print(table(rows, cols))
    if compiled is not None:
        print("\nglm53 compiled per block (inductor); compile time = first call - steady state")
        print(
            table(
                rows,
                [
                    "T",
                    "compiled_step_speedup_vs_hf",
                    "compiled_step_speedup_vs_eager",
                    "compiled_fwd_speedup_vs_eager",
                    "compiled_mfu_pct",
                    "compile_fwd_s",
                    "compile_step_s",
                ],
            )
        )
    if memory:
        print("\npeak memory of a training step (RSS growth)")
        print(table(memory, ["T", "glm53_MiB", "hf_MiB", "ratio"]))
    print(f"\nglm53 forward T={T8} / T={T4}: {scaling['ratio']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
