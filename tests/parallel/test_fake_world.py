"""glm53.parallel.memory.fake_world, the in-process world the plan tools and the placement tests run in: a world
started after another sees none of the earlier world's meshes (the parity tests in test_parallel_boundary.py failed
on a full-suite run when test_composed_placements.py's worlds ran before them)."""

import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from glm53.parallel.memory import fake_world


def test_a_later_fake_world_gets_none_of_an_earlier_worlds_meshes():
    """Meshes of one shape and names compare equal across worlds. The first world makes three throwaway 2x2 meshes
    first, so its "tp" mesh's groups have names the second world never registers; a result DTensor's mesh coming
    from DTensor's sharding cache of the first world could not gather in the second."""
    x = torch.arange(16.0).reshape(4, 4)
    for throwaway in (3, 0):
        with fake_world(4), LocalTensorMode(4):
            for _ in range(throwaway):
                init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
            y = distribute_tensor(x, mesh, [Shard(0)]) * 2
            full = y.full_tensor()
            assert all(torch.equal(v, 2 * x) for v in full._local_tensors.values())
