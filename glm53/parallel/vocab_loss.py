"""The vocab-parallel chunked head + cross-entropy: the loss of a vocab-sharded lm_head without [M, vocab] logits.

Legend: M tokens (flattened B*T), D model width, vocab the vocabulary, tp the TP mesh size; one rank holds the
head's rows [first, first + vocab/tp).
Under tensor parallelism `lm_head.weight` is Shard(0) over tp (plan.py) and every rank holds the same hidden
states [M, D]. Each rank walks the tokens in chunks over its own rows (the kernel's `chunk_statistics`), keeping
per token the log-sum-exp of its rows and the target's logit where the target is one of its rows; two
all-reduces over tp combine them (max of the log-sum-exps, then the sum of exp(lse_r - max) and of the target
logits), so the loss is one process's on every rank. Backward needs no statistics from other ranks: each rank forms
softmax - onehot on its rows from the global log-normaliser (`chunk_gradients`), its weight gradient is its shard's,
and the hidden-state gradient, a partial sum over the ranks' rows, is all-reduced.
`glm53.hooks.vocab_parallel_loss` hands this function to the model's loss (`causal_lm_head_loss`) for a
sharded head; `install()` sets that lookup.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..hooks import set_vocab_parallel_loss
from ..kernels import linear_cross_entropy as lce
from .placements import PlacementError


def _all_reduce(x: torch.Tensor, op: str, group) -> torch.Tensor:
    out = funcol.all_reduce(x.contiguous(), op, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, first, chunk, group):
        lse_local, picked, safe, hit = lce.chunk_statistics(hidden, weight, targets, chunk, first)
        top = _all_reduce(lse_local, "max", group)  # [M]
        sums = _all_reduce(torch.stack([(lse_local - top).exp(), picked]), "sum", group)  # [2, M]
        lse = top + sums[0].log()  # over the whole vocabulary
        keep = targets != lce.IGNORE_INDEX
        ctx.save_for_backward(hidden, weight, safe, hit, keep, lse)
        ctx.chunk, ctx.group = chunk, group
        return ((lse - sums[1]) * keep).sum()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, safe, hit, keep, lse = ctx.saved_tensors
        d_hidden, d_weight = lce.chunk_gradients(
            hidden, weight, safe, hit, lse, grad * keep, ctx.chunk, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        if d_hidden is not None:
            d_hidden = _all_reduce(d_hidden, "sum", ctx.group)  # every rank's rows contribute to every token
        return d_hidden, d_weight, None, None, None, None


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, weight: DTensor, chunk: int | None = None
) -> torch.Tensor:
    """Sum over target tokens of -log softmax(hidden W^T)[target] in fp32, W [vocab, D] Shard(0) over a 1-D mesh.

    hidden [M, D] and targets [M] (IGNORE_INDEX contributes nothing) are plain tensors, the same on every rank;
    the result is the same plain scalar on every rank, with hidden's gradient whole and W's gradient Shard(0).
    `chunk` tokens per logits block (default: the kernel's budget over this rank's rows).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy takes hidden [M, D] and targets [M], got "
            f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    mesh = weight.device_mesh
    if tuple(weight.placements) != (Shard(0),):
        raise PlacementError(
            f"the vocab-parallel loss takes the head's weight Shard(0) on a 1-D mesh, got "
            f"placements {tuple(weight.placements)} on {mesh}"
        )
    if weight.shape[0] % mesh.size():
        raise PlacementError(
            f"the vocab-parallel loss needs vocab rows ({weight.shape[0]}) divisible by the mesh size ({mesh.size()})"
        )
    local = weight.to_local(grad_placements=(Shard(0),))  # [vocab/tp, D]
    # This rank's first row as a [1] tensor sliced like the weight (no communication): exact under LocalTensorMode
    # too, where one process plays every rank and a Python int from get_local_rank() would be rank 0's.
    if torch.compiler.is_compiling():  # distribute_tensor does not trace; compiled code runs one rank a process
        first = torch.full((1,), mesh.get_local_rank() * local.shape[0], dtype=torch.long, device=local.device)
    else:
        starts = torch.arange(mesh.size(), device=local.device) * local.shape[0]
        first = distribute_tensor(starts, mesh, [Shard(0)], src_data_rank=None).to_local()
    chunk = chunk or lce.default_chunk(local.shape[0])
    return _VocabParallelCrossEntropy.apply(hidden, local, targets, first, chunk, mesh.get_group())


def _lookup(module: nn.Module):
    """`glm53.hooks.vocab_parallel_loss`: the loss above for a head whose weight is a vocab-sharded DTensor."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, DTensor) or all(p.is_replicate() for p in weight.placements):
        return None
    return functools.partial(vocab_parallel_cross_entropy, weight=weight)


def install() -> None:
    set_vocab_parallel_loss(_lookup)


__all__ = ["vocab_parallel_cross_entropy", "install"]
