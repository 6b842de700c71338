"""Per-rank memory of a parallel layout, read from the real `parallelize` on a fake process group (no data).

Legend: W world size (dp x cp x ep x tp), dp/cp/ep/tp the mesh dimensions (runtime.init_mesh's layout). The model is
built on the meta device; `fake_world(W)` starts torch's `fake` process group as rank 0 of W, whose collectives
do nothing, so `parallelize` places every parameter exactly as on a real run and each local shard's size is
rank 0's. Used by `python -m glm53.tools.plan`.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # the documented way to empty it
from torch.testing._internal.distributed.fake_pg import FakeStore

from .mesh import mesh_layout


@contextlib.contextmanager
def fake_world(world_size: int):
    """Rank 0 of a `world_size` fake process group for the duration of the block (none may be running).

    A device mesh compares equal to any mesh of the same shape and dimension names, whatever its groups, so
    DTensor's sharding-propagation cache, filled in an earlier world, would hand this world results that carry the
    earlier world's meshes, whose group names ("0", "1", ... restarted per world) are not registered here ("Could
    not resolve the process group registered under the name 7"). A world starts and ends with an empty cache and
    a collection (a freed group unregisters its name; one caught in a cycle must go while no world exists)."""
    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group; one is already initialised")
    _forget_previous_worlds()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_previous_worlds()


def _forget_previous_worlds() -> None:
    _clear_sharding_prop_cache()
    gc.collect()


def layout_mesh(dp: int, ep: int, tp: int, device_type: str = "cpu", cp: int = 1) -> DeviceMesh:
    """The mesh `glm53 train --dp --cp --ep --tp` builds (runtime.init_mesh, mesh.mesh_layout), on the current
    process group."""
    shape, names = mesh_layout(dp, tp, ep, cp)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank stores for `t` (its shard for a DTensor)."""
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


@dataclass
class Gather:
    """The largest FSDP all-gather output: the unit's module name and its unsharded bytes on this rank."""

    unit: str
    bytes: int


def largest_gather(model: nn.Module, bytes_of) -> Gather:
    """The FSDP unit whose all-gather output (its parameters unsharded over the FSDP mesh, padding included) is
    largest; `bytes_of(fqn, numel)` prices a parameter's elements (its compute dtype)."""
    best = Gather("", 0)
    names = {id(p): n for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        total = 0
        for fsdp_param in group.fsdp_params:
            numel = fsdp_param.padded_sharded_param_size.numel() * fsdp_param.mesh_info.shard_mesh_size
            total += bytes_of(names.get(id(fsdp_param.sharded_param), ""), numel)
        if total > best.bytes:
            best = Gather(name or "<root>", total)
    return best


__all__ = ["fake_world", "layout_mesh", "local_numel", "largest_gather", "Gather"]
