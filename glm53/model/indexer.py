"""The DSA indexer with k-pools: picks, for every query, the key positions sparse attention may read.

Legend: B batch, T time (queries), S keys (where they differ: queries that are a slice of the keys' sequence),
D model width, R q_lora_rank, H indexer heads, K indexer head width, P pools, L = index_kpool tokens per pool,
J output slots.
Following transformers' Glm5NextTextIndexer (DeepSeek-V3.2 DSA plus GLM's k-pools):
- keys k_t = LayerNorm(wk(x_t)) [K]; pools are runs of L consecutive *valid* tokens starting at the first
  non-padding token of each row; a pool's key is softmax_over_its_tokens(gate(x_t) + ape) weighted sum of k_t.
- score(t, p) = sum_h w_h(t) * relu(q_h(t) . key_p * K^-0.5), with q = wq_b(q_resid) and
  w = weights_proj(x) * H^-0.5.
- a pool is a candidate for query t only if it is complete and its last token is causally visible;
  the best index_topk / L candidates are expanded to their tokens, and the visible incomplete tail
  (up to L - 1 tokens) is appended when `index_kpool_always_select_tail`.
- -1 marks an empty slot; padding queries get only -1. J = index_topk (+ L - 1 with the tail).
The selection is not differentiable; transformers runs it under no_grad and so does the forward here.
`score_and_select(..., grad=True)` also returns the scores with gradient for the indexer KL loss
(glm53/losses/parts.py).
Packed documents (`cu_seqlens`, model/packing.py): pools start at each document's first valid token and never
run past its end, a query's candidates are complete pools of its own document, and the tail is its document's.
Context parallelism (`shards`, ForwardContext.cp): a rank scores its own queries against the pools of the whole
sequence, built from gathered per-token keys at global positions (`select` / `visible_tail` take the queries'
`query_offset` into the keys' sequence).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Glm53Config
from ..hooks import as_local
from ..kernels import kernel_op
from ..kernels.indexer_topk import pool_starts
from ..kernels.varlen import own_document_pools
from ..utils import ceil_div
from .context import SequenceShards
from .norm import LayerNorm
from .packing import document_pool_layout
from .pool_selection import (
    cached_slots,
    cached_tokens,
    first_valid_position,
    select_pools,
    select_pools_blocked,
    slot_count,
    visible_tail,
)

# kernels resolved once; use_backend keeps them current (kernels/dispatch.py)
indexer_scores, indexer_topk_pools = kernel_op("indexer_scores"), kernel_op("indexer_topk_pools")

K_NORM_EPS = 1e-6  # the indexer's key LayerNorm epsilon (transformers)


def pool_layout(
    valid: torch.Tensor, kpool: int, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pools of `kpool` consecutive positions from each row's (packed: each document's) first valid token.

    -> positions [B, P, L] (may run past T), which of them are valid tokens [B, P, L], and the pools complete in
    some row [P] (transformers drops the others, which changes how many are picked: `select_pools`).
    """
    if cu_seqlens is not None:
        positions, token_valid = document_pool_layout(valid, cu_seqlens, kpool)
        return positions, token_valid, token_valid.all(-1).any(0)
    B, T = valid.shape
    P = ceil_div(T, kpool)
    offsets = torch.arange(P * kpool, device=valid.device).view(1, P, kpool)
    positions = first_valid_position(valid)[:, None, None] + offsets
    batch = torch.arange(B, device=valid.device)[:, None, None]
    token_valid = valid[batch, positions.clamp(0, T - 1)] & (positions < T)
    return positions, token_valid, token_valid.all(-1).any(0)


def kept_pools(
    valid: torch.Tensor, kpool: int, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools the indexer scores: token positions [B, P, L] (-1 where invalid) and completeness [B, P].

    Every pool of the layout, also those incomplete in every row, which transformers drops: P follows from the
    shapes alone, so torch.compile traces it without a data-dependent size. Such pools are never candidates,
    and `Indexer.select` picks among the others exactly as transformers does."""
    positions, token_valid, _ = pool_layout(valid, kpool, cu_seqlens)
    return positions.masked_fill(~token_valid, -1), token_valid.all(-1)


class Indexer(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.index_topk = config.index_topk
        self.kpool = config.index_kpool
        self.select_tail = config.index_kpool_always_select_tail
        self.initializer_range = config.initializer_range
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = LayerNorm(self.head_dim, eps=K_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(self.kpool, self.head_dim))  # [L, K]
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.head_dim, config.hidden_size))  # [K, D]

    @property
    def num_slots(self) -> int:
        return slot_count(self.index_topk, self.kpool, self.select_tail)

    def pools(
        self, x: torch.Tensor, valid: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pool keys [B, P, K], their token positions [B, P, L] (-1 where invalid), completeness [B, P]."""
        return self.pool(*self.token_keys(x), valid, cu_seqlens)

    def token_keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> per-token keys [B, T, K] and pooling-gate logits [B, T, K] (x's dtype)."""
        return self.k_norm(self.wk(x)), F.linear(x, as_local(self, "index_kpool_compress_gate"))

    def pool(
        self, keys: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`pools` from per-token keys and gate logits [B, T, K] (context parallelism gathers these, not x)."""
        T = valid.shape[1]
        positions, token_valid, _ = pool_layout(valid, self.kpool, cu_seqlens)  # every pool (kept_pools)
        safe = positions.clamp(0, T - 1)
        batch = torch.arange(valid.shape[0], device=keys.device)[:, None, None]
        complete = token_valid.all(-1)  # [B, P]
        pool_keys = self.pool_weighted(keys[batch, safe], gate[batch, safe], token_valid)
        return pool_keys, positions.masked_fill(~token_valid, -1), complete

    def pool_weighted(self, keys: torch.Tensor, gate: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
        """One pool's key from its tokens' keys [..., L, K] and gate logits [..., L, K], valid [..., L] -> [..., K]:
        softmax over the tokens of gate + ape (per channel, fp32), then the weighted sum of the keys."""
        logits = gate.float() + as_local(self, "index_kpool_compress_ape").float()
        logits = logits.masked_fill(~token_valid[..., None], float("-inf"))
        weights = torch.nan_to_num(logits.softmax(dim=-2)).to(keys.dtype)  # all-invalid pools -> 0
        return (weights * keys).sum(dim=-2)

    def scores(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        pool_keys: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        pool_start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, T, P] fp32 index scores: sum_h w_h relu(q_h . key_p / sqrt(K)) (kernels/indexer_scores.py);
        packed: 0 for pools of other documents."""
        q, w = self._queries(x, q_resid)
        if cu_seqlens is None:
            return indexer_scores(q, w, pool_keys, self.head_dim**-0.5)
        return indexer_scores(q, w, pool_keys, self.head_dim**-0.5, cu_seqlens=cu_seqlens, pool_start=pool_start)

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        valid: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        shards: SequenceShards | None = None,
    ) -> torch.Tensor:
        """x [B, T, D], q_resid [B, T, R], valid [B, T] bool -> top-k key positions [B, T, J] int64 (`shards`:
        as `score_and_select`). Scoring and choosing run fused, a block of queries at a time (`select_pools_blocked`,
        a custom op: eager and compiled, packed or not): `score_and_select`'s top-k (up to rounding-level near-ties,
        kernels/indexer_topk.py) without its [B, T, P] scores and masks."""
        offset = 0 if shards is None else shards.offset
        keys, gate = self.token_keys(x)
        if shards is not None:
            keys, gate = shards.all_gather(keys, dim=1), shards.all_gather(gate, dim=1)
        pool_keys, positions, complete = self.pool(keys, gate, valid, cu_seqlens)
        q, w = self._queries(x, q_resid)
        return select_pools_blocked(
            q,
            w,
            pool_keys,
            positions,
            complete,
            valid,
            cu_seqlens,
            self.head_dim**-0.5,
            offset,
            self.index_topk,
            self.kpool,
            self.select_tail,
        )

    def score_and_select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        valid: torch.Tensor,
        grad: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        shards: SequenceShards | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (top-k [B, T, J], scores [B, T, P] fp32, candidate pools [B, T, P], selected pools [B, T, P]).

        With `grad` (and grad mode on) the scores carry gradient to this indexer's own parameters only: its
        inputs are detached, so the indexer KL loss (losses.py) trains the indexer and nothing else, and the
        selection itself, made from detached scores, is never differentiated (DeepSeek-V3.2).
        With `shards` (context parallelism, ForwardContext.cp): x and q_resid are this rank's queries, at global
        positions shards.offset + [0, T); `valid` [B, S] and `cu_seqlens` (over B * S) describe the whole
        sequence; the per-token keys and gate logits are gathered from every rank (their gradient flows back to
        the owner) and pooled at global positions, so a pool straddling a rank boundary is the one-process pool.
        The outputs are this rank's query rows; top-k holds global key positions.
        """
        offset = 0 if shards is None else shards.offset
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            pool_keys, positions, complete = self.detached_pools(x, valid, cu_seqlens, shards)
            start = None if cu_seqlens is None else pool_starts(positions, valid.shape[1])
            if shards is None:
                scores = self.scores(x.detach(), q_resid.detach(), pool_keys, cu_seqlens, start)
            else:  # the packed kernel's queries are the keys' own positions: mask other documents' pools here
                scores = self.scores(x.detach(), q_resid.detach(), pool_keys)
                if cu_seqlens is not None:
                    scores = scores * own_document_pools(start, cu_seqlens, valid.shape[1], offset, x.shape[1])
        with torch.no_grad():
            topk, candidate, selected = self.select(
                scores.detach(), positions, complete, valid, cu_seqlens, query_offset=offset
            )
        return topk, scores, candidate, selected

    def detached_pools(
        self,
        x: torch.Tensor,
        valid: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        shards: SequenceShards | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`pools` of the detached x (gathered under `shards`, as `score_and_select`): gradient to this indexer's
        own parameters only."""
        keys, gate = self.token_keys(x.detach())
        if shards is not None:
            keys, gate = shards.all_gather(keys, dim=1), shards.all_gather(gate, dim=1)
        return self.pool(keys, gate, valid, cu_seqlens)

    def kl_inputs(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        valid: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        shards: SequenceShards | None = None,
    ) -> dict:
        """What the recomputing indexer KL (losses/indexer_kl.py) scores query blocks from, with gradient to this
        indexer's parameters only (inputs detached, as `score_and_select(grad=True)`): the per-head queries
        [B, T, H, K], head weights [B, T, H] fp32, pool keys [B, P, K], the pools' token positions [B, P, L] and
        completeness [B, P]. O(T) memory: the [B, T, P] scores are never made here. `shards`: as
        `score_and_select` (this rank's queries; the pools of the whole sequence, gathered)."""
        pool_keys, positions, complete = self.detached_pools(x, valid, cu_seqlens, shards)
        q, w = self._queries(x.detach(), q_resid.detach())
        return dict(q=q, weights=w, pool_keys=pool_keys, positions=positions, complete=complete)

    def select(
        self,
        scores: torch.Tensor,
        positions: torch.Tensor,
        complete: torch.Tensor,
        valid: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        query_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k pools -> (token positions [B, T, J], candidate pools [B, T, P], selected pools [B, T, P]).

        scores [B, T, P] are the queries at positions query_offset + [0, T) of the keys' sequence: `valid` [B, S]
        and `cu_seqlens` (over B * S) describe the keys (T == S with offset 0 when queries and keys coincide).
        Pools incomplete in every row (kept_pools) are never candidates; the choice among the others is
        transformers' over its pool axis without them (`select_pools`, a custom op for torch.compile).
        """
        return select_pools(
            scores, positions, complete, valid, cu_seqlens, query_offset, self.index_topk, self.kpool, self.select_tail
        )

    def _queries(self, x: torch.Tensor, q_resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> per-head queries q [B, T, H, K] and head weights w [B, T, H] fp32 (scaled by H^-0.5)."""
        q = self.wq_b(q_resid).view(*q_resid.shape[:2], self.n_heads, self.head_dim)
        return q, self.weights_proj(x).float() * self.n_heads**-0.5

    @torch.no_grad()
    def cached_select(self, x: torch.Tensor, q_resid: torch.Tensor, generation, cache) -> torch.Tensor:
        """Top-k [B, T, J] of a forward on a generation cache (model/cache.py): this forward's tokens extend the
        cached pools, then each query ranks its candidates among the cached pools. The prefill (a host-known
        position 0) scores and chooses a block of queries at a time (kernel "indexer_topk_pools": no [B, T, P]
        scores); a step after it scores every cached pool ([B, T, P] for its few queries, no host read)."""
        keys, gate = self.token_keys(x)
        self.extend_pools(keys, gate, generation, cache)
        query_pos = generation.new_positions(x.shape[1])
        if generation.started:
            scores = self.scores(x, q_resid, cache.pool_keys[:, :-1])  # [B, T, P] fp32
            return cached_slots(
                scores, generation.first, query_pos, self.kpool, self.index_topk, self.select_tail, self.num_slots
            )
        q, w = self._queries(x, q_resid)
        pool_keys, L = cache.pool_keys[:, :-1], self.kpool
        P = pool_keys.shape[1]
        # pool p of row b ends at first_b + pL + L - 1: a candidate of the queries at or after it (cached_slots)
        pool_end = generation.first[:, None] + torch.arange(P, device=x.device) * L + (L - 1)
        chosen, chosen_ok = indexer_topk_pools(
            q,
            w,
            pool_keys,
            self.head_dim**-0.5,
            pool_end,
            torch.ones_like(pool_end, dtype=torch.bool),
            0,
            min(self.index_topk // L, P),
        )
        return cached_tokens(chosen, chosen_ok, generation.first, query_pos, L, self.select_tail, self.num_slots)

    def extend_pools(self, keys: torch.Tensor, gate: torch.Tensor, generation, cache) -> None:
        """Store this forward's token keys and gate logits [B, T, K] in the cache's ring and pool every k-pool
        they complete (the incremental form of `pool`: a pool's L tokens are the ring's last ones and the new)."""
        B, T, K = keys.shape
        L, R = self.kpool, cache.ring_keys.shape[1]
        pos = generation.new_positions(T)  # [T]
        before = (generation.length - (L - 1) + torch.arange(L - 1, device=keys.device)).remainder(R)  # [L-1]
        seen_keys = torch.cat([cache.ring_keys[:, before], keys.to(cache.ring_keys.dtype)], dim=1)  # [B, L-1+T, K]
        seen_gate = torch.cat([cache.ring_gate[:, before], gate.float()], dim=1)
        window = torch.arange(T, device=keys.device)[:, None] + torch.arange(L, device=keys.device)  # [T, L]
        ones = torch.ones(T, L, dtype=torch.bool, device=keys.device)
        pooled = self.pool_weighted(seen_keys[:, window], seen_gate[:, window], ones)  # [B, T, K]: a pool ending here
        count = pos[None, :] - generation.first[:, None] + 1  # [B, T] the row's tokens up to each position
        done = (count > 0) & (count.remainder(L) == 0)
        discard = cache.pool_keys.shape[1] - 1
        target = torch.where(done, count.div(L, rounding_mode="floor") - 1, discard)
        cache.pool_keys.scatter_(1, target[..., None].expand(B, T, K), pooled.to(cache.pool_keys.dtype))
        n = min(T, R)
        cache.ring_keys.index_copy_(1, pos[T - n :].remainder(R), keys[:, T - n :].to(cache.ring_keys.dtype))
        cache.ring_gate.index_copy_(1, pos[T - n :].remainder(R), gate[:, T - n :].float())

    def visible_tail(
        self,
        valid: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        query_offset: int = 0,
        num_queries: int | None = None,
    ) -> torch.Tensor:
        """The tokens of each query's incomplete pool: [B, T, L-1] positions, -1 where empty.

        Queries are positions query_offset + [0, T) (T = num_queries, default all S) of the sequence `valid`
        [B, S] and `cu_seqlens` (over B * S) describe.
        """
        return visible_tail(valid, self.kpool, cu_seqlens, query_offset, num_queries)

    def init_weights(self) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            nn.init.normal_(linear.weight, std=self.initializer_range)
        self.k_norm.init_weights()
        nn.init.zeros_(self.index_kpool_compress_ape)
        nn.init.ones_(self.index_kpool_compress_gate)
