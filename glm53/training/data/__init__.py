"""A small built-in corpus, tokenised as bytes (no tokenizer download): token = byte value + BYTE_OFFSET."""

from __future__ import annotations

from importlib import resources

import torch

from ...errors import InputError

BYTE_OFFSET = 1  # token 0 is padding
VOCAB_SIZE = 256 + BYTE_OFFSET


def corpus_text() -> str:
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long) + BYTE_OFFSET


def decode(tokens: torch.Tensor) -> str:
    data = bytes(int(t) - BYTE_OFFSET for t in tokens.tolist() if int(t) >= BYTE_OFFSET)
    return data.decode("utf-8", errors="replace")


def batches(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Endless random windows [batch_size, seq_len] from the token stream (checked here, before the first one)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.long:
        raise InputError(
            f"tokens must be a 1-D torch.long tensor (the token stream), got "
            f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}"
        )
    for name, value in (("--batch-size", batch_size), ("--seq-len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive int, got {value!r}")
    if not 1 <= seq_len < tokens.numel():
        raise InputError(
            f"--seq-len {seq_len} needs a corpus of more than {seq_len} tokens; this one has {tokens.numel()}"
        )
    return _windows(tokens, batch_size, seq_len, generator)


def _windows(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    high = tokens.numel() - seq_len
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        yield torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])
