"""Inputs and checks the kernel tests share (tests/kernels/): random KDA and sparse-attention inputs, packed-document
layouts, the cotangent gradients and the scaled closeness check every fast == reference test uses.

Legend: B batch, T time, S keys, H heads, K/V KDA key/value widths, D/E q-k/value widths, J selected slots, L
k-pool length, C the fast KDA chunk.

FP32_TOL: a fast kernel and its reference compute the same sums in other orders in fp32 (inputs may be fp64 and are
compared at fp32 rounding): ~1e-6 relative per reduction of a few hundred terms, 1e-4 / 1e-5 x the output's scale
leaves room for the longest chains here (KDA's chunked state over 130 steps). BF16_TOL: one bf16 rounding of the
output (2^-8 = 3.9e-3) over a few accumulations in fp32 inside, 3e-2 x scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.kernels.kda import chunk as kda_mod
from glm53.kernels.kda import fast

FP32_TOL = dict(rtol=1e-4, atol=1e-5)


BF16_TOL = dict(rtol=3e-2, atol=3e-2)  # bf16 inputs/outputs, fp32 inside: the output rounding dominates


def grads(out, inputs, seed=1):
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    cot = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.dtype) for o in outs)
    return torch.autograd.grad(outs, inputs, cot)


def assert_all_close(got, ref, tol, names):
    for name, a, b in zip(names, got, ref):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(
            a.float(), b.float(), rtol=tol["rtol"], atol=tol["atol"] * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def kda_inputs(B, T, H, K, V, gate, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(rnd(B, T, H, K), dim=-1), F.normalize(rnd(B, T, H, K), dim=-1)
    u = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    # "bounded": transformers' -5 * sigmoid gate; "softplus-large": decays up to -300 per step (softplus gate with
    # a large rate) so a sub-chunk's span overflows exp() and the hierarchical path must be used
    g = -5 * u if gate == "bounded" else -300 * u**3
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    S0 = rnd(B, H, K, V)
    return [x.to(dtype).requires_grad_() for x in (q, k, rnd(B, T, H, V), g, beta, S0)]


def sparse_inputs(B, T, S, H, D, E, J, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, D, generator=gen), torch.randn(B, S, H, D, generator=gen)
    v = torch.randn(B, S, H, E, generator=gen)
    rows = []
    for _ in range(B * T):  # distinct causal-looking selections with -1 holes, J may exceed S
        perm = torch.randperm(S, generator=gen)[: min(J, S)]
        perm = torch.where(torch.rand(perm.shape, generator=gen) < 0.2, -1, perm)
        rows.append(F.pad(perm, (0, J - perm.numel()), value=-1))
    idx = torch.stack(rows).view(B, T, J)
    idx[0, 0] = -1  # an all-empty (padding) row
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], idx


C = kda_mod.FAST_CHUNK_SIZE


# (B, T, document lengths over the flattened B * T tokens; every row start must be among the boundaries)
LAYOUTS = {
    "B1-short-docs": (1, 2 * C + 9, [1, 2, C - 1, C + 6, 1]),
    "B2-rows": (2, C + 5, [3, C + 2, 1, C - 1, 5]),
    "B1-one-doc": (1, C + 3, [C + 3]),
}


def cu_for(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


def packed_kda_inputs(B, T, gate):
    """kda_inputs; "weak": decays of at most -0.1 per step, so a state that leaks across a boundary (or over a
    chunk) is still large enough to see (the -5 bounded gate forgets within a chunk)."""
    xs = kda_inputs(B, T, 2, 8, 6, "bounded" if gate == "weak" else gate)[:5]
    if gate == "weak":
        xs[3] = (xs[3].detach() * 0.02).requires_grad_()
    return xs


def pool_starts_for(lengths: list[int], B: int, T: int, L: int) -> torch.Tensor:
    """Pools from each document's start (L apart), rows padded with T; the layout the indexer builds."""
    rows: list[list[int]] = [[] for _ in range(B)]
    pos = 0
    for n in lengths:
        b, s = divmod(pos, T)
        rows[b] += list(range(s, s + n, L))
        pos += n
    P = max(len(r) for r in rows)
    return torch.tensor([r + [T] * (P - len(r)) for r in rows])


def chunks_per_block(monkeypatch, chunks: int, B: int, H: int, K: int, V: int) -> None:
    monkeypatch.setattr(fast, "STATE_BUDGET", chunks * B * H * K * V)


FORMULA_FWD_TOL = dict(rtol=2e-6, atol=2e-6)  # fp32 kernels vs the fp64 formula


FORMULA_BWD_TOL = dict(rtol=2e-5, atol=2e-6)


def fp64_inputs(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]


def check_against_formula(kernel, formula, xs):
    """kernel on fp32 leaves vs formula on fp64 leaves holding the same values: output and all gradients."""
    low = [x.float().requires_grad_() for x in xs]
    high = [x.float().double().requires_grad_() for x in xs]
    got, want = kernel(*low), formula(*high)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, **FORMULA_FWD_TOL)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    g_got = torch.autograd.grad(got, low, cot.float())
    g_want = torch.autograd.grad(want, high, cot)
    for i, (a, b) in enumerate(zip(g_got, g_want)):
        torch.testing.assert_close(a.double(), b, **FORMULA_BWD_TOL, msg=lambda m, i=i: f"gradient of input {i}: {m}")
