"""Peak memory of the LM head + cross-entropy (forward and backward): plain fp32 logits vs the chunked
`linear_cross_entropy` kernel, at the released vocabulary.

    python benchmarks/bench_loss_memory.py                      # T=4096, D=4096, vocab=154880, bf16
    python benchmarks/bench_loss_memory.py --tokens 1024 --hidden 512

Each variant runs in a fresh child process: it builds hidden [T, D] and lm_head [vocab, D] (bf16, requires
grad), records its RSS, runs loss forward + backward, and reports the peak RSS growth (VmHWM reset just
before the step). The head's weight gradient (one [vocab, D] bf16 tensor, parameter memory that any loss needs)
is counted in both; the table also shows the peaks without it.
Results: benchmarks/results/bench_loss_memory.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import sys, torch
sys.path.insert(0, {root!r})
from glm53.kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
torch.set_num_threads(2)
T, D, V, variant = {tokens}, {hidden}, {vocab}, {variant!r}
g = torch.Generator().manual_seed(0)
hidden = (torch.randn(T, D, generator=g) * 0.02).bfloat16().requires_grad_()
weight = (torch.randn(V, D, generator=g) * 0.02).bfloat16().requires_grad_()
targets = torch.randint(0, V, (T,), generator=g)
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM
base = rss("VmRSS:")
fn = linear_cross_entropy_reference if variant == "plain" else linear_cross_entropy
loss = fn(hidden, weight, targets) / T
loss.backward()
print(rss("VmHWM:") - base, float(loss))
"""


def run(variant: str, args) -> tuple[int, float]:
    code = CHILD.format(root=ROOT, tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, variant=variant)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), float(out[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=154880)
    p.add_argument("--out", default="bench_loss_memory.json")
    args = p.parse_args()
    rows = {v: run(v, args) for v in ("plain", "chunked")}
    ratio = rows["chunked"][0] / rows["plain"][0]
    grad_w = 2 * args.vocab * args.hidden
    ratio_ex = (rows["chunked"][0] - grad_w) / (rows["plain"][0] - grad_w)
    print(f"T={args.tokens} D={args.hidden} vocab={args.vocab} bf16, head + loss forward and backward")
    print(f"{'variant':>8}  {'peak MiB':>9}  {'loss':>8}")
    for name, (peak, loss) in rows.items():
        print(f"{name:>8}  {peak / 2**20:9.1f}  {loss:8.4f}")
    print(f"chunked / plain peak: {ratio:.3f}; without the weight gradient ({grad_w / 2**20:.0f} MiB): {ratio_ex:.3f}"
          f" (target <= 0.125)")
    result = {"command": "python benchmarks/bench_loss_memory.py " + " ".join(sys.argv[1:]), "tokens": args.tokens,
              "hidden": args.hidden, "vocab": args.vocab,
              "peak_bytes": {k: v[0] for k, v in rows.items()}, "loss": {k: v[1] for k, v in rows.items()},
              "ratio": ratio, "ratio_without_weight_grad": ratio_ex}  # fmt: skip
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", args.out), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
