"""`export_pretrained`: the official layout from a parallelized model, without gathering the model on any rank.

Legend: E experts, I expert width, D model width. Official keys are assigned to writer ranks up front (largest
first, each to the least-loaded rank). Then, one key at a time in a fixed order, every rank places the elements of
the key it holds as the primary copy (pieces.is_primary: each element comes from exactly one rank) into a zero
buffer of the key's shape, and the buffers are summed onto the writer (one `reduce`): no rank ever holds more than
its shards, one key's full tensor and the shard file it is filling. Each writer writes its own safetensors files;
rank 0 names them `model-0000i-of-0000n.safetensors`, writes the index and config.json and renames the directory
into place (`glm53.checkpoint.shards.atomic_directory`: complete or absent, foreign files kept).

torch's `HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)` writes every rank's shards
and then rewrites them as consolidated files (the data written twice), needs one DTensor per official key (the
per-expert keys of fused experts have none), and writes under DCP's own file naming; this exporter writes once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..checkpoint.layout import TEXT_PREFIX, VISION_MODULE, internal_to_official, named_state, official_config
from ..checkpoint.shards import INDEX_FILE, SINGLE_FILE, atomic_directory, checkpoint_owns, parse_size, write_json
from ..errors import CheckpointError
from ..precision import beyond_range, keeps_fp32, range_error
from . import comm
from .pieces import box_slices, intersect, is_primary, local_boxes, local_tensor

Region = tuple[slice, ...]


def official_regions(model: torch.nn.Module) -> Iterator[tuple[str, str, Region, tuple[int, ...]]]:
    """(official key, glm53 name, region of the glm53 tensor, key shape) in the order save_pretrained writes."""
    for name, tensor in named_state(model):
        local = name[len("model.") :] if name != "lm_head.weight" else name
        shape = tuple(tensor.shape)
        if name.startswith(VISION_MODULE):  # the tower: its names are the on-disk ones under model.visual.
            yield "model." + name, name, tuple(slice(0, s) for s in shape), shape
            continue
        if name == "lm_head.weight" or not local.endswith(("experts.gate_up_proj", "experts.down_proj")):
            key = name if name == "lm_head.weight" else TEXT_PREFIX + internal_to_official(local)
            yield key, name, tuple(slice(0, s) for s in shape), shape
            continue
        E, rows, cols = shape
        base = TEXT_PREFIX + local.rsplit(".", 1)[0]
        half = rows // 2
        parts = [("gate", 0, half), ("up", half, rows)] if local.endswith("gate_up_proj") else [("down", 0, rows)]
        for e in range(E):
            for part, lo, hi in parts:
                region = (slice(e, e + 1), slice(lo, hi), slice(0, cols))
                yield f"{base}.{e}.{part}_proj.weight", name, region, (hi - lo, cols)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """glm53 name (MTP as model.layers.{N+j}) -> parameter or buffer."""
    return dict(named_state(model))


def assign_writers(sizes: list[int], world: int) -> list[int]:
    """Writer rank of each key: largest first, each to the rank with the fewest bytes so far (ties: lowest)."""
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + sizes[i]
    return owner


def _gather_key(
    tensor: torch.Tensor, region: Region, shape: tuple[int, ...], dtype: torch.dtype, writer: int, rank: int
) -> torch.Tensor | None:
    """The key's full values on `writer` (None elsewhere), summed from each element's primary holder."""
    device = local_tensor(tensor).device
    if not dist.is_initialized():
        return local_tensor(tensor)[region].reshape(shape).to(dtype)
    buffer = torch.zeros(tuple(s.stop - s.start for s in region), dtype=tensor.dtype, device=device)
    if is_primary(tensor) and (not _is_plain(tensor) or rank == writer):
        local = local_tensor(tensor)
        for box in local_boxes(tensor):
            part = intersect(box, region)
            if part is None:
                continue
            local_idx, global_idx = box_slices(part)
            inside = tuple(slice(g.start - r.start, g.stop - r.start) for g, r in zip(global_idx, region))
            buffer[inside] = local[local_idx]
    if not _is_plain(tensor):
        comm.reduce_(buffer, dst=writer)
    return buffer.reshape(shape).to(dtype).cpu() if rank == writer else None


def _is_plain(tensor: torch.Tensor) -> bool:
    return not hasattr(tensor, "device_mesh")


class _RankFiles:
    """One writer rank's safetensors files, flushed at `max_bytes` under temporary names."""

    def __init__(self, directory: str, rank: int, max_bytes: int) -> None:
        self.directory, self.rank, self.max_bytes = directory, rank, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes, self.files = 0, []  # files: [(temp name, keys)]
        self.peak_pending = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if self.pending and self.pending_bytes + tensor.nbytes > self.max_bytes:
            self.flush()
        self.pending[key] = tensor.contiguous()
        self.pending_bytes += tensor.nbytes
        self.peak_pending = max(self.peak_pending, self.pending_bytes)

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"rank{self.rank:05d}-{len(self.files):05d}.partial"
        save_file(self.pending, os.path.join(self.directory, name), metadata={"format": "pt"})
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0


def write_official(
    model: torch.nn.Module, directory: str, *, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB"
) -> dict[str, str]:
    """Write the official-layout tensors and config.json into the existing shared `directory` (every rank).

    -> the weight map (key -> file). `dtype` casts floating tensors except glm53.precision's fp32 keep-list.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tensors = _tensors(model)
    if dtype is not None:
        _check_range(tensors, dtype)
    keys = list(official_regions(model))
    out_dtypes = [_out_dtype(tensors[name], name, dtype) for _, name, _, _ in keys]
    sizes = [_numel(shape) * d.itemsize for (_, _, _, shape), d in zip(keys, out_dtypes)]
    writers = assign_writers(sizes, world)
    files = _RankFiles(directory, rank, parse_size(max_shard_size))
    for (key, name, region, shape), out_dtype, writer in zip(keys, out_dtypes, writers):
        full = _gather_key(tensors[name], region, shape, out_dtype, writer, rank)
        if full is not None:
            files.add(key, full)
    files.flush()
    model.export_peak_pending_bytes = files.peak_pending
    everyone = [files.files]
    if dist.is_initialized():
        everyone = [None] * world
        dist.all_gather_object(everyone, files.files)
    weight_map = _name_files(directory, [f for per_rank in everyone for f in per_rank], rank)
    if rank == 0:
        _write_metadata(model, directory, weight_map, dict(zip([k for k, *_ in keys], sizes)), dtype)
    return weight_map


def _check_range(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """CheckpointError on every rank, before anything is written, when casting some rank's shard to `dtype` would
    write inf (fp16 holds +-65504; from_pretrained refuses such a checkpoint): the ranks' findings are merged, so
    each names every tensor."""
    found = {}
    for name, t in tensors.items():
        if not keeps_fp32(name) and (peak := beyond_range(local_tensor(t), dtype)) is not None:
            found[name] = peak
    if dist.is_initialized():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        found = {n: max(f[n] for f in everyone if n in f) for f in everyone for n in f}
    if found:
        raise CheckpointError(range_error(dict(sorted(found.items())), dtype, "exporting as"))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _out_dtype(tensor: torch.Tensor, name: str, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is None or not tensor.is_floating_point():
        return tensor.dtype
    return torch.float32 if keeps_fp32(name) else dtype


def _name_files(directory: str, files: list[tuple[str, list[str]]], rank: int) -> dict[str, str]:
    """Final names in (rank, file) order; rank 0 renames (the directory is shared)."""
    n = len(files)
    weight_map = {}
    for i, (temp, keys) in enumerate(files):
        final = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        if rank == 0:
            os.rename(os.path.join(directory, temp), os.path.join(directory, final))
        weight_map.update(dict.fromkeys(keys, final))
    return weight_map


def _write_metadata(
    model, directory: str, weight_map: dict[str, str], sizes: dict[str, int], dtype: torch.dtype | None
) -> None:
    """config.json as save_pretrained writes it, and the index when there is more than one file."""
    write_config(model, directory, dtype)
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(os.path.join(directory, INDEX_FILE), index)


def write_config(model, directory: str, dtype: torch.dtype | None = None) -> None:
    """config.json as save_pretrained writes it (official nesting, the stored dtype, no quantization_config)."""
    stored = dtype or model.model.embed_tokens.weight.dtype
    config = official_config(model)
    for d in (config, config["text_config"]):
        d.pop("quantization_config", None)
        d.pop("torch_dtype", None)
    config["text_config"]["dtype"] = config["dtype"] = str(stored).replace("torch.", "")
    write_json(os.path.join(directory, "config.json"), config)


@contextlib.contextmanager
def shared_atomic_directory(
    path: str | os.PathLike, overwrite: bool = False, own: Callable[[str], bool] = checkpoint_owns
) -> Iterator[str]:
    """`atomic_directory` for all ranks: rank 0 creates the temporary directory and renames it when every rank
    left the block without error; the directory must be on a file system every rank sees. Only the entries `own`
    claims are replaced; every other file of an existing `path` (tokenizer, adapters, README, symlinks, earlier
    step-N checkpoints) is kept byte-identical, as save_pretrained does."""
    path = os.path.abspath(os.fspath(path))
    if not dist.is_initialized():
        with atomic_directory(path, overwrite=overwrite, own=own) as tmp:
            yield tmp
        return
    rank = dist.get_rank()
    stack = contextlib.ExitStack()
    box: list = [None]
    if rank == 0:
        try:
            box[0] = stack.enter_context(atomic_directory(path, overwrite=overwrite, own=own))
        except FileExistsError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    with stack:
        try:
            yield box[0]
        except BaseException:
            _agree(False)
            raise
        if not _agree(True):
            raise RuntimeError(f"another rank failed while writing {path}; nothing was written")
    dist.barrier()  # the rename is done before anyone reads the directory


def _agree(ok: bool) -> bool:
    """Every rank learns whether all ranks succeeded (MIN over ranks, on the default group's device: a CPU flag
    on an nccl group fails after every shard was written, discarding the checkpoint)."""
    return comm.all_ranks_agree(ok)


def export_pretrained(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> str:
    """Write a parallelized (or plain) Glm53ForCausalLM to `path` in the official layout; call on every rank.

    What `save_pretrained` writes (config.json, sharded safetensors, index), loadable by `from_pretrained` and
    transformers, written by several ranks at once and atomically (see the module docstring).
    """
    with shared_atomic_directory(path, overwrite=overwrite) as tmp:
        write_official(model, tmp, dtype=dtype, max_shard_size=max_shard_size)
    return os.path.abspath(os.fspath(path))


__all__ = [
    "export_pretrained",
    "write_official",
    "write_config",
    "shared_atomic_directory",
    "official_regions",
    "assign_writers",
]
