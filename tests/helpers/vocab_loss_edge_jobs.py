"""Gloo jobs for the vocab-parallel loss's edges (tests/parallel/test_vocab_parallel_loss.py), run on every rank.

Legend: M tokens, D model width, vocab the vocabulary; the tp mesh is the whole world.
`errors_job` returns the messages of the loss's input checks and what the model's lookup answers per placement;
`blocks_job` runs the loss without a chunk and records the rows of every logits block it builds.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import glm53.kernels.linear_cross_entropy as lce
import glm53.parallel.vocab_loss as vocab_loss


def _mesh():
    return init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))


def errors_job(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> dict:
    """-> {case: (exception type name, message)} for each bad input, and the lookup's answer per placement."""
    mesh = _mesh()
    sharded = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None)
    cases = {
        "replicated": (hidden, targets, distribute_tensor(weight, mesh, [Replicate()], src_data_rank=None)),
        "uneven": (hidden, targets, distribute_tensor(weight[:-1], mesh, [Shard(0)], src_data_rank=None)),
        "targets": (hidden, targets[:-1], sharded),
        "hidden3d": (hidden[None], targets, sharded),
    }
    errors = {}
    for name, (h, t, w) in cases.items():
        try:
            vocab_loss.vocab_parallel_cross_entropy(h, t, w, 4)
            errors[name] = None
        except Exception as e:  # the parent checks type and message
            errors[name] = (type(e).__name__, str(e))
    replicated_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    replicated_head.weight = torch.nn.Parameter(cases["replicated"][2])
    sharded_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    sharded_head.weight = torch.nn.Parameter(sharded)
    lookups = {
        "plain": vocab_loss._lookup(torch.nn.Linear(2, 3, bias=False)) is None,
        "replicated": vocab_loss._lookup(replicated_head) is None,
        "sharded": vocab_loss._lookup(sharded_head) is None,
    }
    return dict(errors=errors, lookup_is_none=lookups)


def blocks_job(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, budget: int) -> dict:
    """The loss with the default chunk under a `budget`-byte logits block: the rows of every block built."""
    mesh = _mesh()
    rows: list[int] = []
    original_logits, original_budget = lce._chunk_logits, lce.LOGITS_BUDGET_BYTES

    def spy(h, w):
        rows.append(h.shape[0])
        return original_logits(h, w)

    lce._chunk_logits, lce.LOGITS_BUDGET_BYTES = spy, budget
    try:  # the pool is shared by the whole session: restore the module state whatever happens
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)], src_data_rank=None).requires_grad_()
        h = hidden.clone().requires_grad_()
        loss = vocab_loss.vocab_parallel_cross_entropy(h, targets, w)
        loss.backward()
    finally:
        lce._chunk_logits, lce.LOGITS_BUDGET_BYTES = original_logits, original_budget
    return dict(rows=rows, loss=loss.detach(), hidden=h.grad, weight=w.grad.full_tensor())
