"""`load_pretrained`: fill a parallelized (possibly meta) model from an official-layout checkpoint, each rank
reading only the bytes of its own shards.

Legend: E experts, I expert width, D model width; bo x bi the FP8 block (weight_block_size). A rank's part of a
model tensor is a list of boxes (pieces.py); a checkpoint key covers a region of one model tensor (the whole
tensor, or one expert's gate / up / down rows of the fused [E, 2I, D] / [E, D, I] parameter). For every box and
key region that meet, the rank reads exactly that slice with safetensors' `get_slice`, dequantises it when the key
is FP8 (the scale blocks the slice touches, partial blocks included) and copies it into its local shard. One slice
is in flight at a time, so a rank's host memory peaks at its shards plus one slice.

A base held in FP8 (glm53.peft: a float8_e4m3fn parameter `X`, or its uint8 bits, beside its block-scale buffer
`X_scale_inv`) is read raw instead: each rank's slice of the stored FP8 bytes, no dequantisation, and the scales the buffer holds on this
rank (whole for a linear, which FSDP gathers whole before its matmul; this rank's experts under EP), so the blocks
a rank's values meet are the ones they were quantised with. With `quantize` (glm53 train --quantize-base) an
FP8-held weight whose key is stored wider (bf16 / fp32) is quantised on read, as glm53.peft.load_base does in one
process: the key read whole (one tensor at a time; every block's scale needs all of its values), quantised per block
by glm53.checkpoint.fp8.quantize, and this rank's slices of the FP8 values and of the scales kept.

Keys, shapes and FP8 scales are checked from the file headers before anything is read, by the same code and with
the same `CheckpointError` as `from_pretrained` (glm53/checkpoint/load.py); non-finite values found by any rank
raise on every rank. torch's DCP `HuggingFaceStorageReader` reads with the same `get_slice`, but its planner keeps
one chunk per key and rank, described by a DTensor: per-expert keys of fused experts and the packed gate/up rows
under TP (two runs per rank) have no such DTensor, and FP8 blocks other than square, byte accounting and the
finiteness check would all live in an override of its private `_process_read_request`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from ..checkpoint import fp8
from ..checkpoint.load import LoadPlan, _plan, quantization_config, warn_text_only
from ..checkpoint.reader import TensorReader, checkpoint_files
from ..config import Glm53Config
from ..errors import CheckpointError
from ..utils import ceil_div
from .pieces import box_slices, intersect, local_boxes, local_tensor

logger = logging.getLogger("glm53.parallel")

Region = tuple[slice, ...]  # a key's region in its model tensor's global index space
# the dtypes of a base glm53.peft holds in FP8 (beside its `_scale_inv` buffer): e4m3 values, or their uint8 bits
# (glm53.peft.fp8.hold_for_policy, for a low-precision FSDP policy)
FP8_HELD = (fp8.FP8_DTYPE, torch.uint8)


class SliceReader:
    """Reads slices of safetensors keys (one open handle per file) and counts the bytes it reads (`bytes_read`, and
    `largest_read`: the most bytes one read brought in). `quantize`: wider keys of FP8-held weights are quantised on
    read (`fp8_values`, and `values` of their `_scale_inv`, which the checkpoint lacks)."""

    def __init__(self, files: dict[str, str], block_size: tuple[int, int], quantize: bool = False) -> None:
        self.files, self.block_size, self.quantize = files, block_size, quantize
        self._handles: dict[str, object] = {}
        self.bytes_read = self.largest_read = 0
        self._last: tuple[str, torch.Tensor] | None = None  # the last key quantised and its FP8 values
        self._scales: dict[str, torch.Tensor] = {}  # quantised keys' scales, until their buffer takes them

    def _slice(self, key: str):
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_slice(key)

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The stored values of `key`[index] (on-disk dtype); every read goes through here."""
        part = self._slice(key)[index]
        self.bytes_read += part.numel() * part.element_size()
        self.largest_read = max(self.largest_read, part.numel() * part.element_size())
        return part

    def fp8_values(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """key[index] for an FP8-held weight: the stored FP8 values, or with `quantize` those of a wider key
        quantised whole (anything else as stored, for the caller to refuse)."""
        if not self.quantize or fp8.is_fp8(self.dtype(key)):
            return self.read(key, index)
        if self._last is None or self._last[0] != key:
            whole = tuple(slice(0, n) for n in self._slice(key).get_shape())
            q, self._scales[key] = fp8.quantize(self.read(key, whole), self.block_size)
            self._last = key, q
        return self._last[1][index]

    def _quantized_scale(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        weight = key.removesuffix(fp8.SCALE_SUFFIX)
        if weight not in self._scales:  # this rank holds none of the values (or took its scales): quantise again
            self._last = None
            self.fp8_values(weight, (slice(0, 0),))  # no rows: only the whole-key quantisation and its scales
        return self._scales.pop(weight)[index]

    def dtype(self, key: str) -> str:
        return self._slice(key).get_dtype()

    def values(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """key[index] as real values: FP8 slices dequantised with the scale blocks they touch (with `quantize`, the
        scales of a key quantised on read)."""
        if self.quantize and key not in self.files and key.endswith(fp8.SCALE_SUFFIX):
            return self._quantized_scale(key, index)
        part = self.read(key, index)
        if part.dtype != fp8.FP8_DTYPE:
            return part
        (r0, r1), (c0, c1) = [(s.start, s.stop) for s in index]
        bo, bi = self.block_size
        blocks = (slice(r0 // bo, ceil_div(r1, bo)), slice(c0 // bi, ceil_div(c1, bi)))  # the blocks the slice touches
        scale = self.read(key + fp8.SCALE_SUFFIX, blocks)
        return dequantize_slice(part, scale, self.block_size, (r0, c0))


def dequantize_slice(
    q: torch.Tensor, scale_blocks: torch.Tensor, block_size: tuple[int, int], origin: tuple[int, int]
) -> torch.Tensor:
    """The fp32 values of an FP8 slice q [rows, cols] starting at `origin` of the full weight.

    `scale_blocks` are the scales of the blocks the slice touches (from block origin // b); a slice that starts
    inside a block is offset by origin % b. Equals `fp8.dequantize(full)[slice]` bit for bit (one fp32 multiply).
    """
    bo, bi = block_size
    r, c = origin[0] % bo, origin[1] % bi
    expanded = scale_blocks.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    return q.float() * expanded[r : r + q.shape[0], c : c + q.shape[1]]


def planned_reads(target: torch.Tensor, pieces: list[tuple[str, Region, int]]) -> Iterator[tuple[str, tuple, tuple]]:
    """(key, index into the key, index into target's local shard) for every part of `pieces` this rank holds.

    A piece is (key, region in target, leading dims the key lacks): the key's own index is the region-relative
    index with those dims dropped (an expert key is one [rows, cols] slab of the fused [E, rows', cols] tensor).
    """
    for box in local_boxes(target):
        for key, region, drop in pieces:
            part = intersect(box, region)
            if part is None:
                continue
            local_idx, global_idx = box_slices(part)
            key_idx = tuple(slice(g.start - r.start, g.stop - r.start) for g, r in zip(global_idx, region))[drop:]
            yield key, key_idx, local_idx


def _fill(target: torch.Tensor, pieces: list[tuple[str, Region, int]], reader: SliceReader, bad: set[str]) -> None:
    """Copy into `target`'s local shard every part of `pieces` it holds (`planned_reads`), one slice at a time
    (an FP8 target takes the stored FP8 values as they are)."""
    local = local_tensor(target)
    raw = target.dtype in FP8_HELD
    for key, key_idx, local_idx in planned_reads(target, pieces):
        values = reader.fp8_values(key, key_idx) if raw else reader.values(key, key_idx)
        if raw and values.dtype != fp8.FP8_DTYPE:
            raise CheckpointError(f"{key}: {values.dtype}, but the model holds it in FP8 (block-scaled e4m3)")
        checked = values.float() if raw else values
        if checked.is_floating_point() and not bool(torch.isfinite(checked).all()):  # NOTE: syncs
            bad.add(key)
        values = values.view(local.dtype) if raw else values  # FP8 held as its bits: the same bytes
        local[local_idx].copy_(values.reshape(local[local_idx].shape))


def model_pieces(model: torch.nn.Module, plan: LoadPlan) -> Iterator[tuple[str, torch.Tensor, list]]:
    """(glm53 name, tensor, its pieces) for every tensor the plan fills, and the block scales of FP8-held ones."""
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    held = {n.removesuffix(fp8.SCALE_SUFFIX) for n in held_scales(model)}
    for name, key in plan.direct.items():
        yield name, tensors[name], [(key, _whole(tensors[name]), 0)]
        if name in held:
            scale = tensors[name + fp8.SCALE_SUFFIX]
            yield name + fp8.SCALE_SUFFIX, scale, [(key + fp8.SCALE_SUFFIX, _whole(scale), 0)]
    for name, parts in plan.experts.items():
        yield name, tensors[name], _expert_pieces(name, tensors[name].shape, parts)
        if name in held:  # [E, 2 go, gi] (gate grid, then up) or [E, go, gi]
            scale, scale_keys = tensors[name + fp8.SCALE_SUFFIX], {k: v + fp8.SCALE_SUFFIX for k, v in parts.items()}
            yield name + fp8.SCALE_SUFFIX, scale, _expert_pieces(name, scale.shape, scale_keys)


def _whole(tensor: torch.Tensor) -> Region:
    return tuple(slice(0, s) for s in tensor.shape)


def held_scales(model: torch.nn.Module) -> set[str]:
    """The block-scale buffers of FP8-held parameters: filled with their weights, not matched as keys."""
    buffers = {n for n, _ in model.named_buffers()}
    held = [n + fp8.SCALE_SUFFIX for n, p in model.named_parameters() if p.dtype in FP8_HELD]
    return {n for n in held if n in buffers}


def _expert_pieces(name: str, shape: torch.Size, parts: dict[tuple[int, str], str]) -> list[tuple[str, Region, int]]:
    """Regions of the per-expert keys in a fused [E, 2I, D] (gate_up) or [E, D, I] (down) parameter."""
    E, rows, cols = shape
    half = rows // 2
    out = []
    for (e, part), key in parts.items():
        lo, hi = {"gate": (0, half), "up": (half, rows), "down": (0, rows)}[part]
        out.append((key, (slice(e, e + 1), slice(lo, hi), slice(0, cols)), 1))
    return out


def materialize(model: torch.nn.Module) -> None:
    """to_empty on the mesh's device when any tensor is still on the meta device."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        return
    mesh = next((t.device_mesh for t in tensors if isinstance(t, DTensor)), None)
    device = (
        "cpu"
        if mesh is None or mesh.device_type == "cpu"
        else torch.device(mesh.device_type, torch.cuda.current_device())
    )
    model.to_empty(device=device)
    if model.config.tie_word_embeddings:
        model.tie_weights()


def _raise_non_finite(bad: set[str]) -> None:
    """Every rank raises the same error when any rank read a NaN or an infinity."""
    found = set(bad)
    if dist.is_initialized():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(bad))
        found = {k for keys in everyone for k in keys}
    if found:
        raise CheckpointError(f"tensor {sorted(found)[0]!r} holds NaN or infinite values")


class _Without:
    """A model's tensors as the checkpoint planner sees them, without those `skip` names (e.g. LoRA adapters,
    which no official checkpoint holds)."""

    def __init__(self, model: torch.nn.Module, skip: Callable[[str], bool]) -> None:
        self.model, self.skip = model, skip
        self.config, self.mtp = model.config, getattr(model, "mtp", None)

    def named_parameters(self, **kwargs):
        return [(n, p) for n, p in self.model.named_parameters(**kwargs) if not self.skip(n)]

    def named_buffers(self, **kwargs):
        return [(n, b) for n, b in self.model.named_buffers(**kwargs) if not self.skip(n)]


def fill_from_full(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's part of the whole tensor `value` into `target`'s local shard (every rank holds `value`)."""
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"fill_from_full: a whole value of shape {tuple(value.shape)} for {tuple(target.shape)}")
    local = local_tensor(target)
    with torch.no_grad():
        for box in local_boxes(target):
            local_idx, global_idx = box_slices(box)
            local[local_idx].copy_(value[global_idx])


def load_pretrained(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    reader: type[SliceReader] = SliceReader,
    skip: Callable[[str], bool] | None = None,
    quantize: bool = False,
) -> torch.nn.Module:
    """Fill `model` (a Glm53ForCausalLM, usually built on meta and `parallelize`d) from the official layout at
    `path`; call on every rank. Returns the model, with `model.checkpoint_reader` (bytes read by this rank).

    Tensors still on the meta device are first materialised on the mesh's device (`to_empty`). Each tensor keeps
    its dtype (cast the model before `parallelize` to load in bf16). Errors (keys, shapes, FP8 scales, non-finite
    values) are those of `Glm53ForCausalLM.from_pretrained`. A checkpoint without MTP tensors leaves the MTP
    module freshly initialised, with a warning. `skip(name)`: tensors the checkpoint does not hold and the caller
    fills (LoRA adapters); they are materialised but left unset. FP8 parameters (a base glm53.peft holds in FP8)
    take the stored FP8 values and block scales as they are; their keys must be FP8, unless `quantize`: a wider
    key is then quantised to the model's block format on read (`SliceReader.fp8_values`).
    """
    path = os.fspath(path)
    files = checkpoint_files(path)
    block = fp8.weight_block_size(quantization_config(Glm53Config.from_pretrained(path)))
    config = model.config
    scales = held_scales(model)
    if scales:
        skip = (lambda n, given=skip: n in scales or given(n)) if skip else scales.__contains__
    planned = model if skip is None else _Without(model, skip)
    plan: LoadPlan = _plan(planned, files, TensorReader(files, block), config.num_hidden_layers)
    warn_text_only(plan, path)
    materialize(model)
    slices, bad = reader(files, block, quantize=quantize), set()
    with torch.no_grad():
        for _, target, pieces in model_pieces(model, plan):
            _fill(target, pieces, slices, bad)
    _raise_non_finite(bad)
    if model.mtp is not None and not plan.mtp_found:
        logger.warning(
            "%s has no MTP tensors (layers.%d.*): the MTP module is freshly initialised", path, config.num_hidden_layers
        )
        with torch.no_grad():
            model.mtp.init_weights()
    model.mtp_checkpoint_keys = sorted(plan.mtp_set_aside)
    model.checkpoint_reader = slices
    return model


__all__ = [
    "load_pretrained",
    "held_scales",
    "fill_from_full",
    "materialize",
    "planned_reads",
    "model_pieces",
    "SliceReader",
    "dequantize_slice",
]
