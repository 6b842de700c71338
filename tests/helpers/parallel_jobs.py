"""Jobs the gloo worker pool runs on every rank (importable by spawned children; see parallel_harness.py).

Each job builds the model from a config and a checkpoint sent by the parent, parallelizes it on a mesh, runs
the global batch's share of this rank, and returns full tensors so the parent can compare with one process.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.losses import IGNORE_INDEX
from glm53.parallel import loss_parallel_context, parallelize

CLIP_NORM = 1.0  # clip_grad_norm_ bound used by the parity step (binds for the tiny model: a real check)
LR = 0.1  # SGD learning rate of the parity step
BIAS_RATE = 1e-3  # router bias update rate after the step (aux-loss-free balancing)


def build_mesh(dp: int, tp: int):
    if dp > 1 and tp > 1:
        return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    return init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def labels_for(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)


def reference_step(config: dict, state: dict, ids: torch.Tensor, mask: torch.Tensor | None = None, dp: int = 1) -> dict:
    """The single-process run every parallel run is compared with (run by the parent).

    The loss is the mean over the `dp` equal slices of the batch of each slice's mean token loss: what
    data-parallel training with per-rank mean losses optimises (the global token mean when no token is ignored).
    """
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    per = ids.shape[0] // dp
    loss, parts = 0, {}
    for k in range(dp):
        rows = slice(k * per, (k + 1) * per)
        part_mask = None if mask is None else mask[rows]
        out = model(ids[rows], attention_mask=part_mask, labels=labels_for(ids[rows], part_mask))
        loss = loss + out.loss / dp
        for name, value in loss_parts(out).items():
            parts[name] = parts.get(name, 0) + value / dp
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.update_router_bias(BIAS_RATE)  # the expert loads of all dp slices: the global batch's
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(loss=loss.detach(), parts=parts, grads=grads, norm=norm, params=params, biases=router_biases(model))


def loss_parts(out) -> dict[str, torch.Tensor]:
    """Every loss term the model returned (lm, mtp, aux, indexer), as plain detached tensors."""
    names = ("lm_loss", "mtp_loss", "aux_loss", "indexer_loss")
    return {n: full(getattr(out, n)) for n in names if getattr(out, n) is not None}


def router_biases(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def mean_over_dp(mesh, dp: int, loss: torch.Tensor, parts: dict) -> tuple[torch.Tensor, dict]:
    """The loss and its parts averaged over the data-parallel ranks in place (unchanged when dp == 1)."""
    if dp > 1:
        for value in (loss, *parts.values()):
            dist.all_reduce(value, group=mesh.get_group("dp"))
            value /= dp
    return loss, parts


def parallel_step(
    config: dict,
    state: dict,
    ids: torch.Tensor,
    dp: int,
    tp: int,
    bf16: bool = False,
    checkpointing: bool = False,
    mask: torch.Tensor | None = None,
) -> dict:
    """One forward/backward/clip/SGD step on a (dp, tp) mesh; this rank runs its dp share of `ids`."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # 2-D gather notices
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2: module outputs are views
    mesh = build_mesh(dp, tp)
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    parallelize(model, mesh, mp_policy=policy, activation_checkpointing=checkpointing)
    seen_dtypes: dict[str, torch.dtype] = {}
    if bf16:
        watch = {"attn_hc.fn": model.model.layers[0].attn_hc, "q_proj": model.model.layers[0].self_attn.q_proj}

        def record(name, attr):
            return lambda mod, args: seen_dtypes.__setitem__(name, getattr(mod, attr).dtype)

        watch["attn_hc.fn"].register_forward_pre_hook(record("attn_hc.fn", "fn"))
        watch["q_proj"].register_forward_pre_hook(record("q_proj", "weight"))
        model.model.layers[0].self_attn.register_forward_pre_hook(record("A_log", "A_log"))
        model.model.layers[1].mlp.gate.register_forward_pre_hook(record("router bias", "e_score_correction_bias"))
        model.model.layers[1].mlp.gate.register_forward_pre_hook(record("router", "weight"))
    rank_dp = mesh.get_local_rank("dp") if dp > 1 else 0
    per = ids.shape[0] // dp
    rows = slice(rank_dp * per, (rank_dp + 1) * per)
    local_ids, local_mask = ids[rows], (None if mask is None else mask[rows])
    with loss_parallel_context(model):
        out = model(local_ids, attention_mask=local_mask, labels=labels_for(local_ids, local_mask))
        out.loss.backward()
    loss, parts = mean_over_dp(mesh, dp, full(out.loss), loss_parts(out))
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    norm = full(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM))
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.update_router_bias(BIAS_RATE)  # expert loads summed over dp by parallelize's expert_load_reduce
    params = {n: full(p) for n, p in model.named_parameters()}
    # This rank's piece of every parameter with its placements, to check replicas agree across ranks.
    locals_ = {
        n: (tuple(isinstance(pl, Replicate) for pl in p.placements), p.to_local().detach().clone())
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    return dict(
        loss=loss,
        parts=parts,
        grads=grads,
        norm=norm,
        params=params,
        locals=locals_,
        coord=mesh.get_coordinate(),
        dtypes=seen_dtypes,
        biases=router_biases(model),
    )


def meta_init(config: dict, dp: int, tp: int, seed: int = 0) -> dict:
    """Build on meta, parallelize, materialize, glm53.parallel.init_weights; return the full parameters."""
    from glm53.parallel import init_weights

    mesh = build_mesh(dp, tp)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Glm53ForCausalLM(Glm53Config(**config))
    parallelize(model, mesh)
    model.to_empty(device="cpu")
    init_weights(model)
    return {n: full(p) for n, p in model.named_parameters()}
