"""The generation cache: what each attention layer keeps between forwards so a decode step costs O(1) (KDA) or
O(index_topk) (MLA) instead of a forward over the whole sequence.

Legend (glm53/model/__init__.py): B batch, T new positions, S cached positions (padding included), H KDA heads,
K key head width (KDA; the indexer's head width for its pools), V KDA value width, W conv width, Z kv_lora_rank,
L tokens per k-pool (index_kpool), P k-pools.
Per KDA layer (`KdaLayerCache`): the fp32 recurrent state [B, H, K, V] and the q, k, v conv histories side by
side, time-major [B, W-1, 3*H*K] (the last W-1 inputs of each short conv; one tensor so a decode step convolves
all three at once). Neither grows with the context.
Per MLA layer (`MlaLayerCache`): the normed kv latent [B, S, Z] (what attention reads: keys and values are maps
of it), per request its first token and its token count (its tokens are contiguous from the first), and, for layers with
their own indexer, the pooled keys of complete k-pools [B, P, K] plus the pool being filled (its tokens' keys
[B, L, K] and fp32 gate logits [B, L, K]). Shared-indexer layers keep no indexer state.
Bytes per cached token (Z kv_lora_rank, K the indexer's head width, L index_kpool, b bytes per element): a
full-indexer MLA layer keeps b(Z + K/L), a shared one bZ; transformers 5.23 keeps b(Z + 2K + 1) (the latent, and per
token the indexer key, its gate logits and a valid flag) and bZ. Nothing smaller is exact: any complete pool may be
selected later, so every latent row stays, and the pooled keys are what the indexer scores. `latent_dtype` (e.g.
torch.bfloat16 for an fp32 model) stores the latent rounded to a narrower dtype: fewer bytes, no longer exact;
torch.int8 stores each row as int8 with one fp32 scale (absmax / 127): Z + 4 bytes per row.
Positions are one time axis for the whole batch: a left-padded prompt fills positions [0, T) (padding included,
never selected), each decode step appends one position per row, so a row's tokens are contiguous from `first`.

Speculative decoding rewinds: `mark()` records where the cache stands, the forwards after it record per token
what a rewind needs (KDA: the state after every token and the conv inputs; MLA: the indexer keys and gate
logits), and `rewind(keep)` returns to the mark and re-applies the first `keep` tokens seen since.
The layer forwards live in layers.py; `KimiDeltaAttention.forward` / `MultiHeadLatentAttention.forward` call
`ctx.cache.kda_forward` / `ctx.cache.mla_forward` when a cache rides on the forward context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import Glm53Error
from ..model.inputs import check_device
from . import layers

GROWTH = 2  # latent / pool buffers grow geometrically, so appends are amortised O(1)
INT8_MAX = 127  # an int8 latent row is round(latent / scale) with scale = absmax(row) / INT8_MAX
LATENT_DTYPES = "None (exact), a floating dtype of 16 bits or more (torch.bfloat16, torch.float16, ...) or torch.int8"


class CacheError(Glm53Error):
    """A generation cache used with a model, batch or input it was not built for."""


class GenerationError(Glm53Error):
    """A `generate` argument out of range: names the argument and the bad value."""


def _grow(buf: torch.Tensor, needed: int, dim: int = 1, exact: bool = False) -> torch.Tensor:
    """`buf` with at least `needed` slots along `dim` (contents kept, new slots zero); `exact`: no more than that."""
    if buf.shape[dim] >= needed:
        return buf
    shape = list(buf.shape)
    shape[dim] = needed if exact else max(needed, GROWTH * buf.shape[dim])
    out = buf.new_zeros(shape)
    out.narrow(dim, 0, buf.shape[dim]).copy_(buf)
    return out


class KdaLayerCache:
    """One KDA layer: recurrent state [B, H, K, V] fp32 and the q | k | v conv histories [B, W-1, 3*H*K]."""

    def __init__(self) -> None:
        self.length = 0  # positions seen (prompt padding included)
        self.state: torch.Tensor | None = None
        self.conv: torch.Tensor | None = None  # [B, W-1, 3*H*K]
        self._mark: tuple | None = None  # (length, state, conv) at mark()
        self._states: list[torch.Tensor] = []  # state after each token since the mark
        self._inputs: list[torch.Tensor] = []  # conv inputs [B, T, 3*H*K] per forward since it

    @property
    def marked(self) -> bool:
        return self._mark is not None

    def mark(self) -> None:
        self._mark = (self.length, self.state, self.conv)
        self._states, self._inputs = [], []

    def check_batch(self, B: int) -> None:
        """An input of B rows continues this cache only if it holds B rows (or nothing yet)."""
        if self.state is not None and self.state.shape[0] != B:
            raise CacheError(f"the cache holds a batch of {self.state.shape[0]} rows, the input has {B}")

    def record(self, states: list[torch.Tensor], inputs: torch.Tensor) -> None:
        self._states.extend(states)
        self._inputs.append(inputs)

    def rewind(self, keep: int) -> None:
        """Back to the mark, then forward by the first `keep` tokens seen since (no recompute: stored states)."""
        if self._mark is None:
            raise CacheError("rewind() needs an earlier mark()")
        length, state0, conv0 = self._mark
        if keep == self.length - length:  # every token since the mark stays: the cache already stands there
            self._mark, self._states, self._inputs = None, [], []
            return
        self.length = length + keep
        self.state = state0 if keep == 0 else self._states[keep - 1]
        seen = torch.cat(self._inputs, dim=1)[:, :keep]  # [B, keep, 3*H*K]
        self.conv = torch.cat([conv0, seen.to(conv0.dtype)], dim=1)[:, keep:]
        self._mark, self._states, self._inputs = None, [], []

    def nbytes(self) -> int:
        tensors = [t for t in (self.state, self.conv) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class _PoolState:
    """The indexer's incremental k-pool state of one MLA layer (per row: complete pools, the pool being filled)."""

    keys: torch.Tensor  # [B, P, K] pooled keys of complete pools (rows past `count` are stale)
    count: torch.Tensor  # [B] complete pools per row
    partial_keys: torch.Tensor  # [B, L, K] keys of the tokens of the pool being filled
    partial_gate: torch.Tensor  # [B, L, K] fp32 gate logits (ape not yet added) of those tokens
    partial_count: torch.Tensor  # [B] tokens in the pool being filled

    def clone_small(self) -> "_PoolState":
        """A copy that shares the pooled-key buffer (rewinding only lowers counts; rows below them never change)."""
        return _PoolState(self.keys, self.count.clone(), self.partial_keys.clone(), self.partial_gate.clone(),
                          self.partial_count.clone())  # fmt: skip


class MlaLayerCache:
    """One MLA layer: normed latent [B, S, Z], per-row first token / token count, the indexer's pool state."""

    def __init__(self, latent_dtype: torch.dtype | None = None) -> None:
        self.latent_dtype = latent_dtype  # None: the model's dtype (exact); else the latent is rounded to it
        self.length = 0  # cached positions S (the same for every row)
        self.latent: torch.Tensor | None = None  # [B, capacity, Z]
        self.scale: torch.Tensor | None = None  # [B, capacity] fp32 per-row scales of an int8 latent
        self.first: torch.Tensor | None = None  # [B] position of each row's first token
        self.count: torch.Tensor | None = None  # [B] tokens per row
        self.max_count = 0  # max(count), kept on the host so the pool width needs no device sync
        self.counts_host: list[int] = []  # count per row on the host (known since the prefill; steps add to it)
        self.pools: _PoolState | None = None
        self._mark: tuple | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (key, gate, valid) per token

    @property
    def marked(self) -> bool:
        return self._mark is not None

    def append(self, latent: torch.Tensor) -> int:
        """Append T positions (latent [B, T, Z]) -> the position of the first one. Which positions are tokens
        follows from `first` (a row's tokens are contiguous from there), so no mask is kept."""
        B, T, Z = latent.shape
        start = self.length
        if self.latent is None:
            self.latent = latent.new_zeros(B, T, Z, dtype=self.latent_dtype or latent.dtype)
            if self.latent_dtype == torch.int8:
                self.scale = latent.new_zeros(B, T, dtype=torch.float32)
        elif self.latent.shape[0] != B:
            raise CacheError(f"the cache holds a batch of {self.latent.shape[0]} rows, the input has {B}")
        self.ensure(start + T)
        self.write(start, latent)
        self.length = start + T
        return start

    def ensure(self, positions: int, exact: bool = False) -> None:
        """Room for `positions` cached positions in the latent buffers (`exact`: no more)."""
        self.latent = _grow(self.latent, positions, exact=exact)
        if self.scale is not None:
            self.scale = _grow(self.scale, positions, exact=exact)

    def write(self, start: int, latent: torch.Tensor) -> None:
        """Store latent [B, T, Z] at positions start .. start+T-1 (rounded or quantised to the cache's dtype)."""
        T = latent.shape[1]
        if self.scale is None:
            self.latent[:, start : start + T] = latent
            return
        absmax = latent.float().abs().amax(dim=-1)  # [B, T]
        scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
        self.latent[:, start : start + T] = (latent.float() / scale[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX)
        self.scale[:, start : start + T] = scale

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Latent rows at flat indices (b * capacity + position) [n] -> [n, Z] (fp32 when quantised)."""
        rows = self.latent.reshape(-1, self.latent.shape[-1]).index_select(0, index)
        if self.scale is None:
            return rows
        return rows.float() * self.scale.reshape(-1).index_select(0, index)[:, None]

    def start_rows(self, valid: torch.Tensor) -> None:
        """First forward (prefill): each row's first token and token count from its padding mask [B, T]."""
        T = valid.shape[1]
        any_token = valid.any(-1)
        self.first = torch.where(any_token, valid.long().argmax(-1), torch.full_like(any_token, T, dtype=torch.long))
        self.count = valid.long().sum(-1)
        if not bool((self.count == T - self.first).all()):  # NOTE: syncs (once, at prefill)
            raise CacheError("a cached prefill needs a left-padded attention_mask (0s then 1s in every row): decode "
                             "steps append after each row's last position")  # fmt: skip
        self.counts_host = self.count.tolist()
        self.max_count = max(self.counts_host)

    def advance(self, valid: torch.Tensor) -> None:
        """Decode steps: every row gains T tokens (valid [B, T] must be all True)."""
        if not bool(valid.all()):  # NOTE: syncs
            raise CacheError("decode steps after a cached prefill take tokens only (an all-ones attention_mask)")
        T = valid.shape[1]
        self.count = self.count + T
        self.max_count += T
        self.counts_host = [c + T for c in self.counts_host]

    def start_pools(self, keys, count, partial_keys, partial_gate, partial_count, ape: torch.Tensor) -> None:
        """Prefill: the pool state (see _PoolState) and the indexer's per-slot gate offset ape [L, K]."""
        self.pools = _PoolState(keys, count, partial_keys, partial_gate, partial_count)
        self._ape = ape

    def push_pool_token(self, key: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, valid: torch.Tensor) -> None:
        """Add one token (key [B, K], fp32 gate logits [B, K], valid [B]) to each row's pool being filled; a pool
        that becomes complete is pooled (softmax over its L tokens of gate + ape, per channel) and stored."""
        ps = self.pools
        if self.marked:
            self._pending.append((key, gate, valid))
        B, L = key.shape[0], ps.partial_keys.shape[1]
        rows = torch.arange(B, device=key.device)
        slot = ps.partial_count.clamp(max=L - 1)
        keep = valid[:, None]
        ps.partial_keys[rows, slot] = torch.where(keep, key.to(ps.partial_keys.dtype), ps.partial_keys[rows, slot])
        ps.partial_gate[rows, slot] = torch.where(keep, gate, ps.partial_gate[rows, slot])
        ps.partial_count = ps.partial_count + valid.long()
        done = ps.partial_count == L  # [B]
        weights = torch.nan_to_num((ps.partial_gate + ape.float()).softmax(dim=1)).to(ps.partial_keys.dtype)
        pooled = (weights * ps.partial_keys).sum(dim=1)  # [B, K]
        ps.keys = _grow(ps.keys, int(self.max_count) // L + 1)
        at = ps.count.clamp(max=ps.keys.shape[1] - 1)
        ps.keys[rows, at] = torch.where(done[:, None], pooled, ps.keys[rows, at])
        ps.count = ps.count + done.long()
        ps.partial_count = ps.partial_count.masked_fill(done, 0)

    def mark(self) -> None:
        pools = self.pools.clone_small() if self.pools is not None else None
        self._mark = (self.length, self.count, self.max_count, pools, self.counts_host)
        self._pending = []

    def rewind(self, keep: int) -> None:
        """Back to the mark, then re-apply the first `keep` positions appended since (their latent is still there)."""
        if self._mark is None:
            raise CacheError("rewind() needs an earlier mark()")
        length, count, max_count, pools, counts_host = self._mark
        if keep == self.length - length:  # every position since the mark stays: the cache already stands there
            self._mark, self._pending = None, []
            return
        pending = self._pending[:keep]
        self._mark, self._pending = None, []
        self.length, self.count, self.max_count, self.pools = length + keep, count + keep, max_count + keep, pools
        self.counts_host = [c + keep for c in counts_host]
        if pools is not None:
            self.max_count = max_count
            for step, (key, gate, valid) in enumerate(pending, start=1):
                self.max_count = max_count + step
                self.push_pool_token(key, gate, self._ape, valid)

    def reserve(self, positions: int) -> None:
        """Allocate the latent (and pooled-key) buffers for `positions` cached positions now, exactly: later appends
        up to there copy nothing."""
        if self.latent is not None:
            self.ensure(positions, exact=True)
        if self.pools is not None:
            L = self.pools.partial_keys.shape[1]
            self.pools.keys = _grow(self.pools.keys, positions // L + 1, exact=True)

    def nbytes(self) -> int:
        """Bytes of what is cached (the filled part of the buffers)."""
        if self.latent is None:
            return 0
        S = self.length
        total = self.latent[:, :S].numel() * self.latent.element_size()
        if self.scale is not None:
            total += self.scale[:, :S].numel() * self.scale.element_size()
        total += sum(t.numel() * t.element_size() for t in (self.first, self.count))
        if self.pools is not None:
            ps = self.pools
            P = min(ps.keys.shape[1], self.max_count // ps.partial_keys.shape[1])
            total += ps.keys[:, :P].numel() * ps.keys.element_size()
            total += sum(t.numel() * t.element_size() for t in (ps.partial_keys, ps.partial_gate, ps.count,
                                                                 ps.partial_count))  # fmt: skip
        return total


class GenerationCache:
    """Every attention layer's cache for one model (`part="main"`: the decoder stack; `"mtp"`: its MTP layers).

    Pass it to `Glm53Model.forward(..., cache=cache)`: the first forward is the prefill (any padding mask, left
    padding for generation), each later forward appends decode tokens (all valid) after it; or run decode steps with
    `glm53.generation.decode.decode_step`. `latent_dtype`: see the module docstring (None: exact).
    """

    def __init__(self, model: nn.Module, part: str = "main", latent_dtype: torch.dtype | None = None) -> None:
        if part == "main":
            attention = [layer.self_attn for layer in model.model.layers]
        elif part == "mtp":
            if getattr(model, "mtp", None) is None:
                raise CacheError("part='mtp' needs a model with MTP layers (num_nextn_predict_layers > 0)")
            attention = [layer.self_attn for layer in model.mtp.layers]
        else:
            raise CacheError(f"part must be 'main' or 'mtp', got {part!r}")
        if latent_dtype is not None and latent_dtype != torch.int8 and (
                not isinstance(latent_dtype, torch.dtype) or not latent_dtype.is_floating_point
                or latent_dtype.itemsize < 2):  # fmt: skip
            raise CacheError(f"latent_dtype must be {LATENT_DTYPES}, got {latent_dtype!r}")
        self.part = part
        self.model_id = id(model)
        self.decode_plan = None  # glm53/generation/decode.py: per-layer constants of the T = 1 step, made once
        self.verify_plan = None  # glm53/generation/verify.py: the T-token step's mHC sites, made once per T
        self.marked = False
        self._layers: dict[int, KdaLayerCache | MlaLayerCache] = {}
        for module in attention:
            is_kda = hasattr(module, "A_log")
            self._layers[id(module)] = KdaLayerCache() if is_kda else MlaLayerCache(latent_dtype)

    def layer(self, module: nn.Module, kind: type) -> KdaLayerCache | MlaLayerCache:
        cache = self._layers.get(id(module))
        if cache is None or not isinstance(cache, kind):
            raise CacheError(f"this generation cache was built for another model (or part {self.part!r}): it has no "
                             f"entry for this {type(module).__name__}")  # fmt: skip
        return cache

    def kda_forward(self, module: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
        return layers.kda_cached_forward(module, x, ctx, self.layer(module, KdaLayerCache))

    def mla_forward(self, module: nn.Module, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        return layers.mla_cached_forward(module, x, ctx, self.layer(module, MlaLayerCache))

    @property
    def seq_len(self) -> int:
        """Positions cached (prompt padding included; every layer holds as many, KDA ones too); 0 before the prefill."""
        return next(iter(self._layers.values())).length if self._layers else 0

    def mark(self) -> None:
        for cache in self._layers.values():
            cache.mark()
        self.marked = True

    def rewind(self, keep: int) -> None:
        """Back to the last `mark()`, keeping the first `keep` positions appended since."""
        for cache in self._layers.values():
            cache.rewind(keep)
        self.marked = False

    def reserve(self, positions: int) -> None:
        """Size every MLA layer's buffers for `positions` cached positions (after the prefill; see MlaLayerCache)."""
        for cache in self._layers.values():
            if isinstance(cache, MlaLayerCache):
                cache.reserve(positions)

    def nbytes(self) -> int:
        """Bytes held by every layer's cache."""
        return sum(c.nbytes() for c in self._layers.values())

    def bytes_per_token(self) -> float:
        """nbytes / cached positions (KDA state amortised over the context)."""
        return self.nbytes() / max(1, self.seq_len)


def check_step_inputs(step: str, model, cache: object, ids: object) -> None:
    """decode_step / verify_step: a GenerationCache and integer ids on the model's device (a meta id tensor
    decoded NaNs, a float one failed in F.embedding). Host-free: the ids' values are not read here, as each step
    of `generate` feeds ids the model chose itself."""
    if not isinstance(cache, GenerationCache):
        raise CacheError(f"{step} takes a GenerationCache, got {type(cache).__name__}")
    if not isinstance(ids, torch.Tensor):
        raise CacheError(f"{step} takes ids as a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.long, torch.int):
        raise CacheError(f"{step} takes integer ids (torch.long or torch.int32), got {ids.dtype}")
    check_device("ids", ids, model.lm_head.weight.device)


__all__ = ["CacheError", "GenerationError", "GenerationCache", "KdaLayerCache", "MlaLayerCache", "check_step_inputs"]
