"""The generation cache: static, preallocated buffers the attention blocks read and extend (ForwardContext.cache).

Legend (glm53/model/__init__.py): B batch, S positions the buffers hold (the maximum length), T new positions of
one forward, H KDA heads, K KDA key width (V = K values), C KDA channels (H * K), W conv width, Z kv_lora_rank,
Ki the indexer's head width, L tokens per k-pool, P k-pools (ceil(S / L)), R the indexer's ring of recent tokens.
Positions are one time axis for the whole batch: a left-padded prompt fills [0, T) (padding included, never
selected), each later forward appends T positions to every row, so row b's tokens are [first_b, length).
`length` and `first` are device tensors: a decode or verify forward reads no host value, so it compiles with
static shapes (model/kda.py, model/mla.py and model/indexer.py own what is computed; this file only holds it).
- KDA (`KdaCache`): the fp32 recurrent state [B, H, K, V] and the q, k, v conv histories [B, C, W-1] each.
- MLA (`MlaCache`): the normed kv latent [B, S, Z] (optionally rounded to `latent_dtype`, or int8 with one fp32
  scale per row); with its own indexer, the pooled key of every complete k-pool [B, P, Ki] and the per-token keys
  and gate logits of the last R positions (a ring: what the pool being filled, and a rewound one, are made from).
Bytes per cached token: b(Z + Ki/L) for a full-indexer layer, bZ for a shared one (b bytes per element); the KDA
state, the convs and the ring are fixed sizes. Nothing smaller is exact: any complete pool may be selected later.
Speculation: `mark()` keeps the position and the KDA states; forwards after it store each token's KDA state and
conv history (up to `max_step_tokens`); `rewind(keep)` returns to the mark plus the first `keep` tokens. MLA
needs nothing more: its rows past the rewound length are overwritten later, and the ring holds the L - 1 tokens
before any position a rewind can reach.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import Glm53Error

INT8_MAX = 127  # an int8 latent row is round(latent / scale), scale = absmax(row) / INT8_MAX
GROWTH = 2  # a cache without a fixed max_length grows its buffers geometrically (eager forwards only)
DEFAULT_STEP_TOKENS = 17  # tokens one forward may add after mark() (speculative: 16 drafts + 1)
LATENT_DTYPES = "None (exact), a floating dtype of 16 bits or more (torch.bfloat16, torch.float16, ...) or torch.int8"


class CacheError(Glm53Error):
    """A generation cache used with a model, batch or input it was not built for."""


class KdaCache:
    """One KDA layer's recurrent state and conv histories (and, while marked, each new token's)."""

    def __init__(self, module: nn.Module, B: int) -> None:
        w = module.q_conv1d.weight
        C, W = w.shape[0], w.shape[-1]
        H, K = C // module.head_dim, module.head_dim
        dtype = module.q_proj.weight.dtype
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # the kda kernels' compute dtype
        self.state = torch.zeros(B, H, K, K, dtype=state_dtype, device=w.device)
        self.conv = [torch.zeros(B, C, W - 1, dtype=dtype, device=w.device) for _ in range(3)]
        self.steps: tuple | None = None  # (mark state, mark convs, per-token states, per-token convs)

    def reserve_steps(self, n: int) -> None:
        if self.steps is None or self.steps[2].shape[1] < n:
            s, c = self.state, self.conv
            self.steps = (
                torch.zeros_like(s),
                [torch.zeros_like(x) for x in c],
                s.new_zeros(s.shape[0], n, *s.shape[1:]),
                [x.new_zeros(x.shape[0], n, *x.shape[1:]) for x in c],
            )

    def mark(self) -> None:
        self.steps[0].copy_(self.state)
        for saved, conv in zip(self.steps[1], self.conv):
            saved.copy_(conv)

    def rewind(self, keep: int) -> None:
        mark_state, mark_convs, states, convs = self.steps
        self.state.copy_(mark_state if keep == 0 else states[:, keep - 1])
        for conv, saved, per_token in zip(self.conv, mark_convs, convs):
            conv.copy_(saved if keep == 0 else per_token[:, keep - 1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.state, *self.conv))


class MlaCache:
    """One MLA layer's latent rows and (with its own indexer) the pooled keys and the ring of recent tokens."""

    def __init__(self, module: nn.Module, B: int, S: int, ring: int, latent_dtype: torch.dtype | None) -> None:
        w = module.kv_a_proj_with_mqa.weight
        Z = module.kv_a_layernorm.weight.shape[0]
        self.latent = torch.zeros(B, S, Z, dtype=latent_dtype or w.dtype, device=w.device)
        self.scale = torch.ones(B, S, dtype=torch.float32, device=w.device) if latent_dtype == torch.int8 else None
        self.pool_keys = self.ring_keys = self.ring_gate = None
        indexer = module.indexer
        self.kpool = None if indexer is None else indexer.kpool
        if indexer is not None:
            Ki, L = indexer.head_dim, indexer.kpool
            self.pool_keys = torch.zeros(B, -(-S // L) + 1, Ki, dtype=w.dtype, device=w.device)  # + a discard row
            self.ring_keys = torch.zeros(B, ring, Ki, dtype=w.dtype, device=w.device)
            self.ring_gate = torch.zeros(B, ring, Ki, dtype=torch.float32, device=w.device)

    def write(self, positions: torch.Tensor, latent: torch.Tensor) -> None:
        """latent [B, T, Z] at positions [T] (a device tensor: no host read)."""
        if self.scale is None:
            self.latent.index_copy_(1, positions, latent.to(self.latent.dtype))
            return
        absmax = latent.float().abs().amax(dim=-1)  # [B, T]
        scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
        q = (latent.float() / scale[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.latent.index_copy_(1, positions, q)
        self.scale.index_copy_(1, positions, scale)

    def keys(self, dtype: torch.dtype) -> torch.Tensor:
        """Every latent row [B, S, Z] in `dtype` (rows past the length are never selected)."""
        if self.scale is None:
            return self.latent.to(dtype)
        return (self.latent.float() * self.scale[..., None]).to(dtype)

    def nbytes(self, positions: int) -> int:
        """Bytes of the first `positions` rows and the complete pools among them."""
        B, _, Z = self.latent.shape
        total = B * positions * Z * self.latent.element_size() + (0 if self.scale is None else B * positions * 4)
        if self.pool_keys is not None:
            total += B * (positions // self.kpool) * self.pool_keys.shape[-1] * self.pool_keys.element_size()
        return total


class GenerationCache:
    """Every attention layer's cache for one model (`part="main"`: the decoder stack; `"mtp"`: its MTP layers).

    The first forward that carries it (`Glm53Model.forward(..., cache=cache)` or a generation step) is the prefill:
    any left-padded mask; later forwards append tokens (all valid). `max_length`: the positions the buffers hold
    (allocated at the prefill); None grows them as needed (eager forwards only: a compiled step needs fixed ones).
    `latent_dtype`: the MLA latent rounded to a narrower dtype (fewer bytes, no longer exact); None is exact.
    `max_step_tokens`: the most tokens one forward adds after `mark()` (what a rewind can undo).
    """

    def __init__(
        self,
        model: nn.Module,
        part: str = "main",
        latent_dtype: torch.dtype | None = None,
        max_length: int | None = None,
        max_step_tokens: int = DEFAULT_STEP_TOKENS,
    ) -> None:
        if part == "main":
            attention = [layer.self_attn for layer in model.model.layers]
        elif part == "mtp":
            if getattr(model, "mtp", None) is None:
                raise CacheError("part='mtp' needs a model with MTP layers (num_nextn_predict_layers > 0)")
            attention = [layer.self_attn for layer in model.mtp.layers]
        else:
            raise CacheError(f"part must be 'main' or 'mtp', got {part!r}")
        if (
            latent_dtype is not None
            and latent_dtype != torch.int8
            and (
                not isinstance(latent_dtype, torch.dtype)
                or not latent_dtype.is_floating_point
                or latent_dtype.itemsize < 2
            )
        ):
            raise CacheError(f"latent_dtype must be {LATENT_DTYPES}, got {latent_dtype!r}")
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise CacheError(f"max_length must be a positive integer or None, got {max_length!r}")
        self.part = part
        self.latent_dtype = latent_dtype
        self.max_length = max_length
        self.max_step_tokens = max_step_tokens
        self._modules = attention
        self._layers: dict[int, KdaCache | MlaCache] = {}
        self.started = False  # the prefill has run (host flag: decides the prefill path, never a device read)
        self.marked = False
        self.positions = 0  # host mirror of `length` (capacity bookkeeping outside the compiled step)
        self.capacity = 0
        self.length: torch.Tensor | None = None  # [] int64 positions held
        self.first: torch.Tensor | None = None  # [B] int64 each row's first token
        self.mark_length: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------- what layers read
    def layer(self, module: nn.Module) -> KdaCache | MlaCache:
        cache = self._layers.get(id(module))
        if cache is None:
            raise CacheError(
                f"this generation cache was built for another model (or part {self.part!r}): it has no "
                f"entry for this {type(module).__name__}"
            )
        return cache

    def new_positions(self, T: int) -> torch.Tensor:
        """[T] int64 positions this forward writes: length + [0, T)."""
        return self.length + torch.arange(T, device=self.length.device)

    def step_offset(self, T: int) -> torch.Tensor:
        """[T] indices of this forward's tokens among those since mark() (the per-token KDA buffers)."""
        return self.new_positions(T) - self.mark_length

    # ------------------------------------------------------------------------------------------ forward bookkeeping
    def begin(self, valid: torch.Tensor) -> None:
        """Before a forward of valid [B, T]: the prefill sets each row's first token and allocates the buffers."""
        B, T = valid.shape
        if not self.started:
            self._start(valid)
        elif self.first.shape[0] != B:
            raise CacheError(f"the cache holds a batch of {self.first.shape[0]} rows, the input has {B}")
        if self.marked and self.positions + T - self._mark_positions > self.max_step_tokens:
            raise CacheError(
                f"a marked cache takes at most max_step_tokens={self.max_step_tokens} tokens before "
                f"rewind(); got {self.positions + T - self._mark_positions}"
            )
        self._ensure(self.positions + T)

    def end(self, T: int) -> None:
        """After every layer of a forward of T positions ran."""
        self.length.add_(T)
        self.positions += T
        self.started = True

    def check_tokens(self, valid: torch.Tensor) -> None:
        """A user forward after the prefill: every new position must be a token."""
        if self.started and not bool(valid.all()):  # NOTE: syncs (user forwards only, never a generation step)
            raise CacheError("forwards after a cached prefill take tokens only (an all-ones attention_mask)")

    def _start(self, valid: torch.Tensor) -> None:
        B, T = valid.shape
        any_token = valid.any(-1)
        first = torch.where(any_token, valid.long().argmax(-1), torch.full_like(any_token, T, dtype=torch.long))
        if not bool((valid.long().sum(-1) == T - first).all()):  # NOTE: syncs (once, at the prefill)
            raise CacheError(
                "a cached prefill needs a left-padded attention_mask (0s then 1s in every row): later "
                "forwards append after each row's last position"
            )
        self.first = first
        self.length = torch.zeros((), dtype=torch.long, device=valid.device)
        self.mark_length = torch.zeros((), dtype=torch.long, device=valid.device)
        S = self.max_length or T
        if S < T:
            raise CacheError(f"the prompt has {T} positions, more than max_length={self.max_length}")
        self._allocate(B, S)

    def _allocate(self, B: int, S: int) -> None:
        for module in self._modules:
            if hasattr(module, "A_log"):
                self._layers[id(module)] = KdaCache(module, B)
            else:
                # the ring: a pool's L - 1 earlier tokens before any position a rewind can reach
                ring = 1 if module.indexer is None else module.indexer.kpool - 1 + max(self.max_step_tokens, 1)
                self._layers[id(module)] = MlaCache(module, B, S, ring, self.latent_dtype)
        self.capacity = S

    def _ensure(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        if self.max_length is not None:
            raise CacheError(f"the cache holds max_length={self.max_length} positions; this forward needs {needed}")
        S = max(needed, GROWTH * self.capacity)
        for cache in self._layers.values():
            if isinstance(cache, MlaCache):
                cache.latent = _grown(cache.latent, S)
                cache.scale = None if cache.scale is None else _grown(cache.scale, S)
                if cache.pool_keys is not None:
                    cache.pool_keys = _grown(cache.pool_keys, -(-S // cache.kpool) + 1)
        self.capacity = S

    # ---------------------------------------------------------------------------------------------- speculation
    def mark(self) -> None:
        """Remember where the cache stands (see the module docstring)."""
        if not self.started:
            raise CacheError("mark() needs a prefilled cache")
        self.mark_length.copy_(self.length)
        self._mark_positions = self.positions
        for cache in self._layers.values():
            if isinstance(cache, KdaCache):
                cache.reserve_steps(self.max_step_tokens)
                cache.mark()
        self.marked = True

    def rewind(self, keep: int) -> None:
        """Back to the last mark(), keeping the first `keep` positions appended since."""
        if not self.marked:
            raise CacheError("rewind() needs an earlier mark()")
        seen = self.positions - self._mark_positions
        if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= seen:
            raise CacheError(f"rewind(keep) takes an integer in [0, {seen}] (positions since mark()), got {keep!r}")
        if keep < seen:
            for cache in self._layers.values():
                if isinstance(cache, KdaCache):
                    cache.rewind(keep)
            self.length.copy_(self.mark_length + keep)
            self.positions = self._mark_positions + keep
        self.marked = False

    # ------------------------------------------------------------------------------------------------- reporting
    @property
    def seq_len(self) -> int:
        """Positions cached (prompt padding included); 0 before the prefill."""
        return self.positions

    def nbytes(self) -> int:
        """Bytes of what is cached: the filled latent rows and pools, the KDA states and histories."""
        return sum(c.nbytes() if isinstance(c, KdaCache) else c.nbytes(self.positions) for c in self._layers.values())

    def bytes_per_token(self) -> float:
        return self.nbytes() / max(1, self.seq_len)


def _grown(buf: torch.Tensor, n: int) -> torch.Tensor:
    out = buf.new_zeros(buf.shape[0], n, *buf.shape[2:])
    out[:, : buf.shape[1]] = buf
    return out


__all__ = ["CacheError", "GenerationCache", "KdaCache", "MlaCache"]
