"""Context-parallel jobs for the gloo worker pool (parallel_harness.py): the KDA state-passing op on real ranks,
and one training step of the whole model on a ("cp",) or ("dp", "cp") mesh.

Every cp rank gets its slice of the same whole sequences through `context_parallel_inputs`, every dp rank its own
rows; the loss is normalised by the whole batch's counts, so the reference is one process on all rows.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels.kda.state_passing import kda_sharded
from glm53.model.packing import starts_to_cu_seqlens
from glm53.parallel import CpShards, context_parallel_inputs, init_mesh, parallelize
from tests.helpers.parallel_jobs import BIAS_RATE, full, labels_for, loss_parts, router_biases


def kda_sharded_job(leaves: list[torch.Tensor], cot: torch.Tensor, doc_starts: torch.Tensor | None = None) -> dict:
    """This rank's slice of (q, k, v, g, beta) through `kda_sharded` (initial state S0 = leaves[5] on every rank);
    -> its output slice and the gradients of sum(o * cot) for its slice and for S0 (this rank's share)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))
    T = leaves[0].shape[1]
    local = T // size
    mine = slice(rank * local, (rank + 1) * local)
    xs = [x[:, mine].clone().requires_grad_() for x in leaves[:5]]
    S0 = leaves[5].clone().requires_grad_()
    packed = {}
    if doc_starts is not None:
        starts = doc_starts[:, mine]
        packed = dict(starts=starts, cu_seqlens=starts_to_cu_seqlens(starts))
    o = kda_sharded(*xs, CpShards(mesh, local), initial_state=None if packed else S0, **packed)
    grads = torch.autograd.grad((o * cot[:, mine]).sum(), xs + ([] if packed else [S0]), allow_unused=True)
    return dict(o=o.detach(), grads=[g.detach() for g in grads])


def cp_step(
    config: dict,
    state: dict,
    ids: torch.Tensor,
    dp: int,
    cp: int,
    checkpointing: bool = False,
    mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    bf16: bool = False,
) -> dict:
    """Forward/backward/bias update on a (dp, cp) mesh: this rank's dp block of rows, its cp slice of them.
    Packed documents as `position_ids` [B, T], or (dp 1) as `cu_seqlens` over the flattened batch."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    mesh = init_mesh(dp, 1, cp=cp)  # ("dp", "cp"), or ("cp",) when dp is 1
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    parallelize(model, mesh, activation_checkpointing=checkpointing, mp_policy=policy)
    per = ids.shape[0] // dp
    rank_dp = mesh.get_local_rank("dp") if dp > 1 else 0
    rows = slice(rank_dp * per, (rank_dp + 1) * per)
    row_mask = None if mask is None else mask[rows]
    kwargs = context_parallel_inputs(
        model,
        ids[rows],
        labels=labels_for(ids[rows], row_mask),
        attention_mask=row_mask,
        position_ids=None if position_ids is None else position_ids[rows],
        cu_seqlens=cu_seqlens,
    )
    out = model(**kwargs)
    out.loss.backward()
    loss, parts = full(out.loss), loss_parts(out)
    if dp > 1:
        for value in (loss, *parts.values()):
            dist.all_reduce(value, group=mesh.get_group("dp"))
            value /= dp
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    model.update_router_bias(BIAS_RATE)
    return dict(
        loss=loss,
        parts=parts,
        grads=grads,
        biases=router_biases(model),
        logits=out.logits.detach(),
        offset=kwargs["cp"].offset,
    )


def cp_reference(
    config: dict,
    state: dict,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> dict:
    """One process on the whole batch: losses, gradients, the router biases after one update, logits."""
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    out = model(ids, attention_mask=mask, labels=labels_for(ids, mask), position_ids=position_ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.update_router_bias(BIAS_RATE)
    return dict(
        loss=out.loss.detach(),
        parts=loss_parts(out),
        grads=grads,
        biases=router_biases(model),
        logits=out.logits.detach(),
    )


class OneRank:
    """A SequenceShards of one rank (the whole sequence): the cp code path on one process, for tests."""

    rank, size, offset = 0, 1, 0

    def __init__(self, total: int) -> None:
        self.total = total

    def all_gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        return x[None]

    def from_previous(self, x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
        return torch.zeros_like(x.narrow(dim, 0, width))

    def from_next(self, x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
        return torch.zeros_like(x.narrow(dim, 0, width))

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


__all__ = ["OneRank", "cp_reference", "cp_step", "kda_sharded_job"]


def cp_errors_job(config: dict) -> list[str]:
    """The messages context-parallel setup gives for bad input on a cp2 world (each call must raise ValueError)."""
    from torch.distributed.device_mesh import init_device_mesh as mesh_of

    mesh = init_mesh(1, 1, cp=2)
    plain = Glm53ForCausalLM(Glm53Config(**config))
    ids = torch.randint(1, 100, (2, 12))
    tp_cp = mesh_of("cpu", (2, 1), mesh_dim_names=("tp", "dq"))  # an unknown dimension name
    calls = [
        lambda: context_parallel_inputs(plain, ids),  # never parallelized, no mesh=
        lambda: context_parallel_inputs(plain, ids[0], mesh=mesh),
        lambda: context_parallel_inputs(plain, ids, labels=ids[:, :5], mesh=mesh),
        lambda: context_parallel_inputs(plain, ids[:, :1], mesh=mesh),  # one token for two ranks
        lambda: init_mesh(1, 2, cp=2),  # 4 ranks asked of a world of 2
        lambda: parallelize(Glm53ForCausalLM(Glm53Config(**config)), tp_cp, mp_policy=MixedPrecisionPolicy()),
    ]
    messages = []
    for call in calls:
        try:
            call()
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages
