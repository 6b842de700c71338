"""Type, device and value checks on what a caller hands to `generate` (loop.py calls `check_call` first).

Legend: B batch, T prompt length.
Each failure is a GenerationError naming the argument and the value. Without these, a string temperature fails
inside a comparison, `do_sample="no"` samples (a non-empty string is true), a float pad id fills finished rows
with a rounded value, a generator of another device or a streamer without `end` fail after the decode ran, and
a prompt on the meta device fails in a host read with no name.
"""

from __future__ import annotations

import math

import torch

from ..model.inputs import check_device
from ..utils import is_int, is_number
from .step import GenerationError


def _check_prompt(input_ids: object, attention_mask: object, device: torch.device) -> None:
    for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if value is None and name == "attention_mask":
            continue
        if not isinstance(value, torch.Tensor):
            raise GenerationError(f"{name} must be a torch.Tensor [batch, prompt], got {type(value).__name__}")
        check_device(name, value, device)


def _check_sampling(temperature: object, top_k: object, top_p: object) -> None:
    if not is_number(temperature) or not math.isfinite(temperature) or not temperature > 0:
        raise GenerationError(f"temperature must be a finite number > 0 when sampling, got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise GenerationError(f"top_k must be an integer >= 1 (or None), got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
        raise GenerationError(f"top_p must lie in (0, 1] (or None), got {top_p!r}")


def _check_generator(generator: object, device: torch.device) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise GenerationError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise GenerationError(
            f"generator is on {generator.device} but the model is on {device}; make it with "
            f"torch.Generator({device.type!r})"
        )


def _check_streamer(streamer: object) -> None:
    if streamer is None:
        return
    missing = [m for m in ("put", "end") if not callable(getattr(streamer, m, None))]
    if missing:
        raise GenerationError(
            f"streamer must have put(ids) and end() methods; {type(streamer).__name__} lacks {' and '.join(missing)}"
        )


def check_call(
    model,
    input_ids: object,
    attention_mask: object,
    do_sample: object,
    temperature: object,
    top_k: object,
    top_p: object,
    pad_token_id: object,
    generator: object,
    streamer: object,
    return_stats: object,
) -> None:
    """Everything `generate` takes that the shape and vocabulary checks (loop.py) do not cover."""
    device = model.lm_head.weight.device
    _check_prompt(input_ids, attention_mask, device)
    for name, value in (("do_sample", do_sample), ("return_stats", return_stats)):
        if not isinstance(value, bool):
            raise GenerationError(f"{name} must be True or False, got {value!r}")
    if do_sample:
        _check_sampling(temperature, top_k, top_p)
    if pad_token_id is not None and not is_int(pad_token_id):
        raise GenerationError(f"pad_token_id must be an integer token id or None, got {pad_token_id!r}")
    _check_generator(generator, device)
    _check_streamer(streamer)


__all__ = ["check_call"]
