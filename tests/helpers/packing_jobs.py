"""Gloo jobs for packed batches (run by the worker pool of parallel_harness.py on every rank).

`packed_step` runs this rank's data-parallel share of a packed batch (rows with `position_ids` restarting at
each document) on a (dp, tp) mesh and returns the loss parts and full gradients; `packed_reference` is the one
process run of the whole batch it is compared with.
"""

from __future__ import annotations

import logging
import warnings

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import loss_parallel_context, parallelize
from tests.helpers.parallel_jobs import build_mesh, full, loss_parts, mean_over_dp


def packed_reference(config: dict, state: dict, ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    out = model(ids, labels=ids, position_ids=position_ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(loss=out.loss.detach(), parts=loss_parts(out), grads=grads)


def packed_step(
    config: dict,
    state: dict,
    ids: torch.Tensor,
    position_ids: torch.Tensor,
    dp: int,
    tp: int,
    checkpointing: bool = False,
) -> dict:
    """Forward/backward of this rank's rows; loss parts averaged over dp ranks (each rank's share holds the same
    document lengths, so that is the global batch's loss), full gradients."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    mesh = build_mesh(dp, tp)
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    parallelize(model, mesh, activation_checkpointing=checkpointing)
    per = ids.shape[0] // dp
    rank_dp = mesh.get_local_rank("dp") if dp > 1 else 0
    rows = slice(rank_dp * per, (rank_dp + 1) * per)
    with loss_parallel_context(model):
        out = model(ids[rows], labels=ids[rows], position_ids=position_ids[rows])
        out.loss.backward()
    loss, parts = mean_over_dp(mesh, dp, full(out.loss), loss_parts(out))
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return dict(loss=loss, parts=parts, grads=grads)
