"""The tensor-parallel plan: one ParallelStyle per module FQN (torchtitan's layout; model code stays plain).

Legend: tp the TP mesh size, H heads, K head width, B batch, T time, vocab the vocabulary size.
- Embedding vocab-parallel (RowwiseParallel on nn.Embedding); lm_head colwise: the model's losses read its
  Shard(0) weight through the vocab-parallel chunked loss (vocab_loss.py), and returned logits stay a Shard(-1)
  DTensor (`F.cross_entropy` over them under `loss_parallel()` never gathers [B, T, vocab]).
- MLA: q_a_proj, kv_a_proj_with_mqa and their norms replicated; q_b_proj, kv_b_proj colwise (whole heads:
  `kv_b_proj` rows are ordered (head, k|v), so a contiguous split keeps each head's k and v together);
  sparse attention runs on the local heads; o_proj rowwise.
- Indexer: everything replicated, so top-k is computed identically on every TP rank (and shared layers reuse it).
- KDA: q/k/v/f_b/b/g_b projections colwise; the three convs, dt_bias and A_log sharded on their channel/head
  dimension like the activations (head-local, `LocalShard`); f_a, g_a replicated; o_norm replicated with a
  Partial gradient (it meets head-sharded outputs); o_proj rowwise.
- Dense MLP and the shared expert: gate/up colwise, down rowwise. Router replicated (routing is identical on
  every TP rank). Routed experts split on their intermediate width (`ExpertTensorParallel`); expert parallelism
  (experts spread over an ep mesh with all-to-all dispatch) is expert.py's, on meshes without tp.
- mHC sites and the block norms replicated.
- MTP layers (`mtp.layers.*`): eh_proj, enorm, hnorm, shared_head.norm and the block norms replicated; their
  MLA (own indexer) and MoE as above. They share the embedding and lm_head with the main model.
Every parameter not sharded becomes a Replicate DTensor on the TP mesh (docs/parallel.md: a plain parameter
beside DTensors breaks clip_grad_norm_ and mixed ops). MLA keeps its numerics setting under TP: the absorbed form reads
its local heads' kv_b_proj rows (`ColwiseHeads`) and sums the shared latent's gradient over the ranks
(`glm53.hooks.into_head_parallel`); the per-head form (`set_numerics(mla_absorb=False)`) runs through
ColwiseParallel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..losses import Glm53ForCausalLM
from ..model.moe import MoE
from .placements import LocalShard, Whole, set_placement_rule


def _distribute_own(module: nn.Module, mesh: DeviceMesh, names: Sequence[str], placements, src_data_rank) -> None:
    """Replace `module`'s own parameters `names` by DTensor parameters with `placements`."""
    for name in names:
        param = getattr(module, name)
        data, src = param.data, src_data_rank
        if src is not None and any(isinstance(p, _StridedShard) for p in placements):
            # torch 2.13's distribute_tensor scatters the wrong pieces of a _StridedShard tensor from a source
            # rank (checked under LocalTensorMode); broadcast it whole, then let every rank slice its own piece.
            data = distribute_tensor(data, mesh, [Replicate()] * mesh.ndim, src_data_rank=src).to_local()
            src = None
        dist = distribute_tensor(data, mesh, placements, src_data_rank=src)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class ReplicateParams(ParallelStyle):
    """The module's own parameters become Replicate DTensors; the module hands them to kernels via `as_local`.

    `grad_placements` (e.g. `(Partial(),)`) is declared for modules that meet sharded activations.
    """

    def __init__(self, grad_placements: tuple | None = None) -> None:
        super().__init__()
        self.grad_placements = grad_placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = [name for name, _ in module.named_parameters(recurse=False)]
        _distribute_own(module, device_mesh, names, [Replicate()] * device_mesh.ndim, self.src_data_rank)
        for name in names:
            set_placement_rule(module, name, Whole(self.grad_placements))
        return module

    def __repr__(self) -> str:
        return f"ReplicateParams(grad_placements={self.grad_placements})"


class ReplicateModule(ParallelStyle):
    """A torch module that reads its own parameters (nn.Linear), kept whole: Replicate parameters, its plain
    (replicated) input annotated as a Replicate DTensor, its Replicate output handed back as a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        replicate = [Replicate()] * device_mesh.ndim

        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _distribute_own(
                mod, mesh, [n for n, _ in mod.named_parameters(recurse=False)], replicate, self.src_data_rank
            )

        def prepare_input(_mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, replicate, run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def prepare_output(_mod, output, _mesh):
            return output.to_local(grad_placements=replicate)

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)

    def __repr__(self) -> str:
        return "ReplicateModule()"


class LocalShardParams(ParallelStyle):
    """The module's own parameters sharded like the activations they meet, for head-local kernels:
    `placements` maps a parameter name to its placement on the (1-D) TP mesh."""

    def __init__(self, placements: dict[str, Placement]) -> None:
        super().__init__()
        self.placements = dict(placements)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            _distribute_own(module, device_mesh, [name], [placement], self.src_data_rank)
            set_placement_rule(module, name, LocalShard((placement,)))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.placements})"


class ExpertTensorParallel(LocalShardParams):
    """Routed experts split on their intermediate width I, every rank running every expert on its slice.

    gate_up_proj [E, 2I, D] is packed (gate rows, then up rows): `_StridedShard(1, split_factor=2)` gives each
    rank its gate rows and its up rows, in the order the kernel's `chunk(2)` expects (plain Shard(1) would give
    rank 0 all the gates). down_proj [E, D, I] is Shard(2). The kernel's output is then a partial sum over I,
    all-reduced on exit; the token states and routing weights entering it get Partial gradients (Megatron's f/g).
    """

    def __init__(self) -> None:
        super().__init__({"gate_up_proj": _StridedShard(1, split_factor=2), "down_proj": Shard(2)})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)

        def enter(_mod, inputs):
            return tuple(
                DTensor.from_local(t, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
                if _is_float(t)
                else t
                for t in inputs
            )

        def leave(_mod, _inputs, output):
            partial = DTensor.from_local(output, device_mesh, [Partial()], run_check=False)
            return partial.redistribute(placements=[Replicate()]).to_local(grad_placements=[Replicate()])

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


class ColwiseHeads(ColwiseParallel):
    """ColwiseParallel whose weight a kernel may also read head-locally through `as_local`: the absorbed MLA
    contracts its local heads' kv_b_proj rows with the shared latent outside nn.Linear (rows are ordered
    (head, k|v), so this rank's Shard(0) rows are whole heads)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        set_placement_rule(module, "weight", LocalShard((Shard(0),)))
        return module


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _kda_plan(p: str) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {p: LocalShardParams({"dt_bias": Shard(0), "A_log": Shard(0)})}
    for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "g_b_proj"):
        plan[f"{p}.{name}"] = ColwiseParallel()
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        plan[f"{p}.{name}"] = LocalShardParams({"weight": Shard(0)})
    plan[f"{p}.f_a_proj"] = ReplicateModule()
    plan[f"{p}.g_a_proj"] = ReplicateModule()
    plan[f"{p}.o_norm"] = ReplicateParams(grad_placements=(Partial(),))
    plan[f"{p}.o_proj"] = RowwiseParallel()
    return plan


def _mla_plan(p: str, has_indexer: bool) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        f"{p}.q_a_proj": ReplicateModule(),
        f"{p}.q_a_layernorm": ReplicateParams(),
        f"{p}.q_b_proj": ColwiseParallel(),
        f"{p}.kv_a_proj_with_mqa": ReplicateModule(),
        f"{p}.kv_a_layernorm": ReplicateParams(),
        f"{p}.kv_b_proj": ColwiseHeads(),
        f"{p}.o_proj": RowwiseParallel(),
    }
    if has_indexer:
        plan[f"{p}.indexer"] = ReplicateParams()  # index_kpool_compress_ape / _gate
        for name in ("wq_b", "wk", "weights_proj"):
            plan[f"{p}.indexer.{name}"] = ReplicateModule()
        plan[f"{p}.indexer.k_norm"] = ReplicateParams()
    return plan


def _mlp_plan(p: str) -> dict[str, ParallelStyle]:
    return {f"{p}.gate_proj": ColwiseParallel(), f"{p}.up_proj": ColwiseParallel(), f"{p}.down_proj": RowwiseParallel()}


def tp_plan(model: Glm53ForCausalLM) -> dict[str, ParallelStyle]:
    """The TP plan for `model`, keyed by module FQN (one entry per module that owns parameters)."""
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.norm": ReplicateParams(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i, block in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        for name in ("input_layernorm", "post_attention_layernorm", "attn_hc", "ffn_hc"):
            plan[f"{p}.{name}"] = ReplicateParams()
        if block.is_linear:
            plan.update(_kda_plan(f"{p}.self_attn"))
        else:
            plan.update(_mla_plan(f"{p}.self_attn", block.self_attn.indexer is not None))
        if isinstance(block.mlp, MoE):
            plan.update(_moe_plan(f"{p}.mlp"))
        else:
            plan.update(_mlp_plan(f"{p}.mlp"))
    for i in range(len(model.mtp.layers) if model.mtp is not None else 0):
        plan.update(_mtp_plan(f"mtp.layers.{i}"))
    return plan


def _moe_plan(p: str) -> dict[str, ParallelStyle]:
    return {f"{p}.gate": ReplicateParams(), f"{p}.experts": ExpertTensorParallel(), **_mlp_plan(f"{p}.shared_experts")}


def _mtp_plan(p: str) -> dict[str, ParallelStyle]:
    """An MTP layer: its norms and eh_proj replicated, then an MLA block with its own indexer and an MoE."""
    plan: dict[str, ParallelStyle] = {f"{p}.eh_proj": ReplicateModule()}
    for name in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "shared_head.norm"):
        plan[f"{p}.{name}"] = ReplicateParams()
    plan.update(_mla_plan(f"{p}.self_attn", has_indexer=True))
    plan.update(_moe_plan(f"{p}.mlp"))
    return plan


def check_tp_size(model: Glm53ForCausalLM, tp: int) -> None:
    """Raise ValueError naming the config field when heads or vocab do not split evenly over `tp` ranks."""
    config = model.config
    for field, what in (
        ("num_attention_heads", "MLA heads"),
        ("linear_num_heads", "KDA heads"),
        ("vocab_size", "vocabulary rows"),
        ("moe_intermediate_size", "routed-expert widths"),
    ):
        value = getattr(config, field)
        if value % tp != 0:
            raise ValueError(
                f"tensor parallelism over {tp} ranks splits {what}, but {field}={value} is not divisible by {tp}"
            )
    if config.tie_word_embeddings:
        raise ValueError(
            "tensor parallelism does not support tie_word_embeddings=True yet (the vocab-parallel "
            "embedding and lm_head would become two separate DTensor parameters)"
        )


__all__ = ["tp_plan", "check_tp_size", "ReplicateParams", "ReplicateModule", "LocalShardParams", "ExpertTensorParallel"]
