"""The DSA indexer with k-pools: picks, for every query, the key positions sparse attention may read.

Legend: B batch, T time (queries and keys: no cache), D model width, R q_lora_rank, H indexer heads,
K indexer head width, P pools, L = index_kpool tokens per pool, J output slots.
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
(glm53/training/losses.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..boundary import as_local
from ..config import Glm53Config
from ..utils import ceil_div
from ..kernels import kernel
from .norm import LayerNorm

K_NORM_EPS = 1e-6  # the indexer's key LayerNorm epsilon (transformers)


def first_valid_position(valid: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B] index of the first True (T for an all-False row)."""
    T = valid.shape[-1]
    return torch.where(valid.any(-1), valid.long().argmax(-1), torch.full_like(valid[:, 0], T, dtype=torch.long))


def pool_layout(valid: torch.Tensor, kpool: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pools of `kpool` consecutive positions from each row's first valid token.

    -> positions [B, P, L] (may run past T), which of them are valid tokens [B, P, L], and which pools to keep
    [P]: pools incomplete in every row are dropped (transformers does the same; it changes how many are picked).
    """
    B, T = valid.shape
    P = ceil_div(T, kpool)
    offsets = torch.arange(P * kpool, device=valid.device).view(1, P, kpool)
    positions = first_valid_position(valid)[:, None, None] + offsets
    batch = torch.arange(B, device=valid.device)[:, None, None]
    token_valid = valid[batch, positions.clamp(0, T - 1)] & (positions < T)
    return positions, token_valid, token_valid.all(-1).any(0)


def kept_pools(valid: torch.Tensor, kpool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools the indexer scores: token positions [B, P, L] (-1 where invalid) and completeness [B, P]."""
    positions, token_valid, keep = pool_layout(valid, kpool)
    return positions.masked_fill(~token_valid, -1)[:, keep], token_valid.all(-1)[:, keep]


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
        return self.index_topk + (self.kpool - 1 if self.select_tail else 0)

    def pools(self, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pool keys [B, P, K], their token positions [B, P, L] (-1 where invalid), completeness [B, P]."""
        T = valid.shape[1]
        keys = self.k_norm(self.wk(x))  # [B, T, K]
        gate = F.linear(x, as_local(self, "index_kpool_compress_gate"))  # [B, T, K]
        positions, token_valid, keep = pool_layout(valid, self.kpool)
        safe = positions.clamp(0, T - 1)
        batch = torch.arange(valid.shape[0], device=x.device)[:, None, None]
        complete = token_valid.all(-1)  # [B, P]
        logits = gate[batch, safe].float() + as_local(self, "index_kpool_compress_ape").float()
        logits = logits.masked_fill(~token_valid[..., None], float("-inf"))
        weights = torch.nan_to_num(logits.softmax(dim=2)).to(keys.dtype)  # all-invalid pools -> 0
        pool_keys = (weights * keys[batch, safe]).sum(dim=2)
        return pool_keys[:, keep], positions.masked_fill(~token_valid, -1)[:, keep], complete[:, keep]

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, pool_keys: torch.Tensor) -> torch.Tensor:
        """[B, T, P] fp32 index scores: sum_h w_h relu(q_h . key_p / sqrt(K)) (kernels/indexer_scores.py)."""
        q = self.wq_b(q_resid).view(*q_resid.shape[:2], self.n_heads, self.head_dim)  # [B, T, H, K]
        w = self.weights_proj(x).float() * self.n_heads**-0.5  # [B, T, H]
        return kernel("indexer_scores")(q, w, pool_keys, self.head_dim**-0.5)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], q_resid [B, T, R], valid [B, T] bool -> top-k key positions [B, T, J] int64."""
        return self.score_and_select(x, q_resid, valid)[0]

    def score_and_select(
        self, x: torch.Tensor, q_resid: torch.Tensor, valid: torch.Tensor, grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (top-k [B, T, J], scores [B, T, P] fp32, candidate pools [B, T, P], selected pools [B, T, P]).

        With `grad` (and grad mode on) the scores carry gradient to this indexer's own parameters only: its
        inputs are detached, so the indexer KL loss (losses.py) trains the indexer and nothing else, and the
        selection itself, made from detached scores, is never differentiated (DeepSeek-V3.2).
        """
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            pool_keys, positions, complete = self.pools(x.detach(), valid)
            scores = self.scores(x.detach(), q_resid.detach(), pool_keys)
        with torch.no_grad():
            topk, candidate, selected = self.select(scores.detach(), positions, complete, valid)
        return topk, scores, candidate, selected

    def select(
        self, scores: torch.Tensor, positions: torch.Tensor, complete: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k pools -> (token positions [B, T, J], candidate pools [B, T, P], selected pools [B, T, P])."""
        B, T = valid.shape
        query_pos = torch.arange(T, device=scores.device)
        # Causal visibility from positions (s <= t; a complete pool's tokens are all valid), no [B, T, T] mask.
        pool_end = positions[..., -1].clamp(0, T - 1)  # [B, P]
        candidate = (pool_end[:, None, :] <= query_pos[None, :, None]) & complete[:, None]  # [B, T, P]
        scores = scores.masked_fill(~candidate, torch.finfo(scores.dtype).min)
        select = min(self.index_topk // self.kpool, scores.shape[-1])
        chosen = scores.topk(select, dim=-1).indices  # [B, T, select]
        chosen_ok = candidate.gather(-1, chosen)
        selected = torch.zeros_like(candidate).scatter_(-1, chosen, chosen_ok)
        tokens = positions[torch.arange(B, device=scores.device)[:, None, None], chosen]  # [B, T, select, L]
        topk = tokens.masked_fill(~chosen_ok[..., None], -1).flatten(-2)
        if self.select_tail:
            topk = torch.cat([topk, self.visible_tail(valid)], dim=-1)
        topk = F.pad(topk, (0, self.num_slots - topk.shape[-1]), value=-1)[..., : self.num_slots]
        return topk.masked_fill(~valid[..., None], -1), candidate, selected

    def visible_tail(self, valid: torch.Tensor) -> torch.Tensor:
        """The tokens of each query's incomplete pool: [B, T, L-1] positions, -1 where empty."""
        B, T = valid.shape
        width = self.kpool - 1
        if width == 0:
            return valid.new_empty(B, T, 0, dtype=torch.long)
        count = valid.long().cumsum(-1)  # [B, T] visible (valid, causal) tokens per query
        tail = count.remainder(self.kpool)
        offsets = torch.arange(width, device=valid.device)
        start = first_valid_position(valid)[:, None] + count - tail
        idx = start[..., None] + offsets  # [B, T, L-1]
        query_pos = torch.arange(T, device=valid.device)[None, :, None]
        safe = idx.clamp(0, T - 1)
        ok = (offsets < tail[..., None]) & (idx < T) & (idx <= query_pos)
        ok = ok & valid.gather(-1, safe.flatten(1)).view_as(safe)
        return idx.masked_fill(~ok, -1)

    def init_weights(self) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            nn.init.normal_(linear.weight, std=self.initializer_range)
        self.k_norm.init_weights()
        nn.init.zeros_(self.index_kpool_compress_ape)
        nn.init.ones_(self.index_kpool_compress_gate)
