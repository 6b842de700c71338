"""Next-token choice from the last position's logits: greedy, or sampling after temperature, top-k and top-p.

Legend: B batch, vocab the vocabulary size.
The filters run in transformers' order (temperature, then top-k, then top-p) and remove tokens by setting their
logits to -inf, so a sampled token always lies in the allowed set. Top-p keeps the smallest set of most likely
tokens whose probability reaches p (the most likely token always stays).
"""

from __future__ import annotations

import torch


def allowed_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """logits [B, vocab] -> fp32 logits with the filtered-out tokens at -inf."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        mass_before = sorted_logits.softmax(dim=-1).cumsum(dim=-1) - sorted_logits.softmax(dim=-1)
        drop_sorted = mass_before >= top_p  # tokens after the set already reached p (never the first)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """logits [B, vocab] -> token ids [B]: argmax, or one draw from the filtered distribution."""
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = allowed_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


__all__ = ["allowed_logits", "next_tokens"]
