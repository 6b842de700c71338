"""`parallelize`: tensor parallelism, then activation checkpointing, then per-block torch.compile (optional), then
FSDP2 (per block, then the root): torchtitan's order.

Legend: dp the data-parallel mesh dimension (FSDP2), tp the tensor-parallel one (`plan.py`), cp the
context-parallel one (every rank one slice of each sequence; FSDP shards over dp x cp).
Under a low-precision `MixedPrecisionPolicy` the parameters the model needs in fp32 (mHC fn/base/scale, the
router, KDA's convs, dt_bias and A_log) live in their own FSDP units with an fp32 policy; the router's
e_score_correction_bias is a buffer, which FSDP never casts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from ..losses import Glm53ForCausalLM
from ..model.compile import compile_blocks
from ..model.context import ForwardContext
from ..model.mla import MultiHeadLatentAttention
from ..model.mtp import MTPLayer
from ..precision import keeps_fp32
from . import comm
from .expert import apply_expert_parallel, expert_modules, expert_param_names, expert_shard_placement
from .lora_parallel import check_peft, widen_vocab_tables, with_adapters
from .mesh import EXPERT_REPLICA_DIMS, REPLICA_DIMS, flat_mesh
from .placements import name_modules
from .pool_mass import sum_selected_pool_mass
from .tensor_parallel import ReplicateModule, ReplicateParams, check_tp_size, tp_plan

_PARALLELIZED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_VOCAB_PARALLEL: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_CP_MESH: "weakref.WeakKeyDictionary[nn.Module, tuple[DeviceMesh, DeviceMesh]]" = weakref.WeakKeyDictionary()


def _check_mesh(
    mesh: DeviceMesh, dp_dim: str, tp_dim: str, ep_dim: str = "ep", cp_dim: str = "cp"
) -> tuple[bool, bool]:
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(
            f"parallelize needs a DeviceMesh with named dimensions ({dp_dim!r} and/or {tp_dim!r}); "
            f"got {mesh} without names (init_device_mesh(..., mesh_dim_names=...))"
        )
    unknown = [n for n in names if n not in (dp_dim, tp_dim, ep_dim, cp_dim)]
    if unknown:
        raise ValueError(
            f"mesh dimensions {unknown} are neither dp_dim={dp_dim!r}, ep_dim={ep_dim!r}, "
            f"cp_dim={cp_dim!r} nor tp_dim={tp_dim!r}; the mesh has {list(names)}"
        )
    return dp_dim in names, tp_dim in names


def apply_tensor_parallel(model: Glm53ForCausalLM, tp_mesh: DeviceMesh) -> None:
    """Apply `tp_plan(model)` (and the tower's `vision_tp_plan`) on `tp_mesh` and check that every parameter
    became a DTensor on it."""
    check_tp_size(model, tp_mesh.size())
    name_modules(model)
    parallelize_module(model, tp_mesh, with_adapters(model, {**tp_plan(model), **vision_tp_plan(model)}))
    missed = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if missed:
        raise RuntimeError(
            f"the TP plan does not cover parameters {missed}; add their modules to glm53.parallel.tp_plan"
        )
    _VOCAB_PARALLEL.add(model)
    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttention):
            module.register_forward_hook(_sum_pool_mass_over_heads(tp_mesh, model), with_kwargs=True)


def _sum_pool_mass_over_heads(tp_mesh: DeviceMesh, model: Glm53ForCausalLM):
    """MLA records the indexer KL target (attention mass summed over heads) from its local heads under TP: a
    partial sum, completed here over the TP ranks so every rank trains its (replicated) indexer on the same
    target as one process. The sparse KL reads only the selected pools: [B, T, J] is summed, not [B, T, P]
    (pool_mass.py)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        ctx = _forward_context(args, kwargs)
        stats = ctx.stats if ctx is not None else None
        if stats is not None and stats.mass_inputs is not None:  # the recomputing KL: reduced per query block
            stats.mass_inputs.reduce = _block_mass_reduce(tp_mesh, model.config.indexer_loss_mode, module, ctx)
            return
        if stats is None or stats.pool_mass is None:
            return
        group = tp_mesh.get_group()
        if model.config.indexer_loss_mode == "sparse":  # no gradient either way: a target
            stats.pool_mass = sum_selected_pool_mass(
                stats.pool_mass, output[1], ctx.valid, module.kpool, ctx.cu_seqlens, comm.in_place_all_reduce(group)
            )
        else:
            comm.all_reduce_(stats.pool_mass, group=group)

    return hook


def _block_mass_reduce(tp_mesh: DeviceMesh, mode: str, module: nn.Module, ctx: ForwardContext):
    """PoolMassInputs.reduce for the recomputing indexer KL (losses/indexer_kl.py): a block of query rows' mass
    [B, Tq, P] from this rank's heads, summed over the TP ranks where the loss reads it: the pools of the block's
    top-k slots [B, Tq, J] when sparse (O(T * J) sent over the whole loss), every pool when dense. It runs in the
    loss's forward and again in its backward recompute, on every TP rank alike (the indexer is replicated)."""
    group = tp_mesh.get_group()
    if mode == "sparse":
        reduce = comm.in_place_all_reduce(group)
        return lambda mass, topk: sum_selected_pool_mass(mass, topk, ctx.valid, module.kpool, ctx.cu_seqlens, reduce)
    return lambda mass, topk: comm.all_reduce_(mass, group=group)


def _forward_context(args: tuple, kwargs: dict) -> ForwardContext | None:
    """The ForwardContext among a module call's arguments (found by type, never by position)."""
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, ForwardContext)), None)


def _fp32_policy(mp_policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        output_dtype=mp_policy.output_dtype,
        cast_forward_inputs=False,
    )


def _needs_fp32_units(mp_policy: MixedPrecisionPolicy | None) -> bool:
    return mp_policy is not None and mp_policy.param_dtype not in (None, torch.float32)


def apply_fsdp(
    model: Glm53ForCausalLM,
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    reshard_after_forward: bool,
    *,
    expert_parallel: bool = False,
    expert_dp_mesh: DeviceMesh | None = None,
) -> None:
    """fully_shard each decoder block (with fp32 sub-units under a low-precision policy), then the root.

    Routed experts are sharded on a dimension that splits evenly over the ranks (`expert_shard_placement`).
    Under expert parallelism (`expert_parallel`, experts already Shard(0) over ep) `dp_mesh` is the flattened
    dp x ep mesh of the other parameters and the experts get their own units over `expert_dp_mesh` (dp), or
    stay outside FSDP when there is no dp dimension (each ep rank's experts are then whole on it).
    """
    policy = mp_policy or MixedPrecisionPolicy()
    shard = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    ignored = _shard_experts(model, dp_mesh, policy, reshard_after_forward, expert_parallel, expert_dp_mesh)
    if ignored is not None:
        shard["ignored_params"] = ignored
    elif not expert_parallel:
        shard["shard_placement_fn"] = _expert_placement_fn(model, dp_mesh.size())
    for block in _vision_blocks(model):
        # the rope's fp32 cos / sin are block inputs: FSDP must not cast them to the low-precision dtype
        fully_shard(block, **shard, mp_policy=dataclasses.replace(policy, cast_forward_inputs=False))
    for block in _blocks(model):
        if isinstance(block, MTPLayer):
            # MultiTokenPrediction calls shared_head.norm after the layer's forward, when the layer's unit is
            # resharded again: its own unit gathers it for that call.
            fully_shard(block.shared_head.norm, **shard, mp_policy=policy)
        if _needs_fp32_units(mp_policy):
            fp32_modules, low_modules = fp32_units(block)
            for low in low_modules:  # low-precision children of an fp32 unit get their own units first
                fully_shard(low, **shard, mp_policy=policy)
            for module in fp32_modules:
                fully_shard(module, **shard, mp_policy=_fp32_policy(policy))
        if _needs_fp32_units(mp_policy):
            # FSDP's own input cast rebuilds dataclass arguments, so the block would fill a copy of the caller's
            # ForwardContext and the losses would never see the stats the block records: cast here instead.
            fully_shard(block, **shard, mp_policy=dataclasses.replace(policy, cast_forward_inputs=False))
            block.register_forward_pre_hook(_cast_float_inputs(policy.param_dtype), with_kwargs=True)
        else:
            fully_shard(block, **shard, mp_policy=policy)
    shard.pop("shard_placement_fn", None)  # the root's own parameters hold no experts
    fully_shard(model, **shard, mp_policy=policy)


def _expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [m.get_parameter(n) for m in expert_modules(model) for n in expert_param_names(m)]


def _expert_placement_fn(model: nn.Module, dp_size: int):
    """shard_placement_fn for a block's unit: routed experts on an evenly splitting dim, the rest FSDP's default."""
    experts = {id(p) for p in _expert_params(model)}
    even = expert_shard_placement(dp_size, ep_sharded=False)
    return lambda p: even(p) if id(p) in experts else None


def _shard_experts(model, dp_mesh, policy, reshard_after_forward, expert_parallel, expert_dp_mesh):
    """Under EP: the experts' own FSDP units over `expert_dp_mesh`; returns the expert parameters FSDP must
    ignore when there is no dp dimension, else None."""
    if not expert_parallel:
        return None
    if expert_dp_mesh is None:
        return set(_expert_params(model))
    place = expert_shard_placement(expert_dp_mesh.size(), ep_sharded=True)
    for module in expert_modules(model):
        fully_shard(
            module,
            mesh=expert_dp_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
            shard_placement_fn=place,
        )
    return None


def fp32_units(block: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The FSDP units that keep `block`'s fp32 keep-list (glm53.precision) in fp32 under a bf16 policy.

    -> (fp32 units, low-precision units nested in them). A module all of whose parameters keep fp32 (an mHC
    site, the router, a conv) is one fp32 unit. A module whose own parameters keep fp32 but whose children do
    not (KDA: dt_bias and A_log beside its projections) becomes an fp32 unit after each of its children that
    is not all-fp32 gets a low-precision unit of its own. Names are relative to `block`; the keep-list matches
    suffixes, so they resolve the same as the model's full names.
    """
    fp32: list[nn.Module] = []
    low: list[nn.Module] = []

    def all_fp32(module: nn.Module, name: str, recurse: bool) -> bool | None:
        names = [f"{name}.{n}" for n, _ in module.named_parameters(recurse=recurse)]
        return all(keeps_fp32(n) for n in names) if names else None

    def visit(module: nn.Module, name: str) -> None:
        if all_fp32(module, name, recurse=True):
            fp32.append(module)
        elif all_fp32(module, name, recurse=False):
            for child_name, child in module.named_children():
                if all_fp32(child, f"{name}.{child_name}", recurse=True) is False:
                    low.append(child)
            fp32.append(module)
        else:
            for child_name, child in module.named_children():
                visit(child, f"{name}.{child_name}")

    for child_name, child in block.named_children():
        visit(child, child_name)
    return fp32, low


def _cast_float_inputs(dtype: torch.dtype):
    """Forward pre-hook: floating tensor arguments cast to `dtype`; everything else (ForwardContext) passed as is."""

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(_module: nn.Module, args: tuple, kwargs: dict):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook


def _blocks(model: Glm53ForCausalLM) -> list[nn.Module]:
    """The decoder blocks, then the MTP layers: the units of activation checkpointing and FSDP."""
    return [*model.model.layers, *(model.mtp.layers if model.mtp is not None else [])]


def _vision_blocks(model: nn.Module) -> list[nn.Module]:
    """The vision tower's blocks (Glm53ForConditionalGeneration), FSDP units and activation-checkpointing units
    of their own; the rest of the tower (patch embed, post norm, projector) belongs to the root unit."""
    visual = getattr(model, "visual", None)
    return list(visual.blocks) if visual is not None else []


def vision_tp_plan(model: nn.Module) -> dict:
    """The tower replicated on every TP rank: its nn.Linear modules as `ReplicateModule`, the modules that read
    their parameters through `as_local` (norms, the patch-embed and downsample convolutions) as `ReplicateParams`.
    Each rank computes the whole tower on the same pixels, so its gradients are identical everywhere."""
    visual = getattr(model, "visual", None)
    if visual is None:
        return {}
    plan = {}
    for name, module in visual.named_modules():
        if not any(True for _ in module.parameters(recurse=False)) or name.rpartition(".")[2] in ("lora_A", "lora_B"):
            continue  # a LoRA factor is replicated with its linear (ReplicateModule covers submodules)
        plan[f"visual.{name}"] = ReplicateModule() if isinstance(module, nn.Linear) else ReplicateParams()
    return plan


def expert_load_sum(mesh: DeviceMesh, dp_dim: str, tp_dim: str, ep_dim: str = "ep", cp_dim: str = "cp"):
    """`model.expert_load_reduce` for `mesh`: the expert loads summed over the data-parallel ranks (dp, and ep,
    whose ranks read their own batches too) and the context-parallel ones (cp: each holds other tokens).

    TP ranks route identically and so count the same loads; they are averaged over the TP dimension too (exact
    for these integer counts), so the biases stay identical on every rank even if routing ever drifted.
    """
    has_dp, has_tp = _check_mesh(mesh, dp_dim, tp_dim, ep_dim, cp_dim)
    data_dims = [d for d in (dp_dim, ep_dim, cp_dim) if d in mesh.mesh_dim_names]

    def reduce(loads: torch.Tensor) -> torch.Tensor:
        loads = loads.clone()
        for dim in data_dims:
            comm.all_reduce_(loads, group=mesh[dim].get_group())
        if has_tp:
            comm.all_reduce_(loads, group=mesh[tp_dim].get_group())
            loads /= mesh[tp_dim].size()
        return loads

    return reduce


def _check_options(
    mesh: DeviceMesh,
    names: tuple[str, str, str, str],
    has_dp: bool,
    has_tp: bool,
    compile: bool,
    activation_checkpointing: bool,
    mp_policy: MixedPrecisionPolicy | None,
) -> None:  # noqa: A002
    """The combinations `parallelize` refuses, each with the reason (before anything is changed)."""
    dp_dim, tp_dim, ep_dim, cp_dim = names
    has_ep = ep_dim in mesh.mesh_dim_names
    has_cp = cp_dim in mesh.mesh_dim_names
    if compile and has_ep:
        raise ValueError(
            f"compile=True with expert parallelism ({ep_dim}={mesh[ep_dim].size()}) is not supported: "
            "the all-to-all dispatch reads its split sizes on the host (a graph break per MoE block)"
        )
    if compile and activation_checkpointing and _needs_fp32_units(mp_policy):
        raise ValueError(
            "compile=True with activation checkpointing needs whole block graphs, but under a "
            "low-precision mp_policy the nested fp32 FSDP units split them (glm53/model/compile.py)"
        )
    if mp_policy is not None and not (has_dp or has_cp or has_ep):
        raise ValueError(
            f"mp_policy is FSDP2's MixedPrecisionPolicy and needs a {dp_dim!r}, {cp_dim!r} or {ep_dim!r} "
            f"mesh dimension (FSDP's ranks); the mesh has {list(mesh.mesh_dim_names)}"
        )


def parallelize(
    model: Glm53ForCausalLM,
    mesh: DeviceMesh,
    *,
    dp_dim: str = "dp",
    tp_dim: str = "tp",
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    ep_dim: str = "ep",
    cp_dim: str = "cp",
    compile: bool = False,  # noqa: A002 (torchtitan's name for the option)
    compile_backend: str = "inductor",
) -> Glm53ForCausalLM:
    """Make `model` train on `mesh`: TP on mesh[tp_dim] if present, then activation checkpointing per block,
        then FSDP2 on mesh[dp_dim] if present (per block, then the root). Returns the model (changed in place).
        MTP layers are blocks like the decoder's. Sets `model.expert_load_reduce` to the sum of the expert loads over
        the data-parallel ranks (`expert_load_sum`), so `update_router_bias` moves every rank's biases alike.
    A vision tower (Glm53ForConditionalGeneration) is replicated over tp (`vision_tp_plan`), FSDP-sharded per vision
    block over the data ranks like the text parameters, and run on every forward once sharded (a zero-weighted
    dummy image on a batch without one: `always_run_tower`), so FSDP's collectives match on every rank.

        With TP the head is vocab-sharded: the model's own losses combine the ranks' softmax statistics
        (vocab_loss.py) and need no context; `out.logits` is a vocab-sharded DTensor, so a loss of your own over it
        goes inside `loss_parallel_context(model)`.

        With an `ep_dim` mesh dimension (expert parallelism, `expert.py`): routed experts Shard(0) over it with
        all-to-all token dispatch, every dp x ep rank reads its own batches, the non-expert parameters are
        FSDP-sharded over the flattened dp x ep ranks and the experts over dp. Clip gradients with
        `glm53.parallel.clip_grad_norm_` (the gradients then live on two meshes). Not combined with tp > 1.

        With a `cp_dim` dimension (context parallelism): parameters are FSDP-sharded over the flattened dp x cp ranks
        (cp alone without dp) and the mesh is recorded for `context_parallel_inputs(model, ...)`, which gives each
        rank its slice of every sequence; expert loads are summed over cp too. Not combined with tp or ep.

        `compile=True` compiles each block's forward with `compile_backend` (glm53.model.compile.compile_blocks) after
        TP and activation checkpointing and before FSDP, so FSDP's all-gathers run eagerly around the compiled block.
        Every block kind (KDA, MLA, MTP) compiles as one graph. Under a low-precision `mp_policy` the
        fp32 units nested in each block (mHC, router, convs) split its graph, so every block compiles with graph
        breaks allowed, and activation checkpointing is refused (a split block recomputes differently).
        Checked on dp, tp and dp x tp meshes; not with expert parallelism (its all-to-all split sizes are read on the host).
    """
    if not isinstance(model, Glm53ForCausalLM):
        raise TypeError(f"parallelize expects a Glm53ForCausalLM, got {type(model).__name__}")
    already = isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters())
    if model in _PARALLELIZED or already:
        raise RuntimeError(
            "parallelize was already applied to this model (or it already holds DTensor parameters); "
            "build a fresh model and call parallelize once"
        )
    has_dp, has_tp = _check_mesh(mesh, dp_dim, tp_dim, ep_dim, cp_dim)
    _check_options(mesh, (dp_dim, tp_dim, ep_dim, cp_dim), has_dp, has_tp, compile, activation_checkpointing, mp_policy)
    has_ep = ep_dim in mesh.mesh_dim_names
    has_cp = cp_dim in mesh.mesh_dim_names
    check_peft(model, has_tp, mp_policy)  # what glm53.peft's adapters and FP8 base do not take
    roles = dict(dp=dp_dim, cp=cp_dim, ep=ep_dim, tp=tp_dim)
    if has_tp:
        widen_vocab_tables(model)
        apply_tensor_parallel(model, mesh[tp_dim])
    if has_ep:
        name_modules(model)
        apply_expert_parallel(model, mesh[ep_dim], mesh[(ep_dim, tp_dim)] if has_tp else None)
    if activation_checkpointing:
        for block in [*_vision_blocks(model), *_blocks(model)]:
            checkpoint(block)
    if compile:
        # fp32 units nested in a block (low-precision policy) run FSDP hooks, which dynamo never traces: the
        # block's graph splits around them
        compile_blocks(model, backend=compile_backend, fullgraph=not _needs_fp32_units(mp_policy))
    replicas = flat_mesh(mesh, [roles[d] for d in REPLICA_DIMS])  # dp x cp x ep: non-expert replicas
    if replicas is not None:
        expert_replicas = flat_mesh(mesh, [roles[d] for d in EXPERT_REPLICA_DIMS]) if has_ep else None
        apply_fsdp(
            model, replicas, mp_policy, reshard_after_forward, expert_parallel=has_ep, expert_dp_mesh=expert_replicas
        )
    if has_cp:
        _CP_MESH[model] = (mesh[cp_dim], mesh)
    model.expert_load_reduce = expert_load_sum(mesh, dp_dim, tp_dim, ep_dim, cp_dim)
    if hasattr(model, "always_run_tower") and (has_dp or has_ep or has_cp):
        model.always_run_tower = True  # FSDP's tower collectives must run on every rank, with or without images
    _PARALLELIZED.add(model)
    return model


def context_parallel_mesh(model: nn.Module, mesh: DeviceMesh | None = None) -> tuple[DeviceMesh, DeviceMesh]:
    """(the cp mesh dimension, the whole mesh) of a model parallelized with a cp dimension, or of `mesh` given
    as a 1-D cp mesh or a mesh with a "cp" dimension."""
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        return (mesh["cp"], mesh) if "cp" in names and len(names) > 1 else (mesh, mesh)
    if model not in _CP_MESH:
        raise ValueError(
            "context_parallel_inputs needs a model parallelized with a cp dimension "
            "(parallelize(model, mesh, cp_dim=...)) or an explicit mesh="
        )
    return _CP_MESH[model]


def zero_rows(weight: torch.Tensor, rows: list[int]) -> None:
    """Zero rows (dim 0) of a parameter in place, sharded or not, without gathering it.

    `weight[row].zero_()` on a DTensor sharded on dim 0 zeroes a gathered copy and leaves the parameter as it
    was, without an error (checked on torch 2.13); here each rank zeroes the rows of its own shard instead.
    """
    with torch.no_grad():
        if not isinstance(weight, DTensor):
            weight[rows] = 0
            return
        # The global row index of every local row: an index vector placed like the weight's dim 0.
        placements = [
            p if isinstance(p, (Shard, _StridedShard)) and p.dim == 0 else Replicate() for p in weight.placements
        ]
        index = torch.arange(weight.shape[0], device=weight.device)
        local_index = distribute_tensor(index, weight.device_mesh, placements, src_data_rank=None).to_local()
        local = weight.to_local()
        local[torch.isin(local_index, torch.tensor(rows, device=weight.device))] = 0


def init_weights(model: Glm53ForCausalLM) -> Glm53ForCausalLM:
    """`model.init_weights()` for a parallelized model (built on the meta device, then `to_empty`).

    Same as the plain call, plus the padding row of a sharded embedding really zeroed (see `zero_rows`).
    """
    with torch.no_grad():
        model.init_weights()
    if model.config.pad_token_id is not None:
        zero_rows(model.model.embed_tokens.weight, [model.config.pad_token_id])
    return model


def loss_parallel_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """`loss_parallel()` when `model`'s lm_head is vocab-sharded by `parallelize`, else a no-op context.

    For cross-entropy computed by the caller over the vocab-sharded `out.logits` (forward and backward inside it);
    the model's own losses (labels=...) do not need it (vocab_loss.py), and entering it around them is harmless.
    """
    return loss_parallel() if model in _VOCAB_PARALLEL else contextlib.nullcontext()


__all__ = [
    "parallelize",
    "apply_tensor_parallel",
    "apply_fsdp",
    "fp32_units",
    "loss_parallel_context",
    "init_weights",
    "zero_rows",
    "expert_load_sum",
    "context_parallel_mesh",
    "vision_tp_plan",
]
