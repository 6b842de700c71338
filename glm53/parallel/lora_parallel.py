"""LoRA adapters (glm53.peft) under tensor parallelism: each adapter's factors placed after its base layer's.

Legend: O out features, I in features, r the adapter rank, tp the TP ranks. An adapted linear computes
W x + s B (A x) with A [r, I], B [O, r]; fused experts hold A [E, r, in], B [E, out, r] (glm53/peft/lora.py).
- Colwise base (W Shard(0), this rank's output rows): B Shard(0) (the same rows), A Replicate. Every rank
  computes A x whole and its rows of B (A x); A's gradient is a partial sum over the ranks' rows (Partial).
- Rowwise base (W Shard(1), this rank's input columns, x Shard(-1)): A Shard(1) (the same columns), B
  Replicate; A x is a partial sum over the ranks, completed with the base's output (the all-reduce on exit).
- Replicated base (ReplicateModule): both factors replicated; every rank computes the same gradients.
- Fused experts split on their inner width (ExpertTensorParallel): gate_up's B rows like gate_up's own rows
  (_StridedShard), its A replicated; down's A columns like down's (Shard(2)), its B replicated. The replicated
  factors' gradients are partial sums over tp (the kernel's output is a partial sum over tp, summed on exit).
Under ep x tp the experts' factors add Shard(0) over ep (expert.py); a tp-replicated factor keeps its Partial tp
gradient there ((Shard(0), Partial()), LocalShard's grad_placements).
Readers that take the weight through `as_local` (the absorbed MLA's kv_b_proj, the expert kernel) get this rank's
shard of each sharded factor and the whole replicated one: with the base's local shard they give this rank's
shard of the effective weight, and the replicated factor's gradient is declared Partial (summed over tp).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from .placements import LocalShard, Whole, set_placement_rule
from .tensor_parallel import ColwiseHeads, ExpertTensorParallel, ReplicateModule, _distribute_own

LORA_MARK = "lora_"  # every adapter parameter's name holds it (glm53.peft)
HELD = "held_kinds"  # a module's {weight name: "fp8" | "bf16"} held base (glm53.peft.fp8.HELD)
_PARTIAL_GRAD = Whole((Partial(),))  # a replicated factor that meets this rank's shard of the other one


def _partition_adapted(style, module: nn.Module, name: str, mesh: DeviceMesh, base, a_place, b_place) -> None:
    """partition_fn of an adapted linear (called for the linear, then each factor): the linear's own parameters
    as `base` {name: placement}, lora_A's weight at `a_place`, lora_B's at `b_place`."""
    src = style.src_data_rank
    if name == "":
        for own, placement in base.items():
            if getattr(module, own, None) is not None:
                _distribute_own(module, mesh, [own], [placement], src)
    elif name in ("lora_A", "lora_B"):
        _distribute_own(module, mesh, ["weight"], [a_place if name == "lora_A" else b_place], src)
    else:
        raise ValueError(f"unexpected submodule {name!r} of an adapted linear under tensor parallelism")


class LoraColwise(ColwiseParallel):
    """ColwiseParallel for a linear with a LoRA adapter: B Shard(0) with the base's rows, A replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _partition_adapted(
            self, module, name, device_mesh, {"weight": Shard(0), "bias": Shard(0)}, Replicate(), Shard(0)
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        set_placement_rule(module.lora_A, "weight", _PARTIAL_GRAD)
        set_placement_rule(module.lora_B, "weight", LocalShard((Shard(0),)))
        return module


class LoraColwiseHeads(LoraColwise, ColwiseHeads):
    """ColwiseHeads (kv_b_proj, read head-locally by the absorbed MLA) with a LoRA adapter placed as LoraColwise."""


class LoraRowwise(RowwiseParallel):
    """RowwiseParallel for a linear with a LoRA adapter: A Shard(1) with the base's columns, B replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _partition_adapted(
            self, module, name, device_mesh, {"weight": Shard(1), "bias": Replicate()}, Shard(1), Replicate()
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        set_placement_rule(module.lora_A, "weight", LocalShard((Shard(1),)))
        set_placement_rule(module.lora_B, "weight", _PARTIAL_GRAD)
        return module


class LoraExpertTensorParallel(ExpertTensorParallel):
    """ExpertTensorParallel for routed experts with LoRA factors (`<param>_lora_A` / `<param>_lora_B`)."""

    ADAPTERS = {
        "gate_up_proj_lora_A": Replicate(),  # [E, r, D]: D is whole on every rank
        "gate_up_proj_lora_B": _StridedShard(1, split_factor=2),  # [E, 2I, r]: this rank's gate and up rows
        "down_proj_lora_A": Shard(2),  # [E, r, I]: this rank's inner columns
        "down_proj_lora_B": Replicate(),  # [E, D, r]
    }

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        for name, placement in self.ADAPTERS.items():
            if name not in module._parameters:
                continue
            _distribute_own(module, device_mesh, [name], [placement], self.src_data_rank)
            rule = _PARTIAL_GRAD if placement.is_replicate() else LocalShard((placement,))
            set_placement_rule(module, name, rule)
        return module


# The base style of an adapted module -> its LoRA version (ReplicateModule replicates the factors as it is).
_LORA_STYLES: dict[type, type] = {
    ColwiseParallel: LoraColwise,
    ColwiseHeads: LoraColwiseHeads,
    RowwiseParallel: LoraRowwise,
    ExpertTensorParallel: LoraExpertTensorParallel,
    ReplicateModule: ReplicateModule,
}


def check_peft(model: nn.Module, has_tp: bool, mp_policy: MixedPrecisionPolicy | None) -> None:
    """What glm53.peft's additions do not take, refused before `parallelize` changes anything: under tensor
    parallelism a base held in FP8 (its block scales are not split with the weight) and adapter dropout (a
    replicated activation would get another mask on every TP rank); under a low-precision FSDP policy FP8 values
    not held as their bits (FSDP would cast them before gathering them, and their scales would no longer apply),
    and a held (bf16 / FP8) base widened to another dtype than the policy's (its matmuls would meet the policy's
    activations)."""
    fp8 = [n for n, m in model.named_modules() if "fp8" in m.__dict__.get(HELD, {}).values()]
    fp8_values = [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
    if has_tp and fp8:
        raise ValueError(
            f"an FP8 base (glm53.peft, base_dtype='fp8') under tensor parallelism is not supported: its block "
            f"scales are not split with the weights ({fp8[0]} and {len(fp8) - 1} more); use base_dtype='bf16' "
            "with tp, or fp8 on dp / dp x ep meshes"
        )
    dropout = [n for n, m in model.named_modules() if getattr(m, "lora_dropout", 0.0) > 0]
    if has_tp and dropout:
        raise ValueError(
            f"LoRA dropout under tensor parallelism is not supported ({dropout[0]} has lora_dropout > 0): a "
            "replicated activation would get a different mask on every TP rank; use dropout 0 with tp"
        )
    low = mp_policy is not None and mp_policy.param_dtype not in (None, torch.float32)
    if low and fp8_values:
        raise ValueError(
            f"an FP8 base (glm53.peft) under a MixedPrecisionPolicy with param_dtype={mp_policy.param_dtype}: "
            f"FSDP would cast its FP8 values ({fp8_values[0]}, ...) before gathering them and lose their block "
            "scales; hold them as their bits first (glm53.peft.fp8.hold_for_policy(model, the policy's dtype), what "
            "glm53 train --bf16 does), or train without the policy"
        )
    wide = [n for n, m in model.named_modules() if m.__dict__.get(HELD)]
    wide = [n for n in wide if low and model.get_submodule(n).held_compute_dtype != mp_policy.param_dtype]
    if wide:
        widened = model.get_submodule(wide[0]).held_compute_dtype
        raise ValueError(
            f"a held base (glm53.peft: bf16 or FP8) widened to {widened} under a MixedPrecisionPolicy with "
            f"param_dtype={mp_policy.param_dtype} ({wide[0]} and {len(wide) - 1} more): every other weight "
            f"computes in {mp_policy.param_dtype} there; hold it with compute_dtype={mp_policy.param_dtype} "
            "(glm53.peft.fp8.hold_for_policy, what glm53 train --bf16 does) or train without the policy"
        )


def widen_vocab_tables(model: nn.Module) -> list[str]:
    """Under tensor parallelism a bf16-held embedding or lm_head (glm53.peft.hold_bf16) goes back to its compute
    dtype (exact: the same values) -> their names: the vocab-parallel embedding reduces its rows after the module's
    forward, and the vocab-parallel loss reads the head's weight shard itself (vocab_loss.py), neither through the
    view that widens a held table."""
    out = []
    for name in ("model.embed_tokens", "lm_head"):
        module = model.get_submodule(name)
        if module.__dict__.get(HELD, {}).get("weight") != "bf16":
            continue
        weight = module.weight.detach().to(module.held_compute_dtype)
        module.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        del module.__dict__[HELD]["weight"]
        out.append(name)
    return out


def _has_adapter(module: nn.Module) -> bool:
    """Whether `module` itself is adapted: LoRA factors of its own (fused experts) or lora_A / lora_B children."""
    return any(LORA_MARK in name for name in module._parameters) or "lora_A" in module._modules


def with_adapters(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` with every adapted module's style replaced by its LoRA version (the same layouts); raises
    ValueError naming the module when its style has none, or when an adapted module has no plan entry."""
    out = dict(plan)
    for name, style in plan.items():
        if not _has_adapter(model.get_submodule(name)):
            continue
        if name == "lm_head":  # the vocab-parallel loss reads the head's weight shard itself (vocab_loss.py)
            raise ValueError(
                "lm_head has a LoRA adapter: under tensor parallelism the vocab-parallel loss reads the head's "
                "weight without it; train lm_head with freeze_base=False instead, or leave tp out"
            )
        lora_type = _LORA_STYLES.get(type(style))
        if lora_type is None:
            raise ValueError(
                f"{name} has a LoRA adapter but its tensor-parallel style {type(style).__name__} has no "
                f"adapter placement (supported: {sorted(t.__name__ for t in _LORA_STYLES)})"
            )
        out[name] = copy.copy(style)
        out[name].__class__ = lora_type
    covered = {n for n in out if _has_adapter(model.get_submodule(n))}
    for name, module in model.named_modules():
        parent, _, last = name.rpartition(".")
        owner = parent if last in ("lora_A", "lora_B") else name
        if (owner != name or any(LORA_MARK in n for n in module._parameters)) and owner not in covered:
            raise ValueError(f"{owner} has a LoRA adapter but no entry in the tensor-parallel plan")
    return out


__all__ = [
    "with_adapters",
    "check_peft",
    "widen_vocab_tables",
    "LoraColwise",
    "LoraRowwise",
    "LoraColwiseHeads",
    "LoraExpertTensorParallel",
]
