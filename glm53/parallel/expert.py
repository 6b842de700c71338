"""Expert parallelism: routed experts spread over the "ep" mesh dimension, tokens moved by all-to-all.

Legend: N tokens on this rank, D model width, k experts per token, E routed experts, ep ranks on the ep mesh,
El = E / ep experts per rank, M token-expert pairs arriving on this rank (dropless: every pair is computed).
Mesh (mesh.py): ep is a dimension of ("dp", "cp", "ep", "tp"); non-expert parameters are FSDP-sharded over the
flattened dp x cp x ep ranks and every dp x ep rank reads its own batches. Routed experts are Shard(0) over ep
(rank r holds experts [r El, (r + 1) El)), split on their inner width over tp when there is one (2-D on
("ep", "tp"), `apply_expert_parallel`) and FSDP-sharded over dp x cp on a dimension that splits evenly and that
no other placement splits (`expert_shard_placement`).

Dispatch on each rank (`ExpertParallelDispatch`), for the [N, k] routing choices:
1. sort the N*k pairs by expert; since experts are contiguous per rank this also groups them by destination;
2. exchange the per-expert counts [E] (all_to_all), so each rank knows how many rows arrive from each source
   rank for each of its El experts;
3. send the rows (all_to_all_single_autograd with the per-rank split sizes), run the local grouped kernel
   `moe_experts` with one "choice" per arrived row (its local expert, weight 1);
4. send the results back (the reverse all_to_all), scale them by the routing weights and add them to their tokens.
The gradient reaching a local expert is the sum over the ep ranks' tokens of their own losses; FSDP averages over
dp x cp only (the experts' FSDP mesh), so the local expert parameters' gradient is scaled by 1/ep to make it the
average over all dp x cp x ep ranks, like every other parameter's.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..checkpoint.fp8 import SCALE_SUFFIX
from ..hooks import set_expert_dispatcher
from ..kernels import kernel
from ..model.moe import Experts
from . import comm
from .placements import LocalShard, placement_rule, set_placement_rule

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # [E, 2I, D], [E, D, I]


def expert_param_names(module: nn.Module) -> list[str]:
    """The fused expert parameters of `module` and their LoRA factors when glm53.peft added them
    (`<param>_lora_A` [E, r, in], `<param>_lora_B` [E, out, r]): all shard with their experts on dim 0."""
    names = list(EXPERT_PARAMS)
    names += [f"{p}_lora_{x}" for p in EXPERT_PARAMS for x in "AB" if f"{p}_lora_{x}" in module._parameters]
    return names


# Experts module -> its dispatcher; weak keys: dispatch dies with the model.
_DISPATCH: "weakref.WeakKeyDictionary[nn.Module, ExpertParallelDispatch]" = weakref.WeakKeyDictionary()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _split_sizes(sent_E: torch.Tensor, arriving_E: torch.Tensor, ep: int) -> tuple[list[int], list[int]]:
    """(send, receive) split sizes per rank, read from the device in one transfer: all_to_all_single takes its
    splits as host ints (torch has no device-side split sizes), so this is the layer's one host sync."""
    both = torch.stack([sent_E, arriving_E]).view(2, ep, -1).sum(-1).tolist()  # NOTE: one sync per call
    return both[0], both[1]


class ExpertParallelDispatch:
    """The routed-experts computation of one MoE layer under EP; same signature as the `moe_experts` kernel,
    with gate_up [El, 2I, D] and down [El, D, I] this rank's experts."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    def __call__(
        self,
        x: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        limit: float,
        lora=None,
    ) -> torch.Tensor:
        N, k = indices.shape
        El = gate_up.shape[0]
        expert_of = indices.flatten()  # [N*k]
        order = torch.argsort(expert_of, stable=True)  # pairs grouped by expert, hence by destination rank
        token = order // k
        counts_E = torch.bincount(expert_of, minlength=El * self.ep)  # [E] pairs this rank sends to each expert
        arriving_E = torch.empty_like(counts_E)  # [ep * El]: from source rank s, for local expert e
        comm.all_to_all_single(arriving_E, counts_E, group=self.group)
        send, receive = _split_sizes(counts_E, arriving_E, self.ep)
        rows = all_to_all_single_autograd(x.index_select(0, token), receive, send, self.group)  # [M, D]
        # Rows from each source arrive sorted by local expert: label each with its local expert.
        local_expert = torch.arange(El, device=x.device).repeat(self.ep).repeat_interleave(arriving_E)  # [M]
        scale = 1.0 / self.ep
        # LoRA terms (glm53.peft) shard with their experts: their factors are this rank's experts' too
        local_lora = (
            {}
            if lora is None
            else {
                "lora": tuple(
                    None
                    if lr is None
                    else lr._replace(A=_ScaleGrad.apply(lr.A, scale), B=_ScaleGrad.apply(lr.B, scale))
                    for lr in lora
                )
            }
        )
        y = kernel("moe_experts")(
            rows,
            local_expert[:, None],
            rows.new_ones(rows.shape[0], 1, dtype=weights.dtype),
            _ScaleGrad.apply(gate_up, scale),
            _ScaleGrad.apply(down, scale),
            limit,
            **local_lora,
        )
        back = all_to_all_single_autograd(y, send, receive, self.group)  # [N*k, D] in `order`
        contrib = back * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add(0, token, contrib.to(x.dtype))


def _dispatcher_for(module: nn.Module):
    return _DISPATCH.get(module)


def check_ep_size(model: nn.Module, ep: int) -> None:
    """Raise ValueError naming n_routed_experts when the experts of `model` (a Glm53ForCausalLM or any module
    holding routed-experts modules) do not split evenly over `ep` ranks."""
    for E in sorted({m.gate_up_proj.shape[0] for m in expert_modules(model)}):
        _check_divisible(E, ep)


def _check_divisible(E: int, ep: int) -> None:
    if E % ep != 0:
        raise ValueError(
            f"expert parallelism over {ep} ranks gives each rank n_routed_experts / ep experts, but "
            f"n_routed_experts={E} is not divisible by {ep}"
        )


def expert_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> None:
    """Shard every routed-experts module's parameters Shard(0) over `ep_mesh` and route its forward through
    `ExpertParallelDispatch` (installed as glm53.hooks's expert dispatcher).

    Under tensor parallelism too (`ep_tp_mesh`, the ("ep", "tp") mesh; the TP plan already split the experts on
    their inner width over tp with `ExpertTensorParallel`), each parameter becomes a 2-D DTensor: Shard(0) over
    ep and the TP placement over tp. The dispatch then runs inside this rank's ep group (fixed tp coordinate):
    the tp ranks of a group send the same tokens and compute their slices of the inner width, which
    ExpertTensorParallel's exit hook sums over tp (mesh.py: why ep borrows its ranks from dp)."""
    check_ep_size(model, ep_mesh.size())
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in expert_modules(model):
        for name in expert_param_names(module):
            param = getattr(module, name)
            if isinstance(param.data, DTensor):  # already split over tp: add the ep split of dim 0
                if ep_tp_mesh is None:
                    raise ValueError(
                        f"{name} is already a DTensor ({tuple(param.placements)}); expert parallelism "
                        "over it needs the ('ep', 'tp') mesh (ep_tp_mesh)"
                    )
                local = param.data.to_local()
                El = local.shape[0] // ep
                placements = (Shard(0), *param.placements)
                grads = _tp_grad(placement_rule(module, name), param.placements)
                shard = DTensor.from_local(
                    local[rank * El : (rank + 1) * El].clone(),
                    ep_tp_mesh,
                    placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            else:
                placements, grads = (Shard(0),), None
                shard = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
            set_placement_rule(module, name, LocalShard(placements, grads))
        _shard_block_scales(module, ep_mesh, ep_tp_mesh)
        _DISPATCH[module] = ExpertParallelDispatch(ep_mesh)


def _tp_grad(rule, tp_placements) -> tuple | None:
    """The gradient placements over (ep, tp) of a parameter whose TP rule declares its gradient (a LoRA factor
    replicated over tp with a Partial gradient, lora_parallel.py), else None (the gradient is placed like it)."""
    grads = getattr(rule, "grad_placements", None)
    return None if grads is None or tuple(grads) == tuple(tp_placements) else (Shard(0), *grads)


def _shard_block_scales(module: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None) -> None:
    """An FP8 base's block-scale buffers (glm53.peft: `<param>_scale_inv` [E, blocks, blocks]) Shard(0) over ep
    like their weights, so each rank dequantises its own experts with their own scales (buffers: no gradient)."""
    for name in EXPERT_PARAMS:
        scale = module._buffers.get(name + SCALE_SUFFIX)
        if scale is None:
            continue
        if ep_tp_mesh is not None:
            raise ValueError(
                f"{name}: an FP8 base's block scales cannot follow its weight's inner-width split over tp; "
                "an FP8 base trains on dp / dp x ep meshes"
            )
        shard = distribute_tensor(scale, ep_mesh, [Shard(0)], src_data_rank=None)
        module.register_buffer(name + SCALE_SUFFIX, shard)
        set_placement_rule(module, name + SCALE_SUFFIX, LocalShard((Shard(0),)))


def expert_shard_placement(dp_size: int, ep_sharded: bool):
    """FSDP's `shard_placement_fn` for routed-expert parameters: Shard on the first dimension of the local
    [E or El, *, *] tensor that splits evenly over `dp_size` ranks (FSDP pads uneven dim-0 shards and requires
    other dims to divide evenly). Under EP, dim 0 already carries the ep split, so dims 1 and 2 come first; a
    dimension a DTensor placement already splits (the inner width under tp x ep) comes after those it does not."""

    def placement(param: nn.Parameter):
        shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
        split = {p.dim for p in param.placements if hasattr(p, "dim")} if isinstance(param, DTensor) else set()
        dims = (1, 2, 0) if ep_sharded else (0, 1, 2)
        dims = tuple(d for d in dims if d not in split) + tuple(d for d in dims if d in split)
        for d in dims:
            if shape[d] % dp_size == 0:
                return Shard(d)
        if ep_sharded:
            raise ValueError(
                f"FSDP over {dp_size} dp ranks cannot split a routed-expert parameter of local shape "
                f"{tuple(shape)} evenly on any dimension (n_routed_experts / ep, "
                f"moe_intermediate_size, hidden_size)"
            )
        return Shard(0)

    return placement


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters whose gradients live on different meshes (experts on
    (dp, ep), the rest on the flattened dp x ep mesh): the norm of each mesh's gradients is completed over its
    ranks, then combined. Returns the total norm (a plain tensor, the same on every rank)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0).item()
    for group in groups.values():
        torch._foreach_mul_(group, coef)
    return total


def install() -> None:
    set_expert_dispatcher(_dispatcher_for)


__all__ = [
    "ExpertParallelDispatch",
    "apply_expert_parallel",
    "check_ep_size",
    "expert_shard_placement",
    "expert_param_names",
    "clip_grad_norm_",
    "expert_modules",
]
