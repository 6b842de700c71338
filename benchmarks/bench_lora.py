"""LoRA training step vs the full fine-tuning step, and the FP8-base LoRA step vs the bf16-base one (CPU, fp32 compute).

Variants on the benchmark config (bench_config.py), one child process each so the peak is its own:
    full      every parameter trains (AdamW)
    lora      rank-16 adapters on attention + routed experts, base frozen (fp32 base: the CPU compute dtype)
    lora-held the same with the frozen base held in bf16 (glm53.peft.hold_bf16, what --base-dtype bf16 does),
              widened to fp32 per matmul: fp32 compute and adapters
    lora-bf16 the same with the whole model in bf16 (base, adapters and compute)
    lora-fp8  the same base quantised to 128x128-block FP8 (glm53.peft.quantize_model), dequantised per matmul, bf16
              compute
Each child times `--steps` optimizer steps after one warm-up step (median), and reports the peak RSS growth over
the step (VmHWM reset before it) and the resident training state (parameters + gradients + AdamW state) in bytes.
Variants run interleaved over `--reps` rounds, so the ratios compare runs from the same moments of a shared machine.
Results: benchmarks/results/bench_lora.json and a table on stdout.

    python benchmarks/bench_lora.py --reps 2 --steps 3 --seq 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_config import RESULTS_DIR, ROOT, machine, positive_int

CHILD = r"""
import sys, time, statistics, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {root!r} + "/benchmarks")
import glm53
from bench_config import bench_config
from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.peft import quantize_model, trainable_parameters
from glm53.peft.fp8_storage import hold_bf16
torch.manual_seed(0)
torch.set_num_threads(1)
variant, steps, seq = {variant!r}, {steps}, {seq}
config = bench_config() if {preset!r} == "bench" else Glm53Config.tiny(vocab_size=4096)
model = Glm53ForCausalLM.from_config(config)
compute = torch.float32
if variant != "full":
    if variant in ("lora-bf16", "lora-fp8"):
        compute = torch.bfloat16
        model.to_dtype(torch.bfloat16)
    if variant == "lora-fp8":
        quantize_model(model)
    glm53.apply_lora(model, 16, 32, targets=["attention", "experts"], dtype=compute)
    if variant == "lora-held":
        hold_bf16(model, compute)
model.train()
params = trainable_parameters(model)
opt = torch.optim.AdamW(params, lr=1e-4)
ids = torch.randint(1, 4096, (1, seq), generator=torch.Generator().manual_seed(1))
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
def step():
    opt.zero_grad(set_to_none=True)
    model(ids, labels=ids, return_logits=False).loss.backward()
    opt.step()
step()  # warm-up: AdamW state exists from here on
open("/proc/self/clear_refs", "w").write("5")
base = rss("VmRSS:")
times = []
for _ in range(steps):
    began = time.perf_counter()
    step()
    times.append(time.perf_counter() - began)
peak = rss("VmHWM:") - base
state = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
state += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
state += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
print(statistics.median(times), peak, state, sum(p.numel() for p in params))
"""

VARIANTS = ("full", "lora", "lora-held", "lora-bf16", "lora-fp8")
PAIRS = (("full", "lora"), ("lora", "lora-held"), ("lora-bf16", "lora-fp8"))  # (before, after)


def run(variant: str, args) -> tuple[float, int, int, int]:
    code = CHILD.format(root=ROOT, variant=variant, steps=args.steps, seq=args.seq, preset=args.preset)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), int(out[1]), int(out[2]), int(out[3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=positive_int, default=2, help="interleaved rounds over the variants")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per child")
    p.add_argument("--seq", type=positive_int, default=256, help="tokens per step")
    p.add_argument("--preset", choices=("bench", "tiny"), default="bench", help="tiny: the smoke test's model")
    p.add_argument("--out", default="bench_lora.json")
    args = p.parse_args()
    runs: dict[str, list] = {v: [] for v in VARIANTS}
    for _ in range(args.reps):
        for v in VARIANTS:
            runs[v].append(run(v, args))
    rows = {
        v: dict(
            step_s=statistics.median(r[0] for r in rs),
            peak_bytes=min(r[1] for r in rs),
            state_bytes=rs[0][2],
            trainable=rs[0][3],
        )
        for v, rs in runs.items()
    }
    print(f"{'variant':>10}  {'step s':>8}  {'peak MiB':>9}  {'state MiB':>10}  {'trainable':>11}")
    for v, r in rows.items():
        print(
            f"{v:>10}  {r['step_s']:8.3f}  {r['peak_bytes'] / 2**20:9.1f}  {r['state_bytes'] / 2**20:10.1f}  "
            f"{r['trainable']:11,d}"
        )
    ratios = {}
    for before, after in PAIRS:
        ratios[f"{after}/{before}"] = {
            k: rows[after][k] / rows[before][k] for k in ("step_s", "peak_bytes", "state_bytes")
        }
        print(
            f"{after} / {before}: step {ratios[f'{after}/{before}']['step_s']:.2f}x, peak "
            f"{ratios[f'{after}/{before}']['peak_bytes']:.2f}x, state {ratios[f'{after}/{before}']['state_bytes']:.2f}x"
        )
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, args.out), "w") as f:
        json.dump(dict(args=vars(args), machine=machine(), rows=rows, ratios=ratios), f, indent=2)


if __name__ == "__main__":
    main()
