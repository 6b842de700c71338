"""LoRA jobs for the gloo worker pool (parallel_harness.py): one adapter training step on a dp / dp x ep mesh.

The base is frozen; every rank holds the same adapter values (`lora_state`, made in the parent), reads its own
equal slice of the global batch (slice index = global rank), and takes one clipped SGD step on the adapters.
`lora_reference` is the one-process run over the same slices.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

import glm53
from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import clip_grad_norm_, parallelize
from tests.helpers.expert_jobs import build_ep_mesh
from tests.helpers.parallel_jobs import CLIP_NORM, LR, build_mesh, full

RANK, ALPHA = 4, 8


def lora_model(config: dict, state: dict, lora_state: dict) -> Glm53ForCausalLM:
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    glm53.apply_lora(model, RANK, ALPHA)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in lora_state.items():
            params[name].copy_(value)
    return model


def _step(model, pieces, world) -> dict:
    loss = sum(model(ids, labels=ids).loss for ids in pieces) / len(pieces)
    loss.backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    trainable = [p for p in model.parameters() if p.requires_grad]
    norm = clip_grad_norm_(trainable, CLIP_NORM) if world > 1 else torch.nn.utils.clip_grad_norm_(trainable, CLIP_NORM)
    torch.optim.SGD(trainable, lr=LR).step()
    params = {n: full(p) for n, p in model.named_parameters() if "lora_" in n}
    return dict(loss=full(loss).detach(), grads=grads, norm=full(norm), params=params)


def lora_reference(config: dict, state: dict, lora_state: dict, ids: torch.Tensor, world: int) -> dict:
    model = lora_model(config, state, lora_state)
    per = ids.shape[0] // world
    return _step(model, [ids[k * per : (k + 1) * per] for k in range(world)], 1)


def lora_step(config: dict, state: dict, lora_state: dict, ids: torch.Tensor, dp: int, ep: int = 1) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    mesh = build_ep_mesh(dp, ep) if ep > 1 else build_mesh(dp, 1)
    model = lora_model(config, state, lora_state)
    parallelize(model, mesh)
    world, rank = dp * ep, dist.get_rank()
    per = ids.shape[0] // world
    out = _step(model, [ids[rank * per : (rank + 1) * per]], world)
    dist.all_reduce(out["loss"])
    out["loss"] /= world
    frozen_grads = [n for n, p in model.named_parameters() if "lora_" not in n and p.grad is not None]
    placements = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if "experts.gate_up_proj_lora" in n}
    return dict(out, frozen_grads=frozen_grads, placements=placements)


__all__ = ["lora_step", "lora_reference", "lora_model"]
