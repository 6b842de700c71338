"""Gloo jobs for `context_parallel_inputs` written out (tests/parallel/test_context_parallel.py), run on every rank.

Legend: B batch, T time (whole sequences); the cp mesh is the whole world.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import context_parallel_inputs


def cp_inputs_job(config: dict, ids: torch.Tensor, position_ids: torch.Tensor | None) -> dict:
    """-> this rank's kwargs (tensors only; `cp` as its (rank, size, offset, total))."""
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("cp",))
    model = Glm53ForCausalLM(Glm53Config(**config))
    kwargs = context_parallel_inputs(model, ids, labels=ids, position_ids=position_ids, mesh=mesh)
    cp = kwargs.pop("cp")
    counts = kwargs.pop("loss_denominators")
    expected = model.loss_counts(ids, None, position_ids)
    same = torch.equal(counts.stacked(), expected.stacked())
    return {**kwargs, "cp": (cp.rank, cp.size, cp.offset, cp.total), "counts_match": same}


__all__ = ["cp_inputs_job"]
