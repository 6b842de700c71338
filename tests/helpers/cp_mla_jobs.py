"""Gloo jobs for MLA under context parallelism (run on every rank by the worker pool of parallel_harness.py).

`run_pair` runs a full-indexer MLA layer and a shared layer reusing its top-k on one slice of the sequence
(`cp` a CpShards) or on all of it (`cp` None), with every indexer-loss tensor recorded, and back-propagates a
fixed random functional of the outputs and index scores: sum(out1 * g1) + sum(out2 * g2) + sum(scores * h).
The one-process run equals the concatenation of the ranks' rows, and its gradients the sum of theirs.

Legend (glm53/model/__init__.py): B batch, T time, D model width, P k-pools.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from glm53 import Glm53Config
from glm53.losses import recomputed_indexer_kl
from glm53.model.block import run_block
from glm53.model.context import ForwardContext
from glm53.model.key_sequence import segment_boundaries
from glm53.model.mla import MultiHeadLatentAttention
from glm53.parallel.cp_shards import CpShards

KL_ROWS = 7.0  # the recomputing KL's row count (a global denominator, as the trainer passes)


def build_pair(
    config: dict, state: dict, absorb: bool, recompute: bool = False
) -> tuple[MultiHeadLatentAttention, MultiHeadLatentAttention]:
    """Layers 0 (full indexer) and 1 (shared) of `config`, in float64, with `state` ({"full": .., "shared": ..});
    `recompute`: the recomputing indexer KL's O(T) record instead of the stored [B, T, P] one."""
    cfg = Glm53Config(**config)
    layers = []
    for idx, name in enumerate(("full", "shared")):
        layer = MultiHeadLatentAttention(cfg, idx).double()
        layer.load_state_dict(state[name])
        layer.absorb = absorb
        layer.kl_recompute = recompute  # stored (default): the [B, T, P] tensors the test compares
        layers.append(layer)
    return layers[0], layers[1]


def run_pair(
    full, shared, inputs: dict, cp=None, record: bool = True, checkpointing: bool = False, kl_mode: str | None = None
) -> dict:
    """Forward + backward of the pair on this rank's rows (all rows when `cp` is None) -> outputs, the recorded
    indexer-loss tensors (with `record`; else the no-grad indexer path runs), gradients of the inputs and of every
    parameter (this rank's share of the sum). `checkpointing`: each layer recomputed in backward (run_block), its
    collectives included. `kl_mode` (layers built with `recompute`): the functional adds the recomputing indexer
    KL of this rank's rows over a fixed row count KL_ROWS (so the ranks' terms sum to the one-process term),
    returned as "kl", instead of the scores term."""
    T = inputs["valid"].shape[1]
    rows = slice(0, T) if cp is None else slice(cp.offset, cp.offset + T // cp.size)
    local = {k: None if v is None else v[:, rows] for k, v in inputs.items()}
    x1 = local["x1"].clone().requires_grad_()
    x2 = local["x2"].clone().requires_grad_()
    segment_ids = local["segment_ids"]
    cu = None if segment_ids is None else segment_boundaries(segment_ids)  # as the model builds it (rank-local)
    ctx = ForwardContext(
        valid=local["valid"], collect_stats=record, record_indexer=record, cu_seqlens=cu, segment_ids=segment_ids, cp=cp
    )
    (out1, topk1), s1 = run_block(checkpointing, full, (x1,), ctx)
    ctx2 = dataclasses.replace(ctx, shared_topk=topk1)
    (out2, topk2), s2 = run_block(checkpointing, shared, (x2,), ctx2)
    loss = (out1 * local["g1"]).sum() + (out2 * local["g2"]).sum()
    recorded = {}
    if kl_mode is not None:
        kl = recomputed_indexer_kl(
            s1.indexer_inputs, [s1.mass_inputs, s2.mass_inputs], local["valid"], kl_mode, torch.tensor(KL_ROWS)
        )
        loss = loss + kl
        recorded = dict(kl=kl.detach())
    elif record:
        loss = loss + (s1.index_scores * local["h"][..., : s1.index_scores.shape[-1]]).sum()
        recorded = dict(
            index_scores=s1.index_scores.detach(),
            candidate=s1.candidate,
            selected=s1.selected,
            pool_mass1=s1.pool_mass,
            pool_mass2=s2.pool_mass,
        )
    loss.backward()
    params = {f"full.{n}": p for n, p in full.named_parameters()} | {
        f"shared.{n}": p for n, p in shared.named_parameters()
    }
    return dict(
        out1=out1.detach(),
        out2=out2.detach(),
        topk1=topk1,
        topk2=topk2,
        x1_grad=x1.grad,
        x2_grad=x2.grad,
        grads={n: p.grad.clone() for n, p in params.items() if p.grad is not None},
        **recorded,
    )


def cp_pair_job(
    config: dict,
    state: dict,
    inputs: dict,
    absorb: bool,
    record: bool = True,
    checkpointing: bool = False,
    kl_mode: str | None = None,
) -> dict:
    """`run_pair` on this rank's slice over a 1-D "cp" mesh of the whole world (`kl_mode`: the recomputing KL)."""
    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))
    full, shared = build_pair(config, state, absorb, recompute=kl_mode is not None)
    T = inputs["valid"].shape[1]
    return run_pair(full, shared, inputs, CpShards(mesh, T // size), record, checkpointing, kl_mode)


__all__ = ["build_pair", "cp_pair_job", "run_pair"]
