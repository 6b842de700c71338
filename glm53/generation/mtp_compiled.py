"""The MTP draft step compiled: verify.py's mtp_tokens (the MTP layer on T positions, the output at the last one)
and the draft's greedy pick, with the tensor work in two torch.compile'd graphs around the MLA layer's eager cache
bookkeeping, made and called as decode_compiled.py's segments (graph pieces, _Bound bindings).

Legend (glm53/model/__init__.py): B batch, T positions per row, R = B*T rows, D model width, H heads, K/V head
widths, Z kv_lora_rank, J selected key slots, vocab the vocabulary size.
    graph 1  embed the ids, enorm | hnorm, eh_proj, input norm, the MLA projections of every position
    eager    verify.cache_tokens (latents, the indexer's pools, the top-k of the last position), the latent gather
    graph 2  attention of the last position, o_proj and residual, post norm and feed-forward -> h [B, D]; then the
             draft: argmax lm_head(shared_head.norm(h)) [B]
Shapes are static per (config, batch, T); a speculative step runs T = a + 1 (the committed positions) once and
T = 1 for every further draft, so k + 1 first graphs and one second graph serve every step. Results equal
mtp_tokens' up to fp32 rounding (tests/generation/test_speculative_compiled.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..boundary import as_local
from .decode_common import _weight
from .decode_compiled import (_absorbed_attention, _call, _dense, _linear, _mla_in, _mlp, _moe, _Moe, _rms,
                              compiled_segment)  # fmt: skip
from .layers import _cached_attention, _gather_rows
from .verify import MtpPlan, cache_tokens


@dataclass
class _Head:
    """The draft's pick: shared_head.norm, then the model's lm_head."""

    norm: tuple  # (weight, eps)
    lm_head: tuple  # (weight [vocab, D], bias)


def _mtp_in(p: MtpPlan, hidden: torch.Tensor, ids: torch.Tensor) -> tuple:
    """hidden [B, T, D], ids [B, T] -> (x at the last position [B, D], the attention input h [R, D], q_resid and q
    of the last position [B, R'], [B, H, K], latents [R, Z], *the indexer's projections [R, *])."""
    B, T, D = hidden.shape
    embeds = F.embedding(ids.reshape(-1), p.embed)  # [R, D]
    x = _linear(torch.cat([_rms(embeds, *p.enorm), _rms(hidden.reshape(-1, D), *p.hnorm)], dim=-1), p.eh_proj)
    h = _rms(x, *p.input_norm)
    q_resid, q, latent, *x_proj = _mla_in(p.attention, h)  # every position's q: a draft reads the last
    last = lambda t: t.view(B, T, *t.shape[1:])[:, -1]  # noqa: E731
    return (last(x), h, last(q_resid), last(q), latent, *x_proj)


def _mtp_out(p: MtpPlan, head: _Head, x: torch.Tensor, attn: tuple) -> tuple:
    """x [B, D] (the last position's), attn: the absorbed attention's inputs or its output [B, H, V] -> (h [B, D],
    the draft [B])."""
    o = _absorbed_attention(p.attention, *attn) if len(attn) == 3 else attn[0]  # [B, H, V]
    x = x + _linear(o.reshape(o.shape[0], -1), *p.attention.o)
    out = _rms(x, *p.post_norm)
    h = x + (_moe(p.mlp, out) if isinstance(p.mlp, _Moe) else _mlp(p.mlp, out))
    return h, _linear(_rms(h, *head.norm), *head.lm_head).argmax(-1)


def compiled_mtp_tokens(model, layer, p: MtpPlan, hidden: torch.Tensor, ids: torch.Tensor, backend: str = "inductor",
                        cpp_wrapper: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """mtp_tokens (same cache effects) and the draft: hidden [B, T, D], the next ids [B, T] -> (h [B, 1, D] at the
    last position, before shared_head.norm; the greedy draft [B] there). `layer`: the MTP layer of plan `p`."""
    kept = p.compiled  # kept with the plan (its lifetime): _Head, {T: [bound first graph]}, [bound second graph]
    if not kept:
        norm = layer.shared_head.norm
        kept.update(head=_Head((as_local(norm, "weight"), norm.eps), _weight(model.lm_head)), first={}, second=[None])
    head, first, second = kept["head"], kept["first"], kept["second"]
    B, T, _ = hidden.shape
    hidden, ids = _dense(hidden), _dense(ids)  # the committed positions: slices of the verify's [B, s+1, *]
    bound = first.setdefault(T, [None])
    fn = compiled_segment(backend, cpp_wrapper, _mtp_in)
    x, h, q_resid, q, latent, *x_proj = _call(bound, 0, fn, (p, hidden, ids), [hidden, ids])
    rows = lambda t: t.view(B, T, t.shape[-1])  # noqa: E731  [R, *] -> [B, T, *]
    topk = cache_tokens(p.attention, p.cache, rows(latent), rows(h), q_resid[:, None], None,
                        tuple(rows(t) for t in x_proj) or None)  # [B, 1, J]
    if p.attention.absorb:
        kv, filled = _gather_rows(p.cache, topk)  # [B, 1, J, Z], [B, 1, J]
        attn = (q, kv[:, 0], filled[:, 0])
    else:
        attn = (_cached_attention(p.attention.module, q[:, None], p.cache, topk)[:, 0],)
    fn = compiled_segment(backend, cpp_wrapper, _mtp_out)
    out, draft = _call(second, 0, fn, (p, head, x, attn), [x, *attn])
    return out[:, None], draft


__all__ = ["compiled_mtp_tokens"]
