"""The released widths for bench_kernels.py --released: the kernels whose cost grows with T (or T^2) at the
GLM-5.3 shapes, time and peak memory per op, each measured in a fresh child process. Not a test.

Legend: T sequence length, H heads, K/V head widths, Z the kv_lora latent, J selected slots, P pools, D hidden,
E experts, I expert width.
Shapes (glm53/config.py defaults): MLA 64 heads, qk/v head 256, kv_lora 512, index_topk 2048 + a 3-token tail
(J = 2051), kpool 4 (P = T/4); indexer 32 heads x 128; KDA 64 heads x 128; experts D 4096 x I 2048. The
per-head sparse attention runs at one tensor-parallel rank's share of heads (64 / TP_SHARE), the layout that
uses it. Rows:
- sparse_mqa_attention / sparse_attention: the fast kernels and their dense references, fwd and fwd+bwd;
- indexer_scores: [T, P] scores, fwd and fwd+bwd (the indexer KL trains it);
- pool_mass: the KL target's dense attention mass per pool (no grad; model/attention_mass.py);
- indexer_kl: the KL of the index scores against that target, fwd+bwd (losses.indexer_kl_terms);
- kda: the chunked KDA kernel, fwd and fwd+bwd;
- moe_experts: MOE_EXPERTS experts of the released width, each token routed to MOE_TOPK of them (a few experts
  keep the weights small; the per-token work is MOE_TOPK expert MLPs), grouped kernel and per-expert loop.
The dense references are O(T^2) in time and memory (the absorbed one holds [64, T, T] fp32 scores: 4 GiB at
T = 4096), so they run only up to `reference_up_to` (bench_kernels.py --skip-reference-above, default 2048).
Peak memory is the child's peak RSS growth over the first fwd+bwd (or fwd) call (VmHWM reset just before it):
every tensor the call allocates, inputs excluded. That call is also the first fwd+bwd timing sample when it takes
at least SLOW_CALL_S (then its one-time setup is noise and a separate warm-up would only double the run time).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import torch.nn.functional as F
from bench_config import ROOT, median, timed, vm_bytes

from glm53.config import Glm53Config
from glm53.kernels.dispatch import _REGISTRY

TP_SHARE = 8  # the per-head form's heads: one rank of tensor parallelism 8
SLOW_CALL_S = 1.0  # a first fwd+bwd at least this long counts as a timing sample (its setup is negligible)
MOE_EXPERTS, MOE_TOPK = 4, 2  # a few released-width experts, each token routed to two
MOE_LIMIT = 10.0  # the experts' activation clamp (a value; it does not change the cost)
OPS = {
    "sparse_mqa_attention": ("fast", "reference"),
    "sparse_attention": ("fast", "reference"),
    "indexer_scores": ("fast", "reference"),
    "pool_mass": ("fast",),
    "indexer_kl": ("fast",),
    "kda": ("fast",),
    "moe_experts": ("fast", "reference"),
}


def causal_topk(T: int, J: int, kpool: int) -> torch.Tensor:
    """[1, T, J] causal selections shaped like the indexer's: whole pools of kpool tokens, -1 where fewer."""
    g = torch.Generator().manual_seed(0)
    pools = -(-T // kpool)
    scores = torch.rand(T, pools, generator=g)
    visible = torch.arange(pools)[None, :] * kpool + kpool - 1 <= torch.arange(T)[:, None]
    chosen = scores.masked_fill(~visible, -1.0).topk(min(J // kpool, pools), dim=-1)
    tokens = (chosen.indices[..., None] * kpool + torch.arange(kpool)).masked_fill(chosen.values[..., None] < 0, -1)
    return F.pad(tokens.flatten(1), (0, J - tokens.shape[1] * kpool), value=-1)[None]


def inputs(op: str, T: int, c: Glm53Config):
    """(tensors that take gradients, other args, the call) for one row."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    J, H, P = c.index_topk + c.index_kpool - 1, c.num_attention_heads, -(-T // c.index_kpool)
    if op == "sparse_mqa_attention":
        return [rnd(1, T, H, c.kv_lora_rank), rnd(1, T, c.kv_lora_rank)], [causal_topk(T, J, c.index_kpool), 0.0625]
    if op == "sparse_attention":
        h = H // TP_SHARE
        qkv = [rnd(1, T, h, c.qk_head_dim), rnd(1, T, h, c.qk_head_dim), rnd(1, T, h, c.v_head_dim)]
        return qkv, [causal_topk(T, J, c.index_kpool), 0.0625]
    if op == "indexer_scores":
        Hi, K = c.index_n_heads, c.index_head_dim
        return [rnd(1, T, Hi, K), rnd(1, T, Hi) * Hi**-0.5, rnd(1, P, K)], [K**-0.5]
    if op in ("pool_mass", "indexer_kl"):
        return [], [T, c]
    if op == "kda":
        Hk, K = c.linear_num_heads, c.linear_head_dim
        q, k = F.normalize(rnd(1, T, Hk, K), dim=-1), F.normalize(rnd(1, T, Hk, K), dim=-1)
        gate, beta = -5 * torch.rand(1, T, Hk, K, generator=g), torch.rand(1, T, Hk, generator=g)
        return [q, k, rnd(1, T, Hk, K), gate, beta], []
    if op == "moe_experts":
        D, I = c.hidden_size, c.moe_intermediate_size
        idx = torch.rand(T, MOE_EXPERTS, generator=g).topk(MOE_TOPK, dim=-1).indices
        weights = torch.rand(T, MOE_TOPK, generator=g)
        return [rnd(T, D), weights, rnd(MOE_EXPERTS, 2 * I, D) / D**0.5, rnd(MOE_EXPERTS, D, I) / I**0.5], [idx]
    raise KeyError(op)


def caller(op: str, fn, extra: list):
    """The kernel as a function of the tensors that take gradients (the expert kernel's arguments interleave)."""
    if op == "moe_experts":  # fn(x, topk_idx, topk_weight, gate_up, down, limit)
        return lambda x, w, gate_up, down: fn(x, extra[0], w, gate_up, down, MOE_LIMIT)
    return lambda *t: (lambda out: out[0] if isinstance(out, tuple) else out)(fn(*t, *extra))


def _indexer_target(T: int, c: Glm53Config):
    """q, k [1, T, H, K], valid, and the stats the KL reads (scores with gradient, candidate mask)."""
    from glm53.model.indexer import kept_pools

    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, T, c.num_attention_heads, c.qk_head_dim, generator=g),
        torch.randn(1, T, c.num_attention_heads, c.qk_head_dim, generator=g),
    )
    valid = torch.ones(1, T, dtype=torch.bool)
    positions, complete = kept_pools(valid, c.index_kpool)
    candidate = (positions[..., -1][:, None, :] <= torch.arange(T)[None, :, None]) & complete[:, None]
    return q, k, valid, candidate


def measure(op: str, backend: str, T: int, reps: int) -> dict:
    """Run in a fresh child: times (median of reps) and the peak RSS growth of one fwd+bwd (or fwd) call."""
    from glm53 import losses
    from glm53.model.attention_mass import attention_pool_mass
    from glm53.model.context import LayerStats

    c = Glm53Config()
    tensors, extra = inputs(op, T, c)
    if op in ("pool_mass", "indexer_kl"):
        q, k, valid, candidate = _indexer_target(T, c)
        mass = attention_pool_mass(q, k, valid, c.index_kpool, c.qk_head_dim**-0.5)
        if op == "pool_mass":
            fwd = lambda: attention_pool_mass(q, k, valid, c.index_kpool, c.qk_head_dim**-0.5)  # noqa: E731
            step = fwd
        else:
            scores = torch.randn(mass.shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
            stats = [LayerStats(indexer=True, pool_mass=mass, index_scores=scores, candidate=candidate)]
            fwd = lambda: losses.indexer_kl_terms(stats, valid, "dense")[0]  # noqa: E731
            step = lambda: torch.autograd.grad(fwd(), scores)  # noqa: E731
    else:
        call = caller(op, _REGISTRY[op][backend], extra)
        fwd = lambda: call(*tensors)  # noqa: E731
        leaves = [t.clone().requires_grad_() for t in tensors]
        with torch.no_grad():
            cot = torch.randn_like(call(*tensors))
        step = lambda: torch.autograd.grad(call(*leaves), leaves, cot, allow_unused=True)  # noqa: E731
    rss = vm_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    first = timed(step)
    peak = vm_bytes("VmHWM") - rss
    with torch.no_grad():
        t_fwd = median([timed(fwd) for _ in range(reps)])
    kept = [first] if first >= SLOW_CALL_S else []  # a quick first call mostly timed one-time setup: redo it
    t_both = median(kept + [timed(step) for _ in range(reps - len(kept))]) if step is not fwd else t_fwd
    return {"fwd_ms": round(1e3 * t_fwd, 1), "fwd_bwd_ms": round(1e3 * t_both, 1), "peak_mib": round(peak / 2**20)}


def released_rows(
    seqlens: list[int], reps: int, threads: int, ops: list[str] | None, reference_up_to: int
) -> list[dict]:
    rows = []
    for op in ops or list(OPS):
        for T in seqlens:
            for backend in OPS[op]:
                if backend == "reference" and T > reference_up_to:
                    continue
                cmd = [sys.executable, __file__, op, backend, str(T), str(reps), str(threads)]
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT + "/benchmarks")
                if done.returncode:
                    raise RuntimeError(f"{op} {backend} T={T} failed:\n{done.stderr[-3000:]}")
                row = {"op": op, "T": T, "backend": backend, **json.loads(done.stdout.strip().splitlines()[-1])}
                print(row, file=sys.stderr, flush=True)
                rows.append(row)
    return rows


if __name__ == "__main__":
    op, backend, T, reps, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    torch.set_num_threads(threads)
    print(json.dumps(measure(op, backend, T, reps)))
