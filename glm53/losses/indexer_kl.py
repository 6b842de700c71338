"""The indexer KL loss per full indexer layer, and its recomputing form: O(T * chunk) memory, never a [B, T, P].

Legend (glm53/model/__init__.py): B batch, T time (queries), P k-pools, J selected key slots, Tq a block of
query rows. Per query: KL(target || softmax(index scores over the mask)), the target the attention mass per pool
(summed over heads; averaged over the layers a full indexer serves after L1 normalisation), the mask the
candidate pools (dense) or the selected ones (sparse); parts.py holds the rows' formulas (`kl_rows`).
Two records feed it (MultiHeadLatentAttention.kl_recompute):
- stored: each layer keeps [B, T, P] fp32 scores and pool mass and [B, T, P] bool masks (`chunked_pool_kl`);
- recompute (the default): each layer keeps the O(T) inputs (model/attention_mass.py: the indexer's queries,
  head weights and pool keys with gradient, its top-k; every MLA layer's queries and keys), and one autograd op
  recomputes, per block of `KL_CHUNK` query rows, the index scores (kernel "indexer_scores"), the attention pool
  mass (`attention_pool_mass` on the block's queries) and the mask (`candidate_pools`; sparse: the pools of the
  top-k's slots, `slot_pools`), in forward for the value and again in backward for the gradient of that block.
  Kernel "indexer_kl": "fast" is that blocked op; "reference" the same inputs with every row in one block through
  plain autograd (the unchunked form: it materialises [B, T, P]).
  The op is a torch.library custom op on tensors, ints, floats and a string (`_kl_op`, its backward another), so
  torch.compile traces a whole model's loss as one opaque call that saves only its inputs; records whose masses
  carry a TP `reduce` callable run the same blocks through an autograd.Function (eager: the loss runs outside the
  compiled blocks then). Context parallelism: the indexer's q and weights, and every layer's MLA queries, are
  this rank's rows at `offset` of the keys' sequence (the gathered pool keys, MLA keys, mask and documents); the
  gradient of the pool keys flows back through the gather to their owners.
  The top-k itself is blocked (model/pool_selection.py `select_pools_blocked`, eager and compiled, packed or not: no
  [B, T, P]).
Tensor parallelism: each rank's mass is over its own heads; `PoolMassInputs.reduce` (glm53/parallel) sums a
block's mass over the ranks where the loss reads it ([B, Tq, J] slots when sparse, [B, Tq, P] when dense), in
forward and again in the backward's recompute: the messages' total is O(T * J) sparse, O(T * P) dense (the dense
target needs every pool's full sum, parallel/pool_mass.py says why), the memory O(Tq * P) either way.
"""

from __future__ import annotations

import torch

from ..kernels import kernel_op
from ..kernels.dispatch import kernel, register
from ..kernels.indexer_topk import candidate_pools, pool_starts
from ..kernels.opaque import HOST_READING, autograd_inside_op
from ..kernels.varlen import own_document_pools
from ..model.attention_mass import IndexerKlInputs, PoolMassInputs, slot_pools
from ..model.context import LayerStats
from .parts import chunked_pool_kl, kl_rows, kl_rows_grad, normalized_target, per_term, pool_kl

KL_CHUNK = 256  # query rows per block of the recomputed indexer KL ([B, Tq, P] fp32 temporaries)

indexer_scores = kernel_op("indexer_scores")


def indexer_kl_terms(
    stats: list[LayerStats], valid: torch.Tensor, mode: str, num_rows: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """One KL term per full indexer in `stats` (attention layers in order; shared ones follow their full one),
    each summed over its query rows / `num_rows` (default: its mean). Either record (module docstring)."""
    groups: list[tuple[LayerStats, list]] = []
    for s in stats:
        if s.index_scores is not None or s.indexer_inputs is not None:
            groups.append((s, []))
        if s.pool_mass is not None or s.mass_inputs is not None:
            if not groups:
                raise ValueError("a shared indexer layer recorded attention mass before any full indexer layer")
            groups[-1][1].append(s.pool_mass if s.mass_inputs is None else s.mass_inputs)
    terms = []
    for full, masses in groups:
        stored = [isinstance(m, torch.Tensor) for m in masses]
        if all(stored) if full.indexer_inputs is not None else not all(stored):
            raise ValueError(
                "an indexer KL group mixes records: its layers must all store [B, T, P] tensors or all record "
                "their inputs (MultiHeadLatentAttention.kl_recompute)"
            )
        if full.indexer_inputs is not None:
            terms.append(kernel("indexer_kl")(full.indexer_inputs, masses, valid, mode, num_rows))
        else:
            mask = full.candidate if mode == "dense" else full.selected
            terms.append(chunked_pool_kl(full.index_scores, masses, mask, valid, num_rows))
    return terms


def block_scores(
    full: IndexerKlInputs, t0: int, q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor
) -> torch.Tensor:
    """Index scores [B, Tq, P] fp32 of query rows t0 + [0, Tq) (q [B, Tq, H, K], weights [B, Tq, H] their rows);
    packed: 0 for the pools of other documents, as the packed kernel gives."""
    scores = indexer_scores(q, weights, pool_keys, full.scale)
    if full.cu_seqlens is None:
        return scores
    S = full.valid.shape[1]
    own = own_document_pools(pool_starts(full.positions, S), full.cu_seqlens, S, full.offset + t0, q.shape[1])
    return scores * own


def block_mask(full: IndexerKlInputs, mode: str, t0: int, t1: int) -> torch.Tensor:
    """[B, Tq, P] bool: the pools query rows [t0, t1) are trained on (dense: candidates; sparse: the selected
    candidates, the pools of the layer's top-k slots; the tail's incomplete pool is no candidate)."""
    S = full.valid.shape[1]
    candidate = candidate_pools(full.positions, full.complete, S, full.cu_seqlens, full.offset + t0, t1 - t0)
    if mode == "dense":
        return candidate
    B, Tq, P = candidate.shape
    pools = slot_pools(full.topk[:, t0:t1], full.valid, full.kpool, full.cu_seqlens, P, full.positions)  # P: empty
    picked = torch.zeros(B, Tq, P + 1, dtype=torch.bool, device=candidate.device).scatter_(-1, pools, True)
    return candidate & picked[..., :P]


def _targets(full: IndexerKlInputs, masses: list[PoolMassInputs], mode: str, t0: int, t1: int):
    """-> (the blocks' pool masses, one [B, Tq, P] per layer; the mask [B, Tq, P]), without gradient."""
    with torch.no_grad():
        return [m.mass(t0, t1, full.topk, full.positions) for m in masses], block_mask(full, mode, t0, t1)


def _blocks_forward(full, masses, valid, mode, chunk, q, weights, pool_keys):
    """-> (the KL summed over the trained rows, their count), fp32 scalars: `chunk` query rows at a time."""
    T = q.shape[1]
    total = torch.zeros((), dtype=torch.float32, device=q.device)
    count = torch.zeros((), dtype=torch.float32, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        block, mask = _targets(full, masses, mode, t0, t1)
        scores = block_scores(full, t0, q[:, t0:t1], weights[:, t0:t1], pool_keys)
        kl, rows, _, _ = kl_rows(scores, block, mask, valid[:, t0:t1])
        total, count = total + (kl * rows).sum(), count + rows.sum()
    return total, count


def _blocks_backward(full, masses, valid, mode, chunk, q, weights, pool_keys, grad_total):
    """d (grad_total * total) / d (q, weights, pool_keys): each block's scores, target and mask recomputed."""
    T = q.shape[1]
    dq, dw = torch.zeros_like(q), torch.zeros_like(weights)
    dkeys = torch.zeros_like(pool_keys, dtype=torch.float32)
    keys = pool_keys.detach().requires_grad_()
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        block, mask = _targets(full, masses, mode, t0, t1)
        q_b, w_b = q[:, t0:t1].detach().requires_grad_(), weights[:, t0:t1].detach().requires_grad_()
        with torch.enable_grad():  # the scores' own backward (kernel "indexer_scores") on this block
            scores = block_scores(full, t0, q_b, w_b, keys)
        _, rows, logp, target = kl_rows(scores.detach(), block, mask, valid[:, t0:t1])
        d_scores = kl_rows_grad(logp, target, mask, rows * grad_total)
        g_q, g_w, g_k = torch.autograd.grad(scores, (q_b, w_b, keys), d_scores)
        dq[:, t0:t1], dw[:, t0:t1] = g_q, g_w
        dkeys += g_k
    return dq, dw, dkeys.to(pool_keys.dtype)


class _RecomputedKl(torch.autograd.Function):
    """The blocked op on Python records whose masses carry a `reduce` (tensor parallelism): eager only."""

    @staticmethod
    def forward(ctx, full, masses, valid, mode, chunk, q, weights, pool_keys):
        ctx.save_for_backward(q, weights, pool_keys)
        ctx.blocks = (full, masses, valid, mode, chunk)
        return _blocks_forward(full, masses, valid, mode, chunk, q, weights, pool_keys)

    @staticmethod
    def backward(ctx, grad, _grad_count):
        grads = _blocks_backward(*ctx.blocks, *ctx.saved_tensors, grad)
        return None, None, None, None, None, *grads


# ---------------------------------------------------------------------------------------- torch.compile boundary
# The same blocks as a custom op on tensors, ints, floats and strings only: torch.compile sees one opaque call
# (forward and backward), never the block loop nor a [B, T, P] tensor, and AOT autograd saves only its inputs.
@torch.library.custom_op("glm53::indexer_kl_blocks", mutates_args=(), tags=HOST_READING)
def _kl_op(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool_keys: torch.Tensor,
    positions: torch.Tensor,
    complete: torch.Tensor,
    topk: torch.Tensor,
    valid: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    rows: torch.Tensor,
    mass_q: list[torch.Tensor],
    mass_k: list[torch.Tensor],
    mass_scale: list[float],
    mode: str,
    chunk: int,
    kpool: int,
    scale: float,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (total, count) of `_blocks_forward` on the records rebuilt from these tensors."""
    full, masses = _records(
        positions, complete, topk, valid, cu_seqlens, mass_q, mass_k, mass_scale, kpool, scale, offset
    )
    return _blocks_forward(full, masses, rows, mode, chunk, q, weights, pool_keys)


@_kl_op.register_fake
def _(q, weights, pool_keys, positions, complete, topk, valid, cu_seqlens, rows, mass_q, mass_k, *args):
    return q.new_empty((), dtype=torch.float32), q.new_empty((), dtype=torch.float32)


@torch.library.custom_op("glm53::indexer_kl_blocks_backward", mutates_args=(), tags=HOST_READING)
def _kl_op_backward(
    grad_total: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    pool_keys: torch.Tensor,
    positions: torch.Tensor,
    complete: torch.Tensor,
    topk: torch.Tensor,
    valid: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    rows: torch.Tensor,
    mass_q: list[torch.Tensor],
    mass_k: list[torch.Tensor],
    mass_scale: list[float],
    mode: str,
    chunk: int,
    kpool: int,
    scale: float,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dweights, dpool_keys) of `_blocks_backward`."""
    full, masses = _records(
        positions, complete, topk, valid, cu_seqlens, mass_q, mass_k, mass_scale, kpool, scale, offset
    )
    with autograd_inside_op():
        return _blocks_backward(full, masses, rows, mode, chunk, q, weights, pool_keys, grad_total)


@_kl_op_backward.register_fake
def _(grad_total, q, weights, pool_keys, *args):
    return torch.empty_like(q), torch.empty_like(weights), torch.empty_like(pool_keys)


def _records(positions, complete, topk, valid, cu_seqlens, mass_q, mass_k, mass_scale, kpool, scale, offset):
    """The Python records the op's tensors came from (the indexer's q, weights and keys are passed separately)."""
    full = IndexerKlInputs(None, None, None, positions, complete, topk, valid, cu_seqlens, kpool, scale, offset)
    masses = [
        PoolMassInputs(q, k, valid, cu_seqlens, kpool, s, offset=offset) for q, k, s in zip(mass_q, mass_k, mass_scale)
    ]
    return full, masses


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:9], *inputs[9], *inputs[10])
    ctx.layers, ctx.options = len(inputs[9]), inputs[11:]


def _op_backward(ctx, grad, _grad_count):
    saved, n = ctx.saved_tensors, ctx.layers
    mass_q, mass_k = list(saved[9 : 9 + n]), list(saved[9 + n :])
    dq, dw, dkeys = _kl_op_backward(grad, *saved[:9], mass_q, mass_k, *ctx.options)
    layers = [None] * n  # one structure as the inputs: the lists of mass queries and keys (the scales: one leaf)
    return dq, dw, dkeys, *([None] * 6), layers, layers, *([None] * 6)


_kl_op.register_autograd(_op_backward, setup_context=_setup)


def recomputed_indexer_kl(
    full: IndexerKlInputs,
    masses: list[PoolMassInputs],
    valid: torch.Tensor,
    mode: str,
    num_rows: torch.Tensor | None = None,
    chunk: int = KL_CHUNK,
) -> torch.Tensor:
    """The KL term of one full indexer layer (`masses`: it and the shared layers it serves) from their recorded
    inputs, `chunk` query rows at a time in forward and backward; `valid` [B, T] the loss's query rows. Equals
    `chunked_pool_kl` on the stored record (and `indexer_kl_reference`)."""
    if chunk < 1:
        raise ValueError(f"recomputed_indexer_kl: chunk must be a positive number of query rows, got {chunk}")
    _check_group(full, masses)
    if any(m.reduce is not None for m in masses):  # a Python callable: the autograd.Function (eager)
        total, count = _RecomputedKl.apply(full, masses, valid, mode, chunk, full.q, full.weights, full.pool_keys)
    else:
        total, count = _kl_op(
            full.q,
            full.weights,
            full.pool_keys,
            full.positions,
            full.complete,
            full.topk,
            full.valid,
            full.cu_seqlens,
            valid,
            [m.q for m in masses],
            [m.k for m in masses],
            [float(m.scale) for m in masses],
            mode,
            chunk,
            full.kpool,
            float(full.scale),
            full.offset,
        )
    return total * per_term(total.new_ones(()), count.detach(), num_rows)


def _check_group(full: IndexerKlInputs, masses: list[PoolMassInputs]) -> None:
    """The masses of one KL group describe the full indexer's keys (one forward: its mask, documents, pools and
    key offset; under cp each layer gathers its own copy of the mask, so shapes are compared, not identity). The
    recomputation reads the full indexer's mask and documents for every layer."""
    for i, m in enumerate(masses):
        same = (
            m.valid.shape == full.valid.shape,
            (m.cu_seqlens is None) == (full.cu_seqlens is None),
            m.kpool == full.kpool,
            m.offset == full.offset,
            m.q.shape[:2] == full.q.shape[:2],
        )
        if not all(same):
            raise ValueError(
                f"indexer KL: layer {i}'s PoolMassInputs (valid, cu_seqlens, kpool, offset, query rows) must match "
                f"the full indexer's record (same forward, same keys); matches: {same}"
            )


def indexer_kl_reference(
    full: IndexerKlInputs,
    masses: list[PoolMassInputs],
    valid: torch.Tensor,
    mode: str,
    num_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unchunked form on the same inputs: every row in one block, [B, T, P] materialised, plain autograd."""
    T = full.q.shape[1]
    block, mask = _targets(full, masses, mode, 0, T)
    scores = block_scores(full, 0, full.q, full.weights, full.pool_keys)
    target = torch.stack([normalized_target(m.float(), mask) for m in block]).mean(0)
    return pool_kl(scores, target, mask, valid, num_rows)


register("indexer_kl", "reference", indexer_kl_reference)
register("indexer_kl", "fast", recomputed_indexer_kl)

__all__ = ["KL_CHUNK", "indexer_kl_reference", "indexer_kl_terms", "recomputed_indexer_kl"]
