"""Expert-parallel jobs for the gloo worker pool (parallel_harness.py): one training step on a ("dp", "ep") mesh.

Every dp x ep rank reads its own slice of the global batch (slice index = global rank, init_device_mesh's
row-major order), so the single-process reference is `reference_step(..., dp=dp * ep)`.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import clip_grad_norm_, parallelize
from tests.helpers.parallel_jobs import BIAS_RATE, CLIP_NORM, LR, full, labels_for, loss_parts, router_biases


def build_ep_mesh(dp: int, ep: int, one_dim: bool = False):
    if one_dim:
        return init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    return init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))


def ep_step(
    config: dict,
    state: dict,
    ids: torch.Tensor,
    dp: int,
    ep: int,
    checkpointing: bool = False,
    mask: torch.Tensor | None = None,
    one_dim: bool = False,
    bf16: bool = False,
) -> dict:
    """Forward/backward/clip/SGD/bias update on a (dp, ep) mesh; this rank runs slice `rank` of `ids`."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    mesh = build_ep_mesh(dp, ep, one_dim)
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    parallelize(model, mesh, activation_checkpointing=checkpointing, mp_policy=policy)
    world, rank = dp * ep, dist.get_rank()
    per = ids.shape[0] // world
    rows = slice(rank * per, (rank + 1) * per)
    local_ids, local_mask = ids[rows], (None if mask is None else mask[rows])
    out = model(local_ids, attention_mask=local_mask, labels=labels_for(local_ids, local_mask))
    out.loss.backward()
    loss, parts = full(out.loss), loss_parts(out)
    for value in (loss, *parts.values()):
        dist.all_reduce(value)
        value /= world
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    norm = clip_grad_norm_(model.parameters(), CLIP_NORM)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.update_router_bias(BIAS_RATE)
    params = {n: full(p) for n, p in model.named_parameters()}
    placements = {
        n: (tuple(p.placements), tuple(p.to_local().shape))
        for n, p in model.named_parameters()
        if isinstance(p, DTensor) and ".experts." in n
    }
    return dict(
        loss=loss,
        parts=parts,
        grads=grads,
        norm=norm,
        params=params,
        biases=router_biases(model),
        placements=placements,
    )


__all__ = ["ep_step", "build_ep_mesh"]
