"""Peak memory of the LM head + cross-entropy (forward and backward): plain fp32 logits vs the chunked
`linear_cross_entropy` kernel, at the released vocabulary; the kernel alone and through the model's own path.

    python benchmarks/bench_loss_memory.py                      # T=4096, D=4096, vocab=154880, bf16
    python benchmarks/bench_loss_memory.py --tokens 1024 --hidden 512
    python benchmarks/bench_loss_memory.py --variants model-plain model-chunked

Variants: "plain" / "chunked" call the kernel's reference / fast form on hidden [T, D] and a weight [vocab, D];
"model-plain" is the model's loss before the chunked path (`causal_lm_loss(lm_head(hidden), labels)`, what
Glm53ForCausalLM computed), "model-chunked" the model's loss now (`causal_lm_head_loss(hidden, lm_head, labels)`,
what its forward calls with labels for the main head and each MTP depth), both with an nn.Linear lm_head and
hidden [1, T, D].

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

from bench_config import ROOT, positive_int

CHILD = r"""
import sys, torch
sys.path.insert(0, {root!r})
from glm53.kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from glm53.losses import causal_lm_head_loss, causal_lm_loss
torch.set_num_threads(2)
T, D, V, variant = {tokens}, {hidden}, {vocab}, {variant!r}
g = torch.Generator().manual_seed(0)
hidden = (torch.randn(T, D, generator=g) * 0.02).bfloat16().requires_grad_()
weight = (torch.randn(V, D, generator=g) * 0.02).bfloat16().requires_grad_()
targets = torch.randint(0, V, (T,), generator=g)
head = torch.nn.Linear(D, V, bias=False, device="meta")
head.weight = torch.nn.Parameter(weight.detach())
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM
base = rss("VmRSS:")
if variant == "model-plain":
    loss = causal_lm_loss(head(hidden[None]), targets[None])
elif variant == "model-chunked":
    loss = causal_lm_head_loss(hidden[None], head, targets[None])
else:
    fn = linear_cross_entropy_reference if variant == "plain" else linear_cross_entropy
    loss = fn(hidden, weight, targets) / T
loss.backward()
print(rss("VmHWM:") - base, float(loss))
"""


VARIANTS = ("plain", "chunked", "model-plain", "model-chunked")
PAIRS = (("plain", "chunked"), ("model-plain", "model-chunked"))  # (before, after) compared


def run(variant: str, args) -> tuple[int, float]:
    code = CHILD.format(root=ROOT, tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, variant=variant)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), float(out[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=positive_int, default=4096)
    p.add_argument("--hidden", type=positive_int, default=4096)
    p.add_argument("--vocab", type=positive_int, default=154880)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", default="bench_loss_memory.json")
    args = p.parse_args()
    rows = {v: run(v, args) for v in args.variants}  # one at a time: each peak is measured alone
    grad_w = 2 * args.vocab * args.hidden
    print(f"T={args.tokens} D={args.hidden} vocab={args.vocab} bf16, head + loss forward and backward")
    print(f"{'variant':>13}  {'peak MiB':>9}  {'loss':>8}")
    for name, (peak, loss) in rows.items():
        print(f"{name:>13}  {peak / 2**20:9.1f}  {loss:8.4f}")
    ratios = {}
    for before, after in PAIRS:
        if before in rows and after in rows:
            ratio = rows[after][0] / rows[before][0]
            ratio_ex = (rows[after][0] - grad_w) / (rows[before][0] - grad_w)
            ratios[f"{after}/{before}"] = dict(ratio=ratio, ratio_without_weight_grad=ratio_ex)
            print(
                f"{after} / {before} peak: {ratio:.3f}; without the weight gradient ({grad_w / 2**20:.0f} MiB): "
                f"{ratio_ex:.3f} (target <= 0.125)"
            )
    result = {
        "command": "python benchmarks/bench_loss_memory.py " + " ".join(sys.argv[1:]),
        "tokens": args.tokens,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "peak_bytes": {k: v[0] for k, v in rows.items()},
        "loss": {k: v[1] for k, v in rows.items()},
        "ratios": ratios,
    }
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", args.out), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
