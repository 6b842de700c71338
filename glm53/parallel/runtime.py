"""What a training script needs from torch.distributed, so that it never imports it: the process group and the
(dp, tp) mesh, rank queries, and whole (unsharded) model and optimizer state for official-layout checkpoints.

Legend: dp, cp, ep, tp the mesh dimensions (mesh.py: their order, rank = ((dp_rank * cp + cp_rank) * ep + ep_rank)
* tp + tp_rank, and which of them each reduction spans).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..losses.counts import LossCounts
from . import comm
from .mesh import DATA_DIMS, mesh_layout, present, size_over

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # a collective waits this long for its peers before failing


def _start_process_group(device_type: str, timeout: datetime.timedelta) -> None:
    """gloo on CPU; on an accelerator its backend bound to this rank's device (torchrun's LOCAL_RANK), so that
    nccl knows its device up front (eager communicator, no device guess at the first barrier)."""
    if device_type == "cpu":
        dist.init_process_group("gloo", timeout=timeout)
        return
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    torch.accelerator.set_device_index(device.index)
    dist.init_process_group("nccl" if device_type == "cuda" else None, timeout=timeout, device_id=device)


def init_mesh(
    dp: int, tp: int, device_type: str = "cpu", ep: int = 1, cp: int = 1, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> DeviceMesh:
    """Start the process group (gloo on CPU, nccl on CUDA; torchrun's environment) and return the mesh that
    `parallelize` expects: the dimensions in use in the order ("dp", "cp", "ep", "tp"), "dp" kept (even of size
    1) when ep > 1, ("dp",) when none is in use (glm53/parallel/mesh.py says why that order and which dimensions
    each collective spans). The world size must be dp x cp x ep x tp. `timeout`: how long a collective waits for
    the other ranks (the process group's timeout)."""
    shape, names = mesh_layout(dp, tp, ep, cp)
    if not dist.is_initialized():
        _start_process_group(device_type, timeout)
    if dp * ep * tp * cp != dist.get_world_size():
        raise ValueError(
            f"dp={dp} x cp={cp} x ep={ep} x tp={tp} = {dp * cp * ep * tp} ranks, but the world has "
            f"{dist.get_world_size()}"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def shutdown() -> None:
    """Destroy the process group if one was started."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank(mesh: DeviceMesh, dim: str) -> int:
    """This rank's coordinate on mesh dimension `dim` (0 when the mesh has no such dimension)."""
    return mesh.get_local_rank(dim) if dim in (mesh.mesh_dim_names or ()) else 0


def mean_over(value: torch.Tensor, mesh: DeviceMesh, dim: str = "dp") -> torch.Tensor:
    """A plain tensor averaged over mesh dimension `dim` (itself when the mesh has no such dimension)."""
    value = value.detach().clone()
    if dim in (mesh.mesh_dim_names or ()):
        value = comm.all_reduce(value, group=mesh[dim].get_group())  # gloo has no AVG
        value /= mesh[dim].size()
    return value


def sum_over(value: torch.Tensor, mesh: DeviceMesh, dim: str = "dp") -> torch.Tensor:
    """A plain tensor summed over mesh dimension `dim` (itself when the mesh has no such dimension)."""
    value = value.detach().clone()
    if dim in (mesh.mesh_dim_names or ()):
        value = comm.all_reduce(value, group=mesh[dim].get_group())
    return value


def loss_denominators(counts: LossCounts, mesh: DeviceMesh, dim: str | Sequence[str] = DATA_DIMS) -> LossCounts:
    """The `loss_denominators` every data-parallel rank passes to its forwards: the loss counts of the global
    batch (this rank's, summed over its micro-batches, then over the ranks of the `dim` dimensions: by default
    dp and ep, the ranks that read their own rows) divided by the number of those ranks, because FSDP averages
    gradients over them: the average of (rank sum) / (global count / n) is (global sum) / (global count), one
    process's gradient on the whole global batch. Dimensions the mesh lacks are skipped."""
    dims = [dim] if isinstance(dim, str) else list(dim)
    stacked = counts.stacked()
    for name in present(mesh, dims):
        stacked = sum_over(stacked, mesh, name)
    return LossCounts.from_stacked(stacked / size_over(mesh, dims))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_objects(obj) -> list:
    """`obj` from every rank, in rank order, on every rank (pickled; for small things like RNG states)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor gathered to a plain full tensor (call on every rank)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().clone()
    return state


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter FQN with full tensors (call on every rank)."""
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a `full_optimizer_state` into a (re)parallelized model's optimizer, resharding it (every rank)."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


__all__ = [
    "init_mesh",
    "shutdown",
    "rank",
    "local_rank",
    "mean_over",
    "sum_over",
    "loss_denominators",
    "barrier",
    "gather_objects",
    "full_state",
    "full_optimizer_state",
    "load_full_optimizer_state",
]
