"""Checks on what a caller hands to the model's forward, so bad input fails with the argument's name.

Legend: B batch, T time, D model width (hidden_size), V vocab (vocab_size).
Without these, an out-of-vocabulary id fails deep in `nn.Embedding` ("index out of range in self"), an empty
batch crashes in a top-k, and inputs on the meta device (or another device than the model) compute garbage.
Under torch.compile the checks on tensor *values* (ids in range, masks of 0/1) are skipped: they read the data
on the host, which would split the compiled graph (a graph break per check) and sync the device every step.
The checks on types, shapes, dtypes and devices stay (they cost nothing at run time). Validate data once
outside the compiled region (`check_token_ids` is public) when it comes from an untrusted source.
"""

from __future__ import annotations

import torch

from ..errors import InputError


def _device_matches(found: torch.device, expected: torch.device) -> bool:
    # "cuda" and "cuda:0" name the same device when one side leaves the index open.
    return found.type == expected.type and (found.index is None or expected.index is None
                                            or found.index == expected.index)  # fmt: skip


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device.type == "meta" and device.type != "meta":
        raise InputError(f"{name} is on the meta device (no data) but the model is on {device}; move it with "
                         f"{name}.to({str(device)!r})")  # fmt: skip
    if not _device_matches(tensor.device, device):
        raise InputError(f"{name} is on {tensor.device} but the model is on {device}; move it with "
                         f"{name}.to({str(device)!r})")  # fmt: skip


def check_token_ids(name: str, ids: object, vocab_size: int, device: torch.device, ignore: int | None = None) -> None:
    """`ids` [B, T] integer tensor on `device` with every entry in [0, vocab_size) (or `ignore`)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids [batch, seq] (torch.long), got "
                        f"{type(ids).__name__}; wrap it with torch.tensor({name})")  # fmt: skip
    if ids.dtype not in (torch.long, torch.int):  # what nn.Embedding and cross-entropy index with
        raise InputError(f"{name} must hold integer token ids (torch.long or torch.int32), got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise InputError(f"{name} must be [batch, seq], got shape {tuple(ids.shape)}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InputError(f"{name} is empty (shape {tuple(ids.shape)}): batch and sequence length must be >= 1")
    check_device(name, ids, device)
    if torch.compiler.is_compiling():  # value check skipped: see the module docstring
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore is not None:
        bad &= ids != ignore
    if bool(bad.any()):  # NOTE: syncs
        value = int(ids[bad][0])
        allowed = f"[0, vocab_size={vocab_size})" + (f" or {ignore}" if ignore is not None else "")
        raise InputError(f"{name} holds {value}, outside {allowed} (at index {tuple(bad.nonzero()[0].tolist())})")


def check_optional_tensor(name: str, value: object, device: torch.device, what: str) -> None:
    """`value` None or a tensor with data (position_ids, cu_seqlens: a meta one fails in a host read, a list in an
    attribute lookup, neither naming the argument). Another real device is fine: the model moves these small
    integer tensors to its own."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({what}) or None, got {type(value).__name__}")
    if value.device.type == "meta":
        check_device(name, value, device)


def check_inputs_embeds(embeds: object, weight: torch.Tensor, hidden_size: int) -> None:
    """`embeds` [B, T, D] in the embedding's dtype and on its device."""
    if not isinstance(embeds, torch.Tensor):
        raise TypeError(f"inputs_embeds must be a torch.Tensor [batch, seq, hidden_size], got {type(embeds).__name__}")
    if embeds.dim() != 3 or embeds.shape[-1] != hidden_size:
        raise InputError(f"inputs_embeds must be [batch, seq, hidden_size={hidden_size}], got shape "
                         f"{tuple(embeds.shape)}")  # fmt: skip
    if embeds.shape[0] == 0 or embeds.shape[1] == 0:
        raise InputError(f"inputs_embeds is empty (shape {tuple(embeds.shape)}): batch and sequence length must be "
                         f">= 1")  # fmt: skip
    if embeds.dtype != weight.dtype:
        raise InputError(f"inputs_embeds is {embeds.dtype} but the model's embeddings are {weight.dtype}; cast with "
                         f"inputs_embeds.to({weight.dtype})")  # fmt: skip
    check_device("inputs_embeds", embeds, weight.device)


__all__ = ["check_device", "check_optional_tensor", "check_token_ids", "check_inputs_embeds"]
