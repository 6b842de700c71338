"""Checks on what a caller hands to the model's forward, so bad input fails with the argument's name, and the
forward's one ForwardContext built from the checked inputs (`build_context`).

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
from .context import ForwardContext, SequenceShards
from .cp import sharded_packing_fields
from .packing import document_boundaries, segment_ids


def _device_matches(found: torch.device, expected: torch.device) -> bool:
    # "cuda" and "cuda:0" name the same device when one side leaves the index open.
    return found.type == expected.type and (
        found.index is None or expected.index is None or found.index == expected.index
    )


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device.type == "meta" and device.type != "meta":
        raise InputError(
            f"{name} is on the meta device (no data) but the model is on {device}; move it with "
            f"{name}.to({str(device)!r})"
        )
    if not _device_matches(tensor.device, device):
        raise InputError(
            f"{name} is on {tensor.device} but the model is on {device}; move it with {name}.to({str(device)!r})"
        )


def check_token_ids(name: str, ids: object, vocab_size: int, device: torch.device, ignore: int | None = None) -> None:
    """`ids` [B, T] integer tensor on `device` with every entry in [0, vocab_size) (or `ignore`)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of token ids [batch, seq] (torch.long), got "
            f"{type(ids).__name__}; wrap it with torch.tensor({name})"
        )
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


def check_inputs_embeds(
    embeds: object, weight: torch.Tensor, hidden_size: int, dtype: torch.dtype | None = None
) -> None:
    """`embeds` [B, T, D] in the embedding's dtype (`dtype`: the one its rows are widened to when its table is held
    narrower, glm53.hooks.compute_dtype) and on its device."""
    if not isinstance(embeds, torch.Tensor):
        raise TypeError(f"inputs_embeds must be a torch.Tensor [batch, seq, hidden_size], got {type(embeds).__name__}")
    if embeds.dim() != 3 or embeds.shape[-1] != hidden_size:
        raise InputError(
            f"inputs_embeds must be [batch, seq, hidden_size={hidden_size}], got shape {tuple(embeds.shape)}"
        )
    if embeds.shape[0] == 0 or embeds.shape[1] == 0:
        raise InputError(
            f"inputs_embeds is empty (shape {tuple(embeds.shape)}): batch and sequence length must be >= 1"
        )
    dtype = dtype or weight.dtype
    if embeds.dtype != dtype:
        raise InputError(
            f"inputs_embeds is {embeds.dtype} but the model's embeddings are {dtype}; cast with inputs_embeds.to({dtype})"
        )
    check_device("inputs_embeds", embeds, weight.device)


def packing_fields(
    valid: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cp: SequenceShards | None = None,
) -> dict[str, torch.Tensor | None]:
    """ForwardContext's packed-document fields (`cu_seqlens`, `segment_ids`; None when nothing is packed).

    Under context parallelism (`cp`) documents come as this slice's `position_ids` (model/cp.py): every rank
    then has both fields, its own slice holding a document start or not."""
    B, T = valid.shape
    check_optional_tensor("cu_seqlens", cu_seqlens, valid.device, "int [n_docs + 1] over the flattened tokens")
    check_optional_tensor("position_ids", position_ids, valid.device, "[batch, seq] restarting at 0 per document")
    if cp is not None:
        if cu_seqlens is not None:
            raise ValueError(
                "under context parallelism pass packed documents as position_ids (this slice's, "
                "restarting at 0 per document; glm53.parallel.context_parallel_inputs makes them), "
                "not cu_seqlens"
            )
        if position_ids is None:
            return dict(cu_seqlens=None, segment_ids=None)
        if tuple(position_ids.shape) != (B, T) or position_ids.dtype.is_floating_point:
            raise ValueError(
                f"position_ids must be an integer tensor of shape {(B, T)}, got {position_ids.dtype} "
                f"{tuple(position_ids.shape)}"
            )
        return sharded_packing_fields(position_ids.to(valid.device), cp)
    cu = document_boundaries(B, T, valid.device, cu_seqlens, position_ids)
    return dict(cu_seqlens=cu, segment_ids=None if cu is None else segment_ids(cu, B, T))


def padding_mask(attention_mask: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Validate a 2-D padding mask and return it as bool [B, T] (all True when absent)."""
    if attention_mask is None:
        return torch.ones(*shape, dtype=torch.bool, device=device)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a torch.Tensor [batch, seq] of 0/1, got {type(attention_mask).__name__}"
        )
    check_device("attention_mask", attention_mask, device)
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask must be a 2-D padding mask of shape {tuple(shape)} (1 = token, 0 = padding), "
            f"got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype != torch.bool:
        # the 0/1 value check is skipped under torch.compile (a host read splits the graph; model/inputs.py)
        if not torch.compiler.is_compiling() and not bool(
            ((attention_mask == 0) | (attention_mask == 1)).all()
        ):  # NOTE: syncs
            raise ValueError("attention_mask must hold only 0 and 1 (1 = token, 0 = padding)")
        attention_mask = attention_mask != 0
    return attention_mask.to(device)


def build_context(
    embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cp: SequenceShards | None = None,
    *,
    cache: object | None = None,
    collect_stats: bool = False,
    record_indexer: bool = False,
) -> ForwardContext:
    """The one ForwardContext of a forward on `embeds` [B, T, D]: the checked padding mask, the packed documents
    (`packing_fields`), context parallelism and the generation cache, and whether layers record statistics."""
    valid = padding_mask(attention_mask, embeds.shape[:2], embeds.device)
    fields = packing_fields(valid, cu_seqlens, position_ids, cp)
    if cache is not None and (fields["cu_seqlens"] is not None or cp is not None):
        raise ValueError(
            "a generation cache does not take packed documents (cu_seqlens / position_ids) or context parallelism (cp)"
        )
    return ForwardContext(
        valid=valid, cache=cache, cp=cp, collect_stats=collect_stats, record_indexer=record_indexer, **fields
    )


__all__ = [
    "build_context",
    "check_device",
    "check_optional_tensor",
    "check_token_ids",
    "check_inputs_embeds",
    "packing_fields",
    "padding_mask",
]
