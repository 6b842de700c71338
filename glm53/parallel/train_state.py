"""Training state (model, optimizer, step, data position, RNG) saved and resumed with DCP, on any layout.

Legend: dp/tp the mesh dimensions of `parallelize`. Every rank writes its own shards (torch.distributed.checkpoint's
FileSystemWriter: one `.distcp` file per rank plus `.metadata`) and nobody gathers a tensor, so a rank holds its
own state plus DCP's staging copy of one item. Loading reshards: a checkpoint saved on dp4 loads on dp2 x tp2 or in
one process. Keys are layout-independent: `model.<fqn>`, `optim.<fqn>.<exp_avg|exp_avg_sq|step>`,
`optim.param_groups` and `extra.<name>` for the caller's objects (step, per-rank RNG and data states: a key a rank
does not save, such as `extra.torch_rng.rank5`, is simply absent on load).

DCP describes a DTensor's local shard as one chunk at its first global offset, which is wrong when the shard is
several runs of the full tensor (the packed gate/up experts under TP, `_StridedShard(1, 2)`: the rank's gate rows
and its up rows). Every DTensor is therefore handed to DCP as `_BoxChunks`: one chunk per box (pieces.py), through
DCP's own chunk protocol (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`), so every
placement saves and reshards exactly.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from .pieces import box_slices, local_boxes

PARAM_GROUPS = "optim.param_groups"


class _BoxChunks:
    """A DTensor as DCP chunks: one per local box, each a view of the local shard (loads write through it)."""

    def __init__(self, tensor: DTensor) -> None:
        self.global_size = tensor.size()
        self.local = tensor.to_local()
        self.views = {}
        for box in local_boxes(tensor):
            local_idx, global_idx = box_slices(box)
            offsets = torch.Size(s.start for s in global_idx)
            self.views[offsets] = (torch.Size(s.stop - s.start for s in global_idx), self.local[local_idx])

    def size(self) -> torch.Size:
        return self.global_size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=sizes) for o, (sizes, _) in self.views.items()]

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.global_size),
            )
            for chunk in self.__create_chunk_list__()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.views[torch.Size(index.offset)][1]


def _entry(tensor):
    return _BoxChunks(tensor) if isinstance(tensor, DTensor) else tensor


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, _BoxChunks) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's meta-tensor initialisation maps objects it does not know to None: keep the chunk entries.
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, _BoxChunks)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(chunks)
        self.state_dict.update(chunks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, _BoxChunks) else super().lookup_tensor(index)


def _flat(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool = False
) -> tuple[dict, dict, dict | None]:
    """(DCP state dict, model state dict, optimizer state dict); the DCP entries alias the other two.
    `trainable_only`: the model's entries are the parameters that require gradients (a frozen base is not saved)."""
    model_sd = get_model_state_dict(model)
    if trainable_only:
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        model_sd = {n: t for n, t in model_sd.items() if n in trained}
    flat: dict[str, object] = {}
    for name, tensor in model_sd.items():
        flat[f"model.{name}"] = _entry(tensor)
    optim_sd = None
    if optimizer is not None:
        optim_sd = get_optimizer_state_dict(model, optimizer)  # initialises an empty AdamW state (zero step)
        for fqn, state in optim_sd["state"].items():
            for key, value in state.items():
                flat[f"optim.{fqn}.{key}"] = _entry(value)
        flat[PARAM_GROUPS] = optim_sd["param_groups"]
    return flat, model_sd, optim_sd


def _no_dist() -> bool:
    return not dist.is_initialized()


def write_training_state(
    directory: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict | None = None,
    *,
    trainable_only: bool = False,
) -> None:
    """Write the state into `directory` (existing, shared by all ranks; call on every rank).

    `extra` maps names to picklable objects or tensors; give per-rank objects per-rank names. `trainable_only`:
    of the model, only the parameters that require gradients (a LoRA run: adapters; the base is re-read).
    """
    flat, _, _ = _flat(model, optimizer, trainable_only)
    for name, value in (extra or {}).items():
        flat[f"extra.{name}"] = value
    dcp.save(flat, checkpoint_id=directory, planner=_SavePlanner(), no_dist=_no_dist())


def saved_keys(directory: str) -> set[str]:
    """The keys stored in a DCP training-state directory (read from its metadata)."""
    try:
        return set(FileSystemReader(directory).read_metadata().state_dict_metadata)
    except Exception as e:  # a truncated or foreign .metadata: EOFError, UnpicklingError, ...
        raise CheckpointError(
            f"{directory}/.metadata cannot be read ({type(e).__name__}: {e}): the training "
            f"state is truncated or corrupt"
        ) from e


def _read_failure(directory: str, error: BaseException) -> CheckpointError:
    """One line for what DCP raised while reading `directory`: per failing rank, the cause and what it means."""
    causes = getattr(error, "failures", {0: (error, None)}) if isinstance(error, CheckpointException) else {}
    causes = {rank: cause[0] if isinstance(cause, tuple) else cause for rank, cause in causes.items()} or {0: error}
    first = next(iter(causes.values()))
    if isinstance(first, (EOFError, RuntimeError)) or "unpickl" in type(first).__name__.lower():
        meaning = "a shard file is truncated or corrupt"
    elif "Size mismatch" in str(first):
        meaning = "it was saved from a model of another shape (was config.json edited since?)"
    else:
        meaning = "see the cause"
    said = "; ".join(f"rank {rank}: {type(c).__name__}: {c}" for rank, c in sorted(causes.items()))
    return CheckpointError(f"{directory}: the training state cannot be read, {meaning} ({said})")


def read_training_state(
    directory: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict | None = None,
    *,
    trainable_only: bool = False,
) -> dict:
    """Load model (and optimizer) state from `directory` into `model` on its current layout (call on every rank).

    `extra` maps names to default objects (a tensor's shape must match the saved one); those present in the
    checkpoint are returned loaded, the others as given. The optimizer's param_groups (lr, betas...) are restored.
    `trainable_only`: only the parameters that require gradients are read (the rest of the model is kept).
    """
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"{directory} holds no DCP training state (no .metadata)")
    stored = saved_keys(directory)
    flat, model_sd, optim_sd = _flat(model, optimizer, trainable_only)
    if optim_sd is not None:  # parameters that never had a gradient have no AdamW state when saved: keep none
        for fqn in [f for f, state in optim_sd["state"].items() if not any(f"optim.{f}.{k}" in stored for k in state)]:
            for key in optim_sd["state"].pop(fqn):
                flat.pop(f"optim.{fqn}.{key}")
    missing = sorted(k for k, v in flat.items() if isinstance(v, (torch.Tensor, _BoxChunks)) and k not in stored)
    if missing:
        raise KeyError(
            f"{directory} lacks training-state keys {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"(saved from a different model or without the optimizer?)"
        )
    wanted = {f"extra.{n}": v for n, v in (extra or {}).items() if f"extra.{n}" in stored}
    flat.update(wanted)
    try:
        dcp.load(flat, checkpoint_id=directory, planner=_LoadPlanner(), no_dist=_no_dist())
    except (CheckpointException, EOFError, OSError, RuntimeError, ValueError) as e:
        raise _read_failure(directory, e) from e
    with torch.no_grad():
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=not trainable_only))
    if optimizer is not None:
        optim_sd["param_groups"] = flat[PARAM_GROUPS]
        _copy_scalars(flat, optim_sd)
        # strict=False: only for the parameters dropped above (the model's own keys were checked strictly)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(strict=False))
    return {**(extra or {}), **{k[len("extra.") :]: flat[k] for k in wanted}}


def _copy_scalars(flat: dict, optim_sd: dict) -> None:
    """DCP replaces non-tensor entries in `flat` rather than writing into them: copy them back."""
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                state[key] = flat[f"optim.{fqn}.{key}"]


__all__ = ["write_training_state", "read_training_state", "saved_keys"]
