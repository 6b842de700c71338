"""`generate`: prefill a left-padded batch into a GenerationCache, then decode one token per step (or, with
`speculative="mtp"`, draft with the MTP layer and verify several tokens per forward: speculative.py).

Legend: B batch, T prompt length (padding included), D model width, vocab the vocabulary size.
Semantics follow transformers' `generate`: the output is the prompt followed by the new ids, [B, T + new]; a row
stops at its first EOS (which it keeps), later positions of a finished row hold `pad_token_id`, and the loop ends
when every row has finished or `max_new_tokens` were produced. Finished rows keep feeding `pad_token_id` as a
valid token, as transformers does (their outputs are discarded). This module imports nothing from
glm53.model.model, so `Glm53ForCausalLM.generate` can delegate here without an import cycle.
"""

from __future__ import annotations

import time

import torch

from ..model.cache import GenerationCache
from .checks import check_call
from .emit import Emitter, GenerationStats, Options
from .sampling import next_tokens
from .speculative import speculative_decode
from .step import GenerationError, Stepper


def left_padded_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Validate the prompt and its padding mask -> bool [B, T]; rows must be left-padded (tokens at the end)."""
    if (
        input_ids.dim() != 2
        or input_ids.shape[1] == 0
        or input_ids.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    ):
        raise GenerationError(
            f"input_ids must be a non-empty integer [batch, prompt] tensor, got "
            f"{input_ids.dtype} of shape {tuple(input_ids.shape)}"
        )
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise GenerationError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}"
        )
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):  # NOTE: syncs
        raise GenerationError("attention_mask must hold only 0 (padding) and 1 (token)")
    valid = attention_mask != 0
    if not bool(valid[:, -1].all()) or bool((valid[:, 1:].long() < valid[:, :-1].long()).any()):  # NOTE: syncs
        raise GenerationError(
            "attention_mask must be left-padded (0s then 1s in every row, a token last): "
            "generation appends after each row's last position"
        )
    return valid


def check_options(
    model,
    input_ids: torch.Tensor,
    max_new_tokens,
    do_sample,
    temperature,
    top_k,
    top_p,
    eos_token_id,
    pad_token_id,
    generator,
) -> Options:
    config = model.config
    V = config.vocab_size
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    total = input_ids.shape[1] + max_new_tokens
    if total > config.max_position_embeddings:
        raise GenerationError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} "
            f"exceeds the model's limit max_position_embeddings={config.max_position_embeddings}"
        )
    if bool(((input_ids < 0) | (input_ids >= V)).any()):  # NOTE: syncs
        raise GenerationError(f"input_ids hold ids outside the vocabulary [0, {V})")
    if eos_token_id is None:  # as transformers: the model's own EOS ids unless the call names others
        eos_token_id = config.eos_token_id
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    for e in eos:
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < V:
            raise GenerationError(f"eos_token_id {e!r} is not a token id of the vocabulary [0, {V})")
    if do_sample:
        if not temperature > 0:
            raise GenerationError(f"temperature must be > 0 when sampling, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise GenerationError(f"top_k must be an integer >= 1 (or None), got {top_k!r}")
        if top_p is not None and not 0 < top_p <= 1:
            raise GenerationError(f"top_p must lie in (0, 1] (or None), got {top_p!r}")
    pad = pad_token_id if pad_token_id is not None else config.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    if not 0 <= pad < V:
        raise GenerationError(f"pad_token_id {pad!r} is not a token id of the vocabulary [0, {V})")
    eos_t = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device)
    return Options(max_new_tokens, do_sample, temperature, top_k, top_p, eos_t, pad, generator)


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    streamer=None,
    pad_token_id: int | None = None,
    speculative: str | None = None,
    num_speculative_tokens: int = 1,
    return_stats: bool = False,
    latent_dtype: torch.dtype | None = None,
    compile: bool | str = False,
    inputs_embeds: torch.Tensor | None = None,
):
    """Continue each row of a left-padded batch -> [B, T + new] (and GenerationStats with `return_stats`).

    model: a Glm53ForCausalLM. eos_token_id None uses model.config.eos_token_id. do_sample False picks the
    argmax; True samples after temperature / top_k / top_p, drawing from `generator`. `streamer` gets `put(ids)`
    (the prompt, then each step's [B] ids) and `end()`.
    speculative="mtp" drafts `num_speculative_tokens` tokens per step with the model's MTP layer and verifies
    them in one forward (greedy only; same output as plain greedy decoding).
    latent_dtype (e.g. torch.bfloat16 for an fp32 model) stores the MLA latent cache rounded to that dtype: fewer
    bytes per cached token, no longer exact (GenerationCache).
    inputs_embeds [B, T, D] (optional): the prompt's embeddings, used by the prefill instead of embedding
    `input_ids` (which still give the output's prompt and the padding); the VL model passes its spliced image
    features this way, so the tower runs once, before prefill. Decode steps embed their new ids as always.
    compile=True runs every step after the prefill (decode, or with speculative="mtp" verify and draft) as
    torch.compile of the same forward (step.py: fullgraph, static shapes, CUDA graphs on a GPU; the same results up
    to fp32 rounding after a one-off compile); a backend name (e.g. "aot_eager") picks the backend.
    """
    check_call(
        model,
        input_ids,
        attention_mask,
        do_sample,
        temperature,
        top_k,
        top_p,
        pad_token_id,
        generator,
        streamer,
        return_stats,
    )
    valid = left_padded_mask(input_ids, attention_mask)
    opts = check_options(
        model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, generator
    )
    opts.latent_dtype = latent_dtype
    opts.step = Stepper(compile)  # checks `compile` before any work
    stats = GenerationStats(prompt_tokens=input_ids.numel())
    emitter = Emitter(input_ids, opts, streamer)
    if inputs_embeds is not None and (
        speculative is not None or tuple(inputs_embeds.shape[:2]) != tuple(input_ids.shape)
    ):
        raise GenerationError(
            f"inputs_embeds must be [batch, prompt, hidden] for input_ids {tuple(input_ids.shape)} "
            f"(got {tuple(inputs_embeds.shape)}) and cannot be combined with speculative "
            f"decoding"
        )
    if speculative is not None:
        cache = speculative_decode(model, input_ids, valid, opts, emitter, stats, speculative, num_speculative_tokens)
    elif max_new_tokens > 0:
        cache = _decode(model, input_ids, valid, opts, emitter, stats, inputs_embeds)
    else:
        cache = None
    if cache is not None:
        stats.cache_bytes, stats.cache_positions = cache.nbytes(), cache.seq_len
    stats.new_tokens = len(emitter.tokens)
    out = emitter.output(input_ids)
    return (out, stats) if return_stats else out


def _decode(
    model,
    input_ids,
    valid,
    opts: Options,
    emitter: Emitter,
    stats: GenerationStats,
    inputs_embeds: torch.Tensor | None = None,
) -> GenerationCache:
    """Plain decoding: the prefill step (from `inputs_embeds` when given), then one decode step (T = 1) per token."""
    cache = GenerationCache(
        model, latent_dtype=opts.latent_dtype, max_length=opts.step.capacity(input_ids.shape[1] + opts.max_new_tokens)
    )
    start = time.perf_counter()
    pick = lambda h: next_tokens(
        model.lm_head(h),
        opts.do_sample,
        opts.temperature,
        opts.top_k,  # noqa: E731
        opts.top_p,
        opts.generator,
    )
    done = emitter.emit(pick(opts.step(model, cache, input_ids, valid, embeds=inputs_embeds)[:, -1]))
    stats.prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    while not done:
        done = emitter.emit(pick(opts.step(model, cache, emitter.tokens[-1][:, None])[:, -1]))
    stats.decode_seconds = time.perf_counter() - start
    return cache


__all__ = ["GenerationStats", "generate"]
