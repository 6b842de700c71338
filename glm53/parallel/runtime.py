"""What a training script needs from torch.distributed, so that it never imports it: the process group and the
(dp, tp) mesh, rank queries, and whole (unsharded) model and optimizer state for official-layout checkpoints.

Legend: dp the data-parallel mesh dimension (FSDP2), tp the tensor-parallel one; ranks are laid out
rank = dp_rank * tp + tp_rank (init_device_mesh's row-major order).
"""

from __future__ import annotations

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


def init_mesh(dp: int, tp: int, device_type: str = "cpu", ep: int = 1, cp: int = 1) -> DeviceMesh:
    """Start the process group (gloo on CPU, nccl on CUDA; torchrun's environment) and return the mesh that
    `parallelize` expects: ("dp", "tp") when both exceed 1, else 1-D named after the dimension in use; with
    ep > 1, ("dp", "ep") (dp may be 1), plus "tp" when tp > 1 (which parallelize rejects with EP); with cp > 1
    (context parallelism, not combined with ep or tp), ("dp", "cp"), or ("cp",) when dp is 1."""
    if dp < 1 or tp < 1 or ep < 1 or cp < 1:
        raise ValueError(f"dp, ep, tp and cp must be >= 1, got dp={dp}, ep={ep}, tp={tp}, cp={cp}")
    if cp > 1 and (ep > 1 or tp > 1):
        raise ValueError(f"context parallelism (cp={cp}) is not combined with ep or tp yet, got ep={ep}, tp={tp}")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    if dp * ep * tp * cp != dist.get_world_size():
        raise ValueError(f"dp={dp} x ep={ep} x tp={tp} x cp={cp} = {dp * ep * tp * cp} ranks, but the world has "
                         f"{dist.get_world_size()}")  # fmt: skip
    if cp > 1:
        shape, names = ((dp, cp), ("dp", "cp")) if dp > 1 else ((cp,), ("cp",))
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    if ep > 1:
        shape, names = (dp, ep, tp) if tp > 1 else (dp, ep), ("dp", "ep", "tp") if tp > 1 else ("dp", "ep")
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    if dp > 1 and tp > 1:
        return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        return init_device_mesh(device_type, (tp,), mesh_dim_names=("tp",))
    return init_device_mesh(device_type, (dp,), mesh_dim_names=("dp",))


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
        dist.all_reduce(value, group=mesh[dim].get_group())  # gloo has no AVG
        value /= mesh[dim].size()
    return value


def sum_over(value: torch.Tensor, mesh: DeviceMesh, dim: str = "dp") -> torch.Tensor:
    """A plain tensor summed over mesh dimension `dim` (itself when the mesh has no such dimension)."""
    value = value.detach().clone()
    if dim in (mesh.mesh_dim_names or ()):
        dist.all_reduce(value, group=mesh[dim].get_group())
    return value


def loss_denominators(counts: LossCounts, mesh: DeviceMesh, dim: str = "dp") -> LossCounts:
    """The `loss_denominators` every data-parallel rank passes to its forwards: the loss counts of the global
    batch (this rank's, summed over its micro-batches, then over the `dim` ranks) divided by the number of `dim`
    ranks, because FSDP averages gradients over them: the average of (rank sum) / (global count / dp) is
    (global sum) / (global count), one process's gradient on the whole global batch."""
    size = mesh[dim].size() if dim in (mesh.mesh_dim_names or ()) else 1
    return LossCounts.from_stacked(sum_over(counts.stacked(), mesh, dim) / size)


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


__all__ = ["init_mesh", "shutdown", "rank", "local_rank", "mean_over", "sum_over", "loss_denominators", "barrier", "gather_objects", "full_state",
           "full_optimizer_state", "load_full_optimizer_state"]  # fmt: skip
