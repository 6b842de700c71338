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
  Context parallelism and a traced forward (torch.compile: the op's Python-object arguments would break the
  graph) record the stored form. The top-k itself is the blocked `indexer_topk_pools` (no [B, T, P]) except when
  packed or traced, where `score_and_select` still makes (and frees) the [B, T, P] scores once per layer.
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
    return scores * own_document_pools(pool_starts(full.positions, S), full.cu_seqlens, S, t0, q.shape[1])


def block_mask(full: IndexerKlInputs, mode: str, t0: int, t1: int) -> torch.Tensor:
    """[B, Tq, P] bool: the pools query rows [t0, t1) are trained on (dense: candidates; sparse: the selected
    candidates, the pools of the layer's top-k slots; the tail's incomplete pool is no candidate)."""
    S = full.valid.shape[1]
    candidate = candidate_pools(full.positions, full.complete, S, full.cu_seqlens, t0, t1 - t0)
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


class _RecomputedKl(torch.autograd.Function):
    """Forward and backward over blocks of `chunk` query rows; saves only the O(T) inputs."""

    @staticmethod
    def forward(ctx, full, masses, valid, mode, num_rows, chunk, q, weights, pool_keys):
        T = q.shape[1]
        total = torch.zeros((), dtype=torch.float32, device=q.device)
        count = torch.zeros((), dtype=torch.float32, device=q.device)
        for t0 in range(0, T, chunk):
            t1 = min(t0 + chunk, T)
            block, mask = _targets(full, masses, mode, t0, t1)
            scores = block_scores(full, t0, q[:, t0:t1], weights[:, t0:t1], pool_keys)
            kl, rows, _, _ = kl_rows(scores, block, mask, valid[:, t0:t1])
            total, count = total + (kl * rows).sum(), count + rows.sum()
        ctx.save_for_backward(q, weights, pool_keys)
        ctx.blocks = (full, masses, valid, mode, chunk)
        ctx.per_row = per_term(total.new_ones(()), count, num_rows)  # d loss / d total
        return total * ctx.per_row

    @staticmethod
    def backward(ctx, grad):
        q, weights, pool_keys = ctx.saved_tensors
        full, masses, valid, mode, chunk = ctx.blocks
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
            d_scores = kl_rows_grad(logp, target, mask, rows * grad * ctx.per_row)
            g_q, g_w, g_k = torch.autograd.grad(scores, (q_b, w_b, keys), d_scores)
            dq[:, t0:t1], dw[:, t0:t1] = g_q, g_w
            dkeys += g_k
        return None, None, None, None, None, None, dq, dw, dkeys.to(pool_keys.dtype)


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
    return _RecomputedKl.apply(full, masses, valid, mode, num_rows, chunk, full.q, full.weights, full.pool_keys)


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
