"""Chunk budgets per device: how much work one Python iteration of a chunked kernel loop covers.

Legend: T queries/tokens, H heads, J selected slots, K/V head widths, P pools, C KDA chunk length.
The chunked kernels (sparse attention, indexer scores and top-k, the KDA blocks) bound their working set by an
element budget per chunk. On the CPU the budgets keep a chunk's tensors cache-sized (a few MiB, the module
constants: GATHER_BUDGET, MIN_QUERY_CHUNK, SCORE_BUDGET, MIN_SCORE_CHUNK, TOPK_BUDGET, MIN_TOPK_CHUNK,
STATE_BUDGET, FAST_CHUNK_SIZE), where each extra iteration costs microseconds. On a GPU every iteration launches
its ops again (about 5-20 us each, eager), so chunks are sized for GPU memory instead: CUDA_BUDGETS, below.
`budget(name, device)` answers the module constant on the CPU (tests monkeypatch those) and CUDA_BUDGETS[name] on
an accelerator; `simulate_device("cuda")` makes CPU tensors take the accelerator's budgets, for counting a GPU's
launches on the CPU (benchmarks/bench_launches.py). The budgets change only how work is split, never a formula:
results agree to rounding (a longer reduction order), as the tests at both budgets check.

CUDA sizes (fp32 elements; one H200/H100 has 80-141 GiB, a training step at T = 4096 holds a few GiB of these):
- gather 1 << 28 (1 GiB of one gathered [B, H, Tq, J, K] chunk) with at least 64 queries: the per-head sparse
  attention at one TP rank's 8 released heads (8 x 2051 x 256 = 4.2M per query) runs 64-query chunks;
- dense 1 << 28 (the merged masked-dense [B, H, Tq, span] scores);
- score / topk 1 << 28 logits ([B, Tq, H, P]) with at least 256 queries;
- state 1 << 28 (1 GiB of [B, H, n, K, V] KDA block-start states: 256 chunks of 64 heads x 128 x 128 per block,
  all of T = 16K in one block) and chunk length 64 (half the per-chunk state-scan steps of 32; the intra-chunk
  [C, C] products and solve are still small GEMMs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CUDA_BUDGETS: dict[str, int] = {
    "gather": 1 << 28,
    "min_query_chunk": 64,
    "dense": 1 << 28,
    "score": 1 << 28,
    "min_score_chunk": 256,
    "topk": 1 << 28,
    "min_topk_chunk": 256,
    "state": 1 << 28,
    "kda_chunk": 64,
}
_SIMULATED: list[str] = []


def device_kind(device: torch.device | str) -> str:
    """ "cpu" or "cuda" (any accelerator takes the CUDA sizes); CPU and meta tensors take the simulated kind."""
    kind = torch.device(device).type
    if kind in ("cpu", "meta") and _SIMULATED:
        return _SIMULATED[-1]
    return "cpu" if kind in ("cpu", "meta") else "cuda"


def budget(name: str, device: torch.device | str, cpu_value: int) -> int:
    """The budget `name` for work on `device`: `cpu_value` (the module's constant) on the CPU."""
    if name not in CUDA_BUDGETS:
        raise KeyError(f"unknown chunk budget {name!r}; known: {sorted(CUDA_BUDGETS)}")
    return cpu_value if device_kind(device) == "cpu" else CUDA_BUDGETS[name]


@contextlib.contextmanager
def simulate_device(kind: str) -> Iterator[None]:
    """CPU tensors take `kind`'s budgets inside the block ("cuda" or "cpu")."""
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"simulate_device takes 'cpu' or 'cuda', got {kind!r}")
    _SIMULATED.append(kind)
    try:
        yield
    finally:
        _SIMULATED.pop()


__all__ = ["CUDA_BUDGETS", "budget", "device_kind", "simulate_device"]
