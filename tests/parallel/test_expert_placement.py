"""Expert-parallel placements in one process: `LocalTensorMode` + the `fake` process group simulate 4 ranks
(see test_parallel_boundary.py), so generated expert shapes and meshes are checked in milliseconds.

Meshes: ("ep",) of 4, the "ep" half of a (2, 2) ("dp", "ep") mesh, and a (1, 4) ("dp", "ep") mesh. FSDP needs
real processes (test_expert_parallel.py); here: the Shard(0) experts, what `as_local` hands the kernel and its
gradient, the FSDP shard-dimension choice, and the errors for unsupported layouts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from glm53 import Glm53Config
from glm53.hooks import as_local, expert_dispatcher
from glm53.model.moe import Experts
from glm53.parallel import PlacementError, apply_expert_parallel, check_ep_size
from glm53.parallel.expert import expert_shard_placement
from glm53.parallel.memory import fake_world
from glm53.parallel.placements import LocalShard, set_placement_rule
from tests.parallel.test_parallel_boundary import SETTINGS, per_rank

WORLD = 4


@pytest.fixture(scope="module")
def meshes():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with fake_world(WORLD):  # collects the previous world's leftovers first
        with LocalTensorMode(WORLD):
            ep4 = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
            dp2ep2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
            dp1ep4 = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "ep"))
            dp1ep2tp2 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
        yield {"ep4": ep4, "dp2xep2": dp2ep2, "dp1xep4": dp1ep4, "dp1xep2xtp2": dp1ep2tp2}


def experts_module(E: int, D: int, I: int, seed: int) -> torch.nn.Module:
    config = Glm53Config.tiny(n_routed_experts=E, hidden_size=D, moe_intermediate_size=I, n_group=1, topk_group=1)
    module = torch.nn.ModuleDict({"experts": Experts(config)})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


@settings(max_examples=20, **SETTINGS)
@given(
    mesh_name=st.sampled_from(["ep4", "dp2xep2", "dp1xep4"]),
    per_rank_experts=st.integers(1, 3),
    D=st.sampled_from([8, 12]),
    I=st.sampled_from([4, 6]),
    seed=st.integers(0, 2**16),
)
def test_experts_shard0_over_ep_and_as_local_gives_this_ranks_experts(meshes, mesh_name, per_rank_experts, D, I, seed):
    mesh = meshes[mesh_name]
    ep_mesh = mesh["ep"] if mesh.ndim > 1 else mesh
    ep = ep_mesh.size()
    E = per_rank_experts * ep
    module = experts_module(E, D, I, seed)
    full = {n: p.detach().clone() for n, p in module.experts.named_parameters()}
    cot = torch.randn(E, 2 * I, D, generator=torch.Generator().manual_seed(seed + 1))
    with LocalTensorMode(WORLD):
        apply_expert_parallel(module, ep_mesh)
        experts = module.experts
        assert expert_dispatcher(experts) is not None
        for name, param in experts.named_parameters():
            assert isinstance(param, DTensor) and tuple(param.placements) == (Shard(0),), (name, param.placements)
            assert param.to_local().shape[0] == E // ep
        local = as_local(experts, "gate_up_proj")
        assert not isinstance(local, DTensor) and local.shape == (E // ep, 2 * I, D)
        local_cot = distribute_tensor(cot, ep_mesh, [Shard(0)]).to_local()
        (local * local_cot).sum().backward()
        grad = experts.gate_up_proj.grad
        assert tuple(grad.placements) == (Shard(0),)
        for value in per_rank(grad):  # each rank's shard of the gradient is its experts' cotangent
            torch.testing.assert_close(value, cot)
        for value in per_rank(experts.down_proj):
            torch.testing.assert_close(value, full["down_proj"])
    # rank r of the ep mesh holds experts [r El, (r + 1) El) (ep is the mesh's last, fastest dimension)
    El = E // ep
    for rank, shard in local._local_tensors.items():
        r = rank % ep
        torch.testing.assert_close(shard, full["gate_up_proj"][r * El : (r + 1) * El])


def test_experts_boundary_rejects_other_placements(meshes):
    mesh = meshes["ep4"]
    module = experts_module(8, 8, 4, 0)
    with LocalTensorMode(WORLD):
        experts = module.experts
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            experts.register_parameter(name, torch.nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()])))
            set_placement_rule(experts, name, LocalShard((Shard(0),)), fqn="layers.1.mlp.experts")
        with pytest.raises(PlacementError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
            as_local(experts, "gate_up_proj")


@settings(max_examples=40, **SETTINGS)
@given(
    shape=st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(1, 40)),
    dp=st.integers(1, 9),
    ep_sharded=st.booleans(),
)
def test_expert_fsdp_dim_splits_evenly(shape, dp, ep_sharded):
    """FSDP shards routed experts on a dim that splits evenly (dims 1, 2 first under EP); FSDP's padded dim 0 only
    when none does (without EP), an error under EP."""
    param = torch.nn.Parameter(torch.empty(shape, device="meta"))
    order = (1, 2, 0) if ep_sharded else (0, 1, 2)
    even = [d for d in order if shape[d] % dp == 0]
    if not even and ep_sharded:
        with pytest.raises(ValueError, match="moe_intermediate_size"):
            expert_shard_placement(dp, ep_sharded)(param)
        return
    placement = expert_shard_placement(dp, ep_sharded)(param)
    assert placement == Shard(even[0] if even else 0)


def test_experts_not_divisible_over_ep_raise(meshes):
    with pytest.raises(ValueError, match="n_routed_experts=6 is not divisible by 4"):
        check_ep_size(experts_module(6, 8, 4, 0), 4)


def test_ep_with_tp_needs_the_ep_tp_mesh(meshes):
    """Experts already split over tp (the TP plan) get the ep split only on the ("ep", "tp") mesh."""
    module = experts_module(4, 8, 4, 0)
    mesh = meshes["dp1xep2xtp2"]
    with LocalTensorMode(WORLD):
        param = module.experts.gate_up_proj
        module.experts.register_parameter(
            "gate_up_proj", torch.nn.Parameter(distribute_tensor(param.data, mesh["tp"], [Replicate()]))
        )
        with pytest.raises(ValueError, match=r"gate_up_proj is already a DTensor .* needs the \('ep', 'tp'\) mesh"):
            apply_expert_parallel(module, mesh["ep"])


# -------------------------------------------------------------------------------- split sizes and the gradient norm
def test_split_sizes_are_per_rank_sums_of_what_is_sent_and_what_arrives():
    """ep 2, two local experts each: the send split sums the counts this rank sends to each rank's experts, the
    receive split what arrives from each source rank; unequal on purpose (a swap or a reuse of one for the other
    is a wrong value here, not only a size error)."""
    from glm53.parallel.expert import _split_sizes

    sent = torch.tensor([1, 2, 3, 4])  # to experts 0, 1 (rank 0) and 2, 3 (rank 1)
    arriving = torch.tensor([5, 0, 2, 9])  # from rank 0 for local experts 0, 1; from rank 1 likewise
    assert _split_sizes(sent, arriving, 2) == ([3, 7], [5, 11])


def test_clip_grad_norm_sums_every_mesh_once(meshes):
    """Gradients on two meshes (experts on the 2-D (dp, ep) mesh, the rest on the 1-D ep mesh) and a plain one:
    the total is the norm of all full gradients together (each mesh's norm completed over its own ranks, then
    combined), the same on every rank, and every gradient is scaled by max_norm / total."""
    from glm53.parallel.expert import clip_grad_norm_

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(8, 4, generator=g), torch.randn(4, 8, generator=g), torch.randn(3, generator=g)]
    with LocalTensorMode(WORLD):
        params = [
            torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), meshes["dp2xep2"], [Replicate(), Shard(0)])),
            torch.nn.Parameter(distribute_tensor(torch.zeros(4, 8), meshes["ep4"], [Shard(1)])),
            torch.nn.Parameter(torch.zeros(3)),
        ]
        params[0].grad = distribute_tensor(full[0], meshes["dp2xep2"], [Replicate(), Shard(0)])
        params[1].grad = distribute_tensor(full[1], meshes["ep4"], [Shard(1)])
        params[2].grad = full[2].clone()
        expected = torch.linalg.vector_norm(torch.cat([f.flatten() for f in full]))
        total = clip_grad_norm_(params, max_norm=1.0)
        for value in per_rank(total):
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)  # fp32 sum of 67 squares
        coef = 1.0 / (expected + 1e-6)
        for p, f in zip(params, full):
            for value in per_rank(p.grad):
                torch.testing.assert_close(value, f * coef, rtol=1e-6, atol=1e-7)
