"""Kernel-boundary helpers at their edges, in one process under LocalTensorMode (the `meshes` fixture of
test_parallel_boundary.py): grad_placements that do not match the mesh, a sharded loss value, and the head-parallel
input of a plain or replicated parameter (unchanged) versus a sharded one (its gradient summed over the ranks).

Legend: tp the simulated tensor-parallel ranks; x [4, 6] a whole activation on every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from glm53.parallel import PlacementError, materialize_full
from glm53.parallel.boundary import head_parallel_input, plain_value
from tests.parallel.test_parallel_boundary import WORLD, meshes, per_rank  # noqa: F401 (fixture)


def test_grad_placements_must_match_the_mesh(meshes):  # noqa: F811
    with LocalTensorMode(WORLD):
        w = distribute_tensor(torch.randn(6), meshes["2d"], [Replicate(), Replicate()])
        with pytest.raises(PlacementError, match="o_norm.weight: grad_placements"):
            materialize_full(w, "o_norm.weight", grad_placements=[Partial()])


@pytest.mark.parametrize("placement", [Shard(0), Partial()], ids=["shard", "partial"])
def test_a_loss_value_that_is_not_replicated_is_refused(meshes, placement):  # noqa: F811
    with LocalTensorMode(WORLD):
        value = DTensor.from_local(torch.randn(4), meshes["tp4"], [placement])
        with pytest.raises(PlacementError, match="a loss value must be replicated"):
            plain_value(value)


@pytest.mark.parametrize("kind", ["plain", "replicated", "sharded"])
def test_head_parallel_input_sums_gradients_only_for_sharded_parameters(meshes, kind):  # noqa: F811
    mesh = meshes["tp4"]
    with LocalTensorMode(WORLD):  # tensors made outside the mode are plain: the fake group would not sum them
        x_full = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
        module = torch.nn.Linear(6, 8, bias=False)
        if kind != "plain":
            placements = [Shard(0)] if kind == "sharded" else [Replicate()]
            module.weight = torch.nn.Parameter(distribute_tensor(module.weight.data, mesh, placements))
        x = distribute_tensor(x_full, mesh, [Replicate()]).to_local().requires_grad_()
        y = head_parallel_input(module, "weight", x)
        if kind != "sharded":
            assert y is x
            return
        (y * 2).sum().backward()
    for rank, grad in enumerate(per_rank(x.grad)):  # every rank's 2s, summed over the ranks
        torch.testing.assert_close(grad, torch.full((4, 6), 2.0 * WORLD), msg=f"rank {rank}")
