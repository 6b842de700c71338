"""Placements on composed meshes, in one process.

- `parallelize` on every composed layout (hypothesis over dp, cp, ep, tp) under torch's `fake` process group as
  rank 0 of the world (glm53.parallel.memory.fake_world: parameters are placed exactly as on a real run, with
  FSDP): every parameter lives on the mesh its kind needs, with the placement each dimension gives it. Non-expert
  parameters: FSDP over the flattened dp x cp x ep replicas, then the TP plan's placement on "tp"; routed experts:
  FSDP over the flattened dp x cp replicas, Shard(0) on "ep", the TP plan's width split on "tp".
- tp x ep under LocalTensorMode (4 simulated ranks, real collectives, no FSDP): each rank's expert shard is the
  right block of whole experts and the right gate and up rows of their width, and the gradient keeps the
  placements (the gloo tests in test_composed_mesh.py check the gradients' values).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.hooks import as_local
from glm53.parallel import apply_expert_parallel, apply_tensor_parallel, parallelize
from glm53.parallel.memory import fake_world, layout_mesh
from tests.parallel.test_parallel_boundary import SETTINGS, per_rank
from tests.parallel.test_parallel_placements import expected_placement

EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def tiny(**overrides) -> Glm53Config:
    """KDA + MoE, MLA (full indexer) + MoE, MLA (shared top-k) + dense, one MTP layer: heads divide by 2."""
    base = dict(
        num_hidden_layers=3,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
        mlp_layer_types=["sparse", "sparse", "dense"],
        indexer_types=["full", "full", "shared"],
        num_nextn_predict_layers=1,
    )
    base.update(overrides)
    return Glm53Config.tiny(**base)


def _flat_name(names: list[str]) -> str | None:
    return "_".join(names) if names else None


def expected_layout(name: str, dp: int, cp: int, ep: int, tp: int) -> tuple[tuple[str, ...], tuple]:
    """(mesh dimension names, placements with the FSDP dimension's left as None) of parameter `name`."""
    dims = [d for d, s in (("dp", dp), ("cp", cp), ("ep", ep)) if s > 1 or (d == "dp" and ep > 1)]
    expert = name.endswith(EXPERTS) and ep > 1
    replicas = _flat_name([d for d in dims if d != "ep"] if expert else dims)
    names: list[str] = [replicas] if replicas else []
    placements: list = [None] if replicas else []
    if expert:
        names.append("ep")
        placements.append(Shard(0))
    if tp > 1:
        names.append("tp")
        placements.append(expected_placement(name))
    return tuple(names), tuple(placements)


@settings(max_examples=14, **SETTINGS)
@given(
    dp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2])
)
def test_every_parameter_has_its_placement_on_every_dimension(dp, cp, ep, tp):
    world = dp * cp * ep * tp
    if world == 1 or dist.is_initialized():
        return
    config = tiny()
    with torch.device("meta"):
        model = Glm53ForCausalLM(config)
    full_shapes = {n: p.shape for n, p in model.named_parameters()}
    with fake_world(world):
        parallelize(model, layout_mesh(dp, ep, tp, cp=cp))
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            names, want = expected_layout(name, dp, cp, ep, tp)
            assert param.device_mesh.mesh_dim_names == names, (name, param.device_mesh.mesh_dim_names, names)
            got = tuple(param.placements)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                if w is None:  # FSDP: a Shard (strided when the TP split shares its dimension)
                    assert isinstance(g, (Shard, _StridedShard)), (name, got)
                else:
                    assert g == w, f"{name} on {names[i]}: {g} instead of {w} ({got})"
            # this rank stores its share: whole over the shard dimensions, FSDP padding at most one row per rank
            shards = 1
            for n, g in zip(names, got):
                shards *= 1 if g.is_replicate() else param.device_mesh[n].size()
            local, numel = param.to_local().numel(), full_shapes[name].numel()
            row = numel // full_shapes[name][0]
            assert numel <= local * shards <= numel + shards * row, (name, local, shards, numel)
            if name.endswith(EXPERTS) and ep > 1:
                assert param.to_local().shape[0] == config.n_routed_experts // ep or got[0].dim == 0, (name, got)
        # The meshes and groups die with the model: collect it while its world exists (collected later, inside
        # another test's fake world, it unregisters that world's groups).
        del model, param
        gc.collect()


@pytest.fixture(scope="module")
def ep_tp_mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with fake_world(4):  # collects the previous world's leftovers first
        with LocalTensorMode(4):
            mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
        yield mesh


@settings(max_examples=4, **SETTINGS)
@given(per_rank_experts=st.integers(1, 3), I=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_tp_x_ep_experts_hold_whole_experts_and_their_width_slice(ep_tp_mesh, per_rank_experts, I, seed):
    E, ep, tp = 2 * per_rank_experts, 2, 2
    config = Glm53Config.tiny(
        n_routed_experts=E,
        moe_intermediate_size=I,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=1,
        num_nextn_predict_layers=0,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["sparse"],
    )
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(config)
    experts = model.model.layers[0].mlp.experts
    full = {n: p.detach().clone() for n, p in experts.named_parameters()}
    with LocalTensorMode(4):
        apply_tensor_parallel(model, ep_tp_mesh["tp"])
        apply_expert_parallel(model, ep_tp_mesh["ep"], ep_tp_mesh[("ep", "tp")])
        gate_up, down = experts.gate_up_proj, experts.down_proj
        assert gate_up.device_mesh.mesh_dim_names == ("ep", "tp")
        assert tuple(gate_up.placements) == (Shard(0), _StridedShard(1, split_factor=2))
        assert tuple(down.placements) == (Shard(0), Shard(2))
        local_gate_up = as_local(experts, "gate_up_proj")
        local_down = as_local(experts, "down_proj")
        (local_gate_up.sum() + 2 * local_down.sum()).backward()
        assert tuple(gate_up.grad.placements) == tuple(gate_up.placements)
        assert tuple(down.grad.placements) == tuple(down.placements)
        for value in per_rank(gate_up):  # the pieces put back together are the whole parameter
            torch.testing.assert_close(value, full["gate_up_proj"], rtol=0, atol=0)
        for value in per_rank(down.grad):  # each rank's piece of the gradient: its ones, every piece filled
            torch.testing.assert_close(value, torch.full_like(full["down_proj"], 2.0), rtol=0, atol=0)
    El, Il = E // ep, I // tp
    gate, up = full["gate_up_proj"].chunk(2, dim=1)  # [E, I, D] each
    for rank, shard in local_gate_up._local_tensors.items():
        r, t = divmod(rank, tp)  # ranks = ep_rank * tp + tp_rank ("tp" innermost)
        block = slice(r * El, (r + 1) * El)
        width = slice(t * Il, (t + 1) * Il)
        expected = torch.cat([gate[block, width], up[block, width]], dim=1)
        torch.testing.assert_close(shard, expected, rtol=0, atol=0)
    for rank, shard in local_down._local_tensors.items():
        r, t = divmod(rank, tp)
        torch.testing.assert_close(
            shard, full["down_proj"][r * El : (r + 1) * El, :, t * Il : (t + 1) * Il], rtol=0, atol=0
        )
    assert Replicate() not in gate_up.placements
