"""The mHC coefficients of a decode step as host scalar arithmetic, for up to HOST_ROWS rows on the CPU.

Legend (glm53/model/__init__.py): B batch, N mHC streams (4 here).
After the projection a site's coefficients are (2+N)*N = 24 numbers per row: sigmoid gates, a row softmax and
Sinkhorn's 39 normalisations of a 4 x 4 matrix. As tensor ops they are ~90 dispatches of a few microseconds on
a few numbers; as Python floats (one tolist in, one tensor out) they cost a fraction of that. The formulas are
HyperConnection.coefficients' (decode.py's _coefficients); Python floats are fp64, so the results are the fp32
tensor ops' up to fp32 rounding. The row loop runs on the host: for batches beyond two the tensor ops cost less.
"""

from __future__ import annotations

import math

import torch

from ..kernels.sinkhorn import sinkhorn4_values

HOST_ROWS = 4  # the largest row count that takes the host form: a batch, or a k-token verify (k <= 3 at batch 1)
N_HOST = 4  # the stream count the unrolled Sinkhorn handles


def use_host(z: torch.Tensor, n: int) -> bool:
    """Whether coefficients for logits z [B, (2+N)*N] take the host form."""
    return n == N_HOST and z.shape[0] <= HOST_ROWS and z.device.type == "cpu"


def _sigmoid(v: float) -> float:
    if v >= 0:
        return 1.0 / (1.0 + math.exp(-v))
    e = math.exp(v)  # exp(-v) would overflow for v below about -709
    return e / (1.0 + e)


def _softmax_rows(v: list[float], n: int, eps: float) -> list[float]:
    """Row softmax of a row-major n x n matrix, plus eps."""
    out = []
    for i in range(0, n * n, n):
        row = v[i : i + n]
        top = max(row)
        e = [math.exp(x - top) for x in row]
        total = sum(e)
        out += [x / total + eps for x in e]
    return out


def _rows(z: torch.Tensor, n: int, eps: float, iters: int) -> list[tuple[list[float], list[float], list[float]]]:
    """Per row of z: pre (sigmoid + eps), post (2 sigmoid), comb (Sinkhorn(row softmax + eps), row-major)."""
    rows = []
    for v in z.tolist():  # NOTE: syncs (host math)
        gates = [_sigmoid(x) for x in v[: 2 * n]]
        comb = sinkhorn4_values(_softmax_rows(v[2 * n :], n, eps), iters, eps)
        rows.append(([g + eps for g in gates[:n]], [2.0 * g for g in gates[n:]], comb))
    return rows


def host_coefficients(z: torch.Tensor, n: int, eps: float, iters: int) -> tuple[torch.Tensor, ...]:
    """z [B, (2+N)*N] (scale * logits + base) -> pre [B, N], post [B, N], comb [B, N, N], fp32 views of one tensor:
    pre = sigmoid + eps, post = 2 sigmoid, comb = Sinkhorn(row softmax + eps)."""
    rows = [pre + post + comb for pre, post, comb in _rows(z, n, eps, iters)]
    out = torch.tensor(rows, dtype=torch.float32, device=z.device)
    return out[:, :n], out[:, n : 2 * n], out[:, 2 * n :].view(-1, n, n)


def host_mixers(z: torch.Tensor, n: int, eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """host_coefficients laid out for the decode step's two products -> pre [B, 1, N] (collapse: pre @ streams) and
    the mixer [B, N, N+1] = [comb^T | post] (mix: mixer @ [streams; out]), fp32 views of one [B, N+1, N+1] tensor
    (row 0 holds pre, zero-padded)."""
    rows = []
    for pre, post, comb in _rows(z, n, eps, iters):
        mixer = [[comb[j * n + i] for j in range(n)] + [post[i]] for i in range(n)]
        rows.append([pre + [0.0]] + mixer)
    out = torch.tensor(rows, dtype=torch.float32, device=z.device)
    return out[:, :1, :n], out[:, 1:]


__all__ = ["HOST_ROWS", "host_coefficients", "host_mixers", "use_host"]
