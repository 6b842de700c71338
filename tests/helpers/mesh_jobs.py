"""Composed-mesh jobs for the gloo worker pool (parallel_harness.py): one training step on any dp x cp x ep x tp
mesh from `glm53.parallel.init_mesh`, and the one-process reference it is compared with.

Rows: every data rank (the dp x ep coordinate, mesh.DATA_DIMS) reads its own block of the global batch; the tp
ranks of a group read the same rows; the cp ranks of a group read the same rows and take their slices through
`context_parallel_inputs`. Every loss part is normalised by the global batch's counts (`loss_denominators`),
so the reference is one process on all rows: losses, gradients, the clipped norm, the parameters after an SGD
step and the router biases after `update_router_bias`.
"""

from __future__ import annotations

import gc
import logging
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import clip_grad_norm_, context_parallel_inputs, init_mesh, loss_denominators, parallelize
from glm53.parallel.mesh import coordinate, present, size_over
from tests.helpers.parallel_jobs import BIAS_RATE, CLIP_NORM, LR, full, labels_for, loss_parts, router_biases

READERS = ("dp", "ep")  # the ranks that read their own rows, spelled here (not glm53's DATA_DIMS) so the test checks it


def _rows(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if x is None else x[rows]


def composed_step(
    config: dict,
    state: dict,
    ids: torch.Tensor,
    dp: int = 1,
    tp: int = 1,
    ep: int = 1,
    cp: int = 1,
    mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    checkpointing: bool = False,
) -> dict:
    """Forward/backward/clip/SGD/bias update on init_mesh(dp, tp, ep=ep, cp=cp); -> full tensors of this rank."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    mesh = init_mesh(dp, tp, ep=ep, cp=cp)
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    parallelize(model, mesh, activation_checkpointing=checkpointing)
    n, d = size_over(mesh, READERS), coordinate(mesh, READERS)
    per = ids.shape[0] // n
    rows = slice(d * per, (d + 1) * per)
    row_ids, row_mask, row_pos = ids[rows], _rows(mask, rows), _rows(position_ids, rows)
    labels = labels_for(row_ids, row_mask)
    den = loss_denominators(model.loss_counts(labels, row_mask, row_pos), mesh)
    if cp > 1:
        kwargs = context_parallel_inputs(
            model, row_ids, labels=labels, attention_mask=row_mask, position_ids=row_pos, loss_denominators=den
        )
    else:
        kwargs = dict(
            input_ids=row_ids, attention_mask=row_mask, labels=labels, position_ids=row_pos, loss_denominators=den
        )
    out = model(**kwargs)
    out.loss.backward()
    loss, parts = full(out.loss), loss_parts(out)
    for value in (loss, *parts.values()):  # (rank sum) / (global count / n): the global mean is their mean
        for name in present(mesh, READERS):
            dist.all_reduce(value, group=mesh[name].get_group())
        value /= n
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    norm = clip_grad_norm_(model.parameters(), CLIP_NORM)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.update_router_bias(BIAS_RATE)
    params = {name: full(p) for name, p in model.named_parameters()}
    placements = {
        name: (tuple(p.placements), tuple(p.to_local().shape), p.device_mesh.mesh_dim_names)
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    result = dict(
        loss=loss,
        parts=parts,
        grads=grads,
        norm=norm,
        params=params,
        biases=router_biases(model),
        placements=placements,
        mesh=(tuple(mesh.mesh_dim_names), tuple(mesh.shape)),
    )
    del model, out
    gc.collect()
    return result


def composed_reference(
    config: dict,
    state: dict,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> dict:
    """One process on the whole batch: the same step as `composed_step`."""
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    out = model(ids, attention_mask=mask, labels=labels_for(ids, mask), position_ids=position_ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.update_router_bias(BIAS_RATE)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(
        loss=out.loss.detach(),
        parts=loss_parts(out),
        grads=grads,
        norm=norm,
        params=params,
        biases=router_biases(model),
    )


__all__ = ["composed_step", "composed_reference"]
