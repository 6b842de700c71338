"""The per-document balance loss under context parallelism on real gloo ranks (tests/parallel/test_cp_balance_loss.py).

Legend: B batch, T time (the whole rows; each rank holds T / size of them), E routed experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from glm53.losses import sharded_balance_loss
from glm53.parallel import CpShards


def sharded_balance_job(
    logits: torch.Tensor,
    indices: torch.Tensor,
    valid: torch.Tensor,
    segment_ids: torch.Tensor,
    num_sequences: torch.Tensor | None = None,
    explain: bool = False,
) -> dict:
    """This rank's slice of [B, T, E] logits, [B, T, k] indices, valid and global segment ids through
    `sharded_balance_loss` -> its share, the gradient of its share w.r.t. its logits (the stack's backward adds the
    other ranks' parts) and, with `explain`, torch._dynamo.explain's graph-break count of the same call."""
    size, rank = dist.get_world_size(), dist.get_rank()
    B, T, E = logits.shape
    local = T // size
    mine = slice(rank * local, (rank + 1) * local)
    cp = CpShards(init_device_mesh("cpu", (size,), mesh_dim_names=("cp",)), local)
    x = logits[:, mine].reshape(-1, E).clone().requires_grad_()
    idx = indices[:, mine].reshape(B * local, -1)
    args = (idx, valid[:, mine], num_sequences, segment_ids[:, mine], cp)
    share = sharded_balance_loss(x, *args)
    (grad,) = torch.autograd.grad(share, x)
    out = dict(share=share.detach(), grad=grad.view(B, local, E))
    if explain:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(sharded_balance_loss)(x.detach(), *args)
        out["breaks"] = [str(b.reason) for b in explained.break_reasons]
    return out


__all__ = ["sharded_balance_job"]
