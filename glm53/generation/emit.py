"""What one `generate` call carries between its steps: the validated options, the token collector (EOS and
padding per row, the streamer) and the statistics it returns.

Legend: B batch, T prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GenerationStats:
    """What one `generate` call did (returned with `return_stats=True`)."""

    prompt_tokens: int = 0  # B * P positions prefilled (padding included)
    new_tokens: int = 0  # positions appended per row (including pads of finished rows)
    prefill_seconds: float = 0.0  # the prompt forward and the first token
    decode_seconds: float = 0.0  # everything after it
    drafted: int = 0  # speculative: draft tokens proposed to unfinished rows
    accepted: int = 0  # ... of which the main model agreed with (per row, leading matches)
    verify_forwards: int = 0  # speculative: main-model forwards after the prefill
    draft_seconds: float = 0.0  # speculative: of decode_seconds, in the MTP layer's steps
    verify_seconds: float = 0.0  # ... in the main model's verify steps (the rest: picks, emits, rewinds)
    cache_bytes: int = 0  # GenerationCache.nbytes() at the end (main model)
    cache_positions: int = 0  # positions cached at the end

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class Options:
    """Validated `generate` arguments."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    eos: torch.Tensor  # [n] EOS ids (possibly empty)
    pad_token_id: int
    generator: torch.Generator | None
    latent_dtype: torch.dtype | None = None  # GenerationCache's: None keeps the exact (model-dtype) latent
    step: object = None  # the generation step (step.Stepper: eager or compiled)


class Emitter:
    """Collects the chosen tokens, applies EOS / padding per row and feeds the streamer."""

    def __init__(self, input_ids: torch.Tensor, opts: Options, streamer) -> None:
        self.opts = opts
        self.streamer = streamer
        self.tokens: list[torch.Tensor] = []
        self.finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if streamer is not None:
            streamer.put(input_ids.cpu())

    def emit(self, tokens: torch.Tensor) -> bool:
        """tokens [B] -> True when generation is over (every row finished, or max_new_tokens reached)."""
        tokens = tokens.masked_fill(self.finished, self.opts.pad_token_id)
        self.tokens.append(tokens)
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        self.finished |= torch.isin(tokens, self.opts.eos)
        return len(self.tokens) >= self.opts.max_new_tokens or bool(self.finished.all())  # NOTE: syncs

    def output(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.streamer is not None:
            self.streamer.end()
        return torch.cat([input_ids, *(t[:, None] for t in self.tokens)], dim=1)


__all__ = ["Emitter", "GenerationStats", "Options"]
