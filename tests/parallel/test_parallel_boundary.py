"""glm53.parallel in one process: materialize_full, every kernel boundary under generated placements, the TP
plan's keys and parallelize's errors.

`LocalTensorMode` with the `fake` process group runs a whole world of 4 ranks in this process and computes the
collectives (docs/parallel.md), so placement properties are checked in milliseconds per example. Meshes:
tp=2 (the "tp" half of a 2x2 mesh) and tp=4. FSDP needs real processes: see test_parallel_gloo.py.

Kernel-boundary helpers at their edges, in one process under LocalTensorMode (the `meshes` fixture of
test_parallel_boundary.py): grad_placements that do not match the mesh, a sharded loss value, and the head-parallel
input of a plain or replicated parameter (unchanged) versus a sharded one (its gradient summed over the ranks).

Legend: tp the simulated tensor-parallel ranks; x [4, 6] a whole activation on every rank.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import glm53
from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.model.context import ForwardContext
from glm53.model.hyper_connection import expand_streams
from glm53.parallel import (
    LocalShardParams,
    PlacementError,
    ReplicateParams,
    init_weights,
    local_shard,
    materialize_full,
    parallelize,
    tp_plan,
)
from glm53.parallel.memory import fake_world
from glm53.parallel.placements import head_parallel_input, plain_value

WORLD = 4
TOL = 1e-5  # fp32, relative to the largest reference magnitude
SETTINGS = dict(
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def tiny(**overrides) -> Glm53Config:
    """Heads divisible by 4; one KDA+MoE layer and one MLA(indexer)+dense layer (+ a shared-top-k MLA layer)."""
    base = dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        linear_num_heads=4,
        num_hidden_layers=3,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
        mlp_layer_types=["sparse", "dense", "sparse"],
        indexer_types=["full", "full", "shared"],
    )
    base.update(overrides)
    return Glm53Config.tiny(**base)


@pytest.fixture(scope="module")
def meshes():
    """{"tp2": the "tp" half of a (2, 2) mesh, "tp4": a (4,) mesh, "2d": the (2, 2) mesh}, all under one fake PG."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with fake_world(WORLD):  # collects the previous world's leftovers first
        with LocalTensorMode(WORLD):
            mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            tp4 = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        yield {"tp2": mesh2d["tp"], "tp4": tp4, "2d": mesh2d}


def per_rank(t: torch.Tensor) -> list[torch.Tensor]:
    """The value on every simulated rank (a plain tensor is the same on all)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return list(t._local_tensors.values()) if hasattr(t, "_local_tensors") else [t]


def assert_close_all_ranks(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().clamp_min(1e-6)
    for rank, value in enumerate(per_rank(actual)):
        err = ((value - expected).abs().max() / scale).item()
        assert err <= TOL, f"{what} on rank {rank}: relative error {err:.2e}"


# ----------------------------------------------------------------------------------------------- materialize_full
def test_materialize_full_plain_tensor_is_identity():
    t = torch.randn(3, 4, requires_grad=True)
    assert materialize_full(t, "w") is t
    assert materialize_full(t, "w", grad_placements=[Partial()]) is t
    assert local_shard(t, "w", [Shard(0)]) is t


PLACEMENT_KINDS = ("replicate", "shard", "strided", "partial")


@settings(max_examples=25, **SETTINGS)
@given(
    mesh_name=st.sampled_from(["tp2", "tp4", "2d"]),
    shape=st.lists(st.sampled_from([8, 16]), min_size=1, max_size=3),
    data=st.data(),
)
def test_materialize_full_accepts_only_replicate(meshes, mesh_name, shape, data):
    mesh = meshes[mesh_name]
    kinds = [data.draw(st.sampled_from(PLACEMENT_KINDS)) for _ in range(mesh.ndim)]
    dims = [data.draw(st.integers(0, len(shape) - 1)) for _ in range(mesh.ndim)]
    make = {
        "replicate": lambda d: Replicate(),
        "shard": Shard,
        "partial": lambda d: Partial(),
        "strided": lambda d: _StridedShard(d, split_factor=2),
    }
    placements = [make[k](d) for k, d in zip(kinds, dims)]
    full = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    cotangent = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    with LocalTensorMode(WORLD):
        if all(k == "replicate" for k in kinds):
            param = distribute_tensor(full, mesh, placements).requires_grad_()
            local = materialize_full(param, "layers.0.w")
            assert not isinstance(local, DTensor)
            assert_close_all_ranks(local, full, "materialized value")
            (local * cotangent).sum().backward()
            assert_close_all_ranks(param.grad, cotangent, "gradient")
        else:
            local_shape = list(shape)
            for kind, d, n in zip(kinds, dims, mesh.shape):
                if kind in ("shard", "strided"):
                    local_shape[d] //= n
            param = DTensor.from_local(torch.randn(local_shape), mesh, placements, run_check=False)
            with pytest.raises(PlacementError, match=r"layers\.0\.w") as err:
                materialize_full(param, "layers.0.w")
            assert "mesh" in str(err.value) and "placements" in str(err.value)


@pytest.mark.parametrize("mesh_name", ["tp2", "tp4"])
def test_partial_grad_placements_for_sharded_activations(meshes, mesh_name):
    """A Replicate weight scaling activations sharded on the mesh: its gradient is the sum over ranks."""
    mesh = meshes[mesh_name]
    n = mesh.size()
    w_full = torch.randn(6)
    x_full = torch.randn(4 * n, 6)
    expected = x_full.sum(0)  # d/dw sum(w * x)
    with LocalTensorMode(WORLD):
        w = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
        x = distribute_tensor(x_full, mesh, [Shard(0)]).to_local()  # this rank's rows
        (materialize_full(w, "o_norm.weight", grad_placements=[Partial()]) * x).sum().backward()
        assert_close_all_ranks(w.grad, expected, "Partial-declared gradient")


def test_local_shard_rejects_other_placements(meshes):
    with LocalTensorMode(WORLD):
        t = distribute_tensor(torch.randn(8, 4), meshes["tp2"], [Shard(1)])
        with pytest.raises(PlacementError, match="dt_bias"):
            local_shard(t, "dt_bias", [Shard(0)])


# ------------------------------------------------------------------------------------ kernel boundaries in modules
def apply_subplan(model: Glm53ForCausalLM, prefix: str, module: torch.nn.Module, mesh) -> dict[str, tuple]:
    """Apply the entries of tp_plan(model) under `prefix` to (a copy of) that module; return its boundary
    parameters (relative name -> the placements the plan gives them)."""
    boundary = {}
    for key, style in tp_plan(model).items():
        if key != prefix and not key.startswith(prefix + "."):
            continue
        rel = key[len(prefix) + 1 :]
        target = module.get_submodule(rel)
        parallelize_module(target, mesh, style)
        if isinstance(style, ReplicateParams):
            placements = {n: (Replicate(),) for n, _ in target.named_parameters(recurse=False)}
        elif isinstance(style, LocalShardParams):
            placements = {name: (placement,) for name, placement in style.placements.items()}
        else:
            continue
        for name, placement in placements.items():
            boundary[f"{rel}.{name}" if rel else name] = placement
    return boundary


def run_site(kind: str, model: Glm53ForCausalLM, module: torch.nn.Module, x: torch.Tensor, valid: torch.Tensor):
    if kind == "kda":
        return module(x, ForwardContext(valid=valid))
    if kind.startswith("mla"):
        return module(x, ForwardContext(valid=valid))[0]
    if kind == "moe":
        return module(x)
    if kind == "hc":  # an mHC site around the block's input norm
        norm = model.model.layers[0].input_layernorm
        streams = expand_streams(x, model.config.hc_mult)
        h, mix = module.enter(streams)  # the site's two halves around the block (model/hyper_connection.py)
        return module.exit(streams, norm(h) * 2, mix)
    raise ValueError(kind)


SITES = {  # kind -> FQN of the module in the tiny model
    "kda": "model.layers.0.self_attn",
    "mla": "model.layers.1.self_attn",  # absorbed form (the default), also under TP
    "mla-per-head": "model.layers.1.self_attn",
    "moe": "model.layers.0.mlp",
    "hc": "model.layers.0.attn_hc",
}


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return Glm53ForCausalLM(tiny())


@pytest.mark.parametrize("placed", ["as-planned", "misplaced"])
@pytest.mark.parametrize("kind", sorted(SITES))
@settings(max_examples=2, **SETTINGS)
@given(
    mesh_name=st.sampled_from(["tp2", "tp4"]),
    batch=st.integers(1, 2),
    seq=st.sampled_from([5, 9]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_kernel_boundaries_exact_or_clear_error(meshes, tiny_model, kind, placed, mesh_name, batch, seq, seed, data):
    """Boundary parameters get the plan's placements, or some get Replicate or Shard(d) instead: the module
    then gives the single-process output and gradients, or raises PlacementError naming a misplaced parameter."""
    mesh = meshes[mesh_name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, tiny_model.config.hidden_size, generator=g)
    valid = torch.ones(batch, seq, dtype=torch.bool)
    valid[0, : seq // 3] = False  # left padding on one row
    ref_module = tiny_model.get_submodule(SITES[kind])
    ref_module.zero_grad(set_to_none=True)
    tiny_model.model.layers[0].input_layernorm.zero_grad(set_to_none=True)
    x_ref = x.clone().requires_grad_()
    ref_out = run_site(kind, tiny_model, ref_module, x_ref, valid)
    cot = torch.randn(ref_out.shape, generator=g)
    (ref_out * cot).sum().backward()
    ref_grads = {n: p.grad for n, p in ref_module.named_parameters() if p.grad is not None}

    model = copy.deepcopy(tiny_model)
    module = model.get_submodule(SITES[kind])
    with LocalTensorMode(WORLD):
        if kind == "hc":
            parallelize_module(model.model.layers[0].input_layernorm, mesh, ReplicateParams())
        boundary = apply_subplan(model, SITES[kind], module, mesh)
        module_form = {"mla": True, "mla-per-head": False}
        if kind in module_form:
            module.absorb = module_form[kind]  # the reference runs the default (absorbed) form
        misplaced = []
        if placed == "misplaced":
            names = data.draw(st.lists(st.sampled_from(sorted(boundary)), min_size=1, max_size=3, unique=True))
            for name in names:
                param = module.get_parameter(name)
                shardable = [d for d in range(param.dim()) if param.shape[d] % mesh.size() == 0]
                options = [(Replicate(),)] + [(Shard(d),) for d in shardable]
                options = [o for o in options if o != boundary[name]]
                if not options:
                    continue
                chosen = data.draw(st.sampled_from(options), label=name)
                misplaced.append(name)
                owner, _, attr = name.rpartition(".")
                whole = param.full_tensor().detach()
                moved = torch.nn.Parameter(distribute_tensor(whole, mesh, chosen))
                module.get_submodule(owner).register_parameter(attr, moved)
        x_dist = x.clone().requires_grad_()
        if misplaced:
            with pytest.raises(PlacementError) as err:
                run_site(kind, model, module, x_dist, valid)
            assert any(name.rpartition(".")[2] in str(err.value) for name in misplaced), str(err.value)
            return
        out = run_site(kind, model, module, x_dist, valid)
        (out * cot).sum().backward()
        assert_close_all_ranks(out.detach(), ref_out.detach(), "output")
        assert_close_all_ranks(x_dist.grad, x_ref.grad, "input gradient")
        for name, expected in ref_grads.items():
            assert_close_all_ranks(module.get_parameter(name).grad, expected, f"gradient of {name}")


# ------------------------------------------------------------------------------------------------ plan and errors
@pytest.mark.parametrize(
    "config",
    [tiny(), Glm53Config.tiny(), tiny(num_nextn_predict_layers=2, mtp_depth=2)],
    ids=["kda-mla-shared", "tiny-preset", "mtp"],
)
def test_every_plan_key_resolves_and_covers_every_parameter(config):
    model = Glm53ForCausalLM(config)
    plan = tp_plan(model)
    if config.num_nextn_predict_layers:
        for name in (
            "eh_proj",
            "enorm",
            "hnorm",
            "shared_head.norm",
            "self_attn.q_b_proj",
            "self_attn.indexer",
            "mlp.experts",
            "mlp.gate",
        ):
            assert f"mtp.layers.1.{name}" in plan
    for key in plan:
        model.get_submodule(key)  # raises AttributeError for a key that names no module
    owners = {name.rpartition(".")[0] for name, _ in model.named_parameters()}
    assert owners <= set(plan), f"modules with parameters but no plan entry: {sorted(owners - set(plan))}"


def test_parallelize_errors(meshes):
    with LocalTensorMode(WORLD):
        with pytest.raises(ValueError, match="num_attention_heads=2"):
            parallelize(Glm53ForCausalLM(tiny(num_attention_heads=2, num_key_value_heads=2)), meshes["tp4"])
        with pytest.raises(ValueError, match="linear_num_heads=2"):
            parallelize(Glm53ForCausalLM(tiny(linear_num_heads=2)), meshes["tp4"])
        with pytest.raises(ValueError, match="vocab_size=322"):
            parallelize(Glm53ForCausalLM(tiny(vocab_size=322)), meshes["tp4"])
        with pytest.raises(ValueError, match="moe_intermediate_size=18"):
            parallelize(Glm53ForCausalLM(tiny(moe_intermediate_size=18)), meshes["tp4"])
        unnamed = init_device_mesh("cpu", (WORLD,))
        with pytest.raises(ValueError, match="named dimensions"):
            parallelize(Glm53ForCausalLM(tiny()), unnamed)
        other = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data",))
        with pytest.raises(ValueError, match="'data'"):
            parallelize(Glm53ForCausalLM(tiny()), other)
        with pytest.raises(ValueError, match="mp_policy"):
            from torch.distributed.fsdp import MixedPrecisionPolicy

            parallelize(Glm53ForCausalLM(tiny()), meshes["tp4"], mp_policy=MixedPrecisionPolicy(torch.bfloat16))
        model = parallelize(Glm53ForCausalLM(tiny()), meshes["tp2"])
        assert all(isinstance(p, DTensor) for p in model.parameters())
        ids = torch.randint(1, 320, (1, 6))
        out = model(ids, labels=ids)  # the model's losses need no loss_parallel_context (parallel/vocab_loss.py)
        assert bool(out.loss.isfinite()) and isinstance(out.logits, DTensor) and out.logits.placements[0].is_shard(2)
        with pytest.raises(RuntimeError, match="already"):
            parallelize(model, meshes["tp2"])


def test_only_glm53_parallel_imports_torch_distributed():
    """docs/style.md, "Parallelism": model code stays free of torch.distributed."""
    root = Path(glm53.__file__).parent
    imports = re.compile(r"^\s*(import|from)\s+torch\.distributed", re.MULTILINE)
    model_files = [p for p in root.rglob("*.py") if "parallel" not in p.relative_to(root).parts]
    offenders = [str(p.relative_to(root)) for p in model_files if imports.search(p.read_text())]
    assert model_files and not offenders, offenders


def test_meta_build_then_parallelize_then_init(meshes):
    """The large-model flow: build on meta, parallelize, materialize, glm53.parallel.init_weights: replicas
    agree on every rank and the pad row of the vocab-sharded embedding is zero (a plain `weight[pad].zero_()`
    on the sharded DTensor leaves it unchanged without an error)."""
    config = tiny()
    with LocalTensorMode(WORLD):
        with torch.device("meta"):
            model = Glm53ForCausalLM(config)
        parallelize(model, meshes["tp2"])
        model.to_empty(device="cpu")
        init_weights(model)
        for name, param in model.named_parameters():
            assert not param.is_meta, name
            if all(p.is_replicate() for p in param.placements):
                values = per_rank(param.to_local())
                assert all(torch.equal(v, values[0]) for v in values), f"replicas of {name} differ"
        for embedding in per_rank(model.model.embed_tokens.weight):
            assert embedding[config.pad_token_id].abs().max() == 0
            assert embedding.std() > 0


# -------------------------------------------------------------------------------------------- boundaries at their edges
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
