"""MTP speculative decoding (greedy): the MTP layer drafts s tokens, the main model checks them in one forward.

Legend: B batch, T prompt length, s draft tokens per step (num_speculative_tokens), D model width.
Position n of the MTP layer's own sequence reads (h_n, t_{n+1}): the main model's hidden state at n and the
token after it, and predicts t_{n+2} (glm53/model/mtp.py). With the main model having read t_0 .. t_{n-1} and
picked t_n, one step is:
    draft   d_{n+1} from MTP(h_{n-1}, t_n); d_{n+j} from MTP(its own previous output, d_{n+j-1}), j = 2 .. s
    verify  the main model reads [t_n, d_{n+1}, .., d_{n+s}] in one forward -> its greedy picks g_{n+1} .. g_{n+s+1}
    accept  a = the leading drafts equal to the picks; commit d_{n+1} .. d_{n+a}, g_{n+a+1}
Every forward is the generation step (step.py) on a cache of its own: the main model's (verify: T = s + 1) and
the MTP layer's (part="mtp"), compiled or not as `generate`'s `compile` says.
Every committed token is the main model's own greedy choice, so the output equals plain greedy decoding. A batch
commits the same number a for every row (the smallest over unfinished rows) so the rows stay on one time axis;
`acceptance_rate` counts each row's own leading matches. Both caches rewind what was not committed
(GenerationCache.mark / rewind): the main model's to the a + 1 tokens it keeps, the MTP layer's to before the
draft-only positions (d_{n+2} ..), whose true inputs (h, t) the next step's first MTP forward supplies.
"""

from __future__ import annotations

import time

import torch

from ..model.cache import GenerationCache
from .emit import Emitter, GenerationStats, Options
from .step import GenerationError

MAX_SPECULATIVE_TOKENS = 16  # a verify forward keeps s + 1 KDA states per layer for the rewind


def _check(model, opts: Options, method: str, s) -> None:
    if method != "mtp":
        raise GenerationError(f"speculative must be None or 'mtp', got {method!r}")
    if getattr(model, "mtp", None) is None:
        raise GenerationError("speculative='mtp' needs a model with an MTP layer (num_nextn_predict_layers > 0)")
    if opts.do_sample:
        raise GenerationError("speculative='mtp' decodes greedily: pass do_sample=False")
    if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= MAX_SPECULATIVE_TOKENS:
        raise GenerationError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {s!r}")


class _Drafter:
    """The MTP layer (depth 1, reused for every draft) with its own cache."""

    def __init__(self, model, opts: Options, positions: int, s: int) -> None:
        self.model, self.step = model, opts.step
        self.layer = model.mtp.layer_for(1)
        self.cache = GenerationCache(model, part="mtp", max_length=positions, max_step_tokens=s)

    def run(
        self, hidden: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, D], next ids [B, T] -> (MTP output [B, T, D], greedy draft at the last position [B])."""
        h = self.step(self.model, self.cache, ids, valid, hidden)
        return h, self.model.lm_head(self.layer.shared_head.norm(h[:, -1])).argmax(-1)

    def draft(self, hidden, ids, valid, s: int) -> torch.Tensor:
        """Commit the true MTP positions (hidden, ids), then draft s tokens -> [B, s]; the draft-only positions
        are marked for the next step's rewind."""
        h, d = self.run(hidden, ids, valid)
        self.cache.mark()
        drafts = [d]
        for _ in range(s - 1):
            h, d = self.run(h[:, -1:], d[:, None], None)
            drafts.append(d)
        return torch.stack(drafts, dim=1)


def speculative_decode(
    model,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    opts: Options,
    emitter: Emitter,
    stats: GenerationStats,
    method: str,
    s: int,
) -> GenerationCache | None:
    """Greedy decoding with MTP drafts of s tokens, verified s + 1 at a time (see the module docstring)."""
    _check(model, opts, method, s)
    if opts.max_new_tokens == 0:
        return None
    positions = opts.step.capacity(input_ids.shape[1] + opts.max_new_tokens + s + 1)  # a verify reads s ahead
    cache = GenerationCache(model, latent_dtype=opts.latent_dtype, max_length=positions, max_step_tokens=s + 1)
    drafter = _Drafter(model, opts, positions, s)
    start = time.perf_counter()
    hidden = opts.step(model, cache, input_ids, valid)  # [B, T, D]
    token = model.lm_head(hidden[:, -1]).argmax(-1)  # [B]
    done = emitter.emit(token)
    stats.prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    mtp_hidden, mtp_ids, mtp_valid = hidden, torch.cat([input_ids[:, 1:], token[:, None]], dim=1), valid
    while not done:
        t0 = time.perf_counter()
        drafts = drafter.draft(mtp_hidden, mtp_ids, mtp_valid, s)  # [B, s]
        t1 = time.perf_counter()
        cache.mark()
        verify = opts.step(model, cache, torch.cat([token[:, None], drafts], dim=1))  # [B, s+1, D]
        picks = model.lm_head(verify).argmax(-1)  # [B, s+1]
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += time.perf_counter() - t1  # (timed on the host: on a GPU, without a sync)
        leading = (drafts == picks[:, :s]).long().cumprod(dim=-1).sum(-1)  # [B]
        active = ~emitter.finished
        stats.drafted += s * int(active.sum())
        stats.accepted += int(leading[active].sum())
        stats.verify_forwards += 1
        a = int(leading[active].min())  # NOTE: syncs (the loop's bookkeeping, between steps)
        for j in range(a + 1):
            done = emitter.emit(picks[:, j])
            if done:
                break
        cache.rewind(a + 1)
        drafter.cache.rewind(0)
        token = picks[:, a]
        mtp_hidden, mtp_ids, mtp_valid = verify[:, : a + 1], picks[:, : a + 1], None
    stats.decode_seconds = time.perf_counter() - start
    return cache


__all__ = ["MAX_SPECULATIVE_TOKENS", "speculative_decode"]
