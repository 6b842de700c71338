"""Gloo jobs for the vocab-parallel chunked loss (run on every rank by the worker pool of parallel_harness.py).

`kernel_job` runs `vocab_parallel_cross_entropy` on a tp mesh of the whole world; `model_job` runs the model's
losses on tp ranks with small logits blocks, without `loss_parallel_context` and with return_logits=False.
Both return full tensors for the parent to compare with one process.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import glm53.kernels.linear_cross_entropy as lce
import glm53.parallel.vocab_loss as vocab_loss
from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import parallelize
from tests.helpers.parallel_jobs import build_mesh, full, loss_parts


def kernel_job(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, scale: float) -> dict:
    """loss = vocab_parallel_cross_entropy(hidden, targets, W Shard(0) over the world); grads of scale * loss."""
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    w = distribute_tensor(weight.clone(), mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    h = hidden.clone().requires_grad_()
    loss = vocab_loss.vocab_parallel_cross_entropy(h, targets, w, chunk)
    (loss * scale).backward()
    return dict(loss=loss.detach(), hidden=h.grad, weight=w.grad.full_tensor())


def model_job(config: dict, state: dict, inputs: dict, tp: int, budget: int) -> dict:
    """Forward/backward of the model's losses on a tp mesh, logits blocks of `budget` bytes; counts the loss calls."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = build_mesh(1, tp)
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    parallelize(model, mesh)
    calls = []
    original_fn, original_budget = vocab_loss.vocab_parallel_cross_entropy, lce.LOGITS_BUDGET_BYTES

    def counting(hidden, targets, weight, chunk=None):
        calls.append(hidden.shape[0])
        return original_fn(hidden, targets, weight, chunk)

    vocab_loss.vocab_parallel_cross_entropy, lce.LOGITS_BUDGET_BYTES = counting, budget
    try:  # the pool is shared by the whole session: restore the module state whatever happens
        out = model(**inputs, return_logits=False)  # no loss_parallel_context: the model's loss does not need it
        out.loss.backward()
    finally:
        vocab_loss.vocab_parallel_cross_entropy, lce.LOGITS_BUDGET_BYTES = original_fn, original_budget
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return dict(loss=full(out.loss), parts=loss_parts(out), grads=grads, calls=calls, logits=out.logits)
