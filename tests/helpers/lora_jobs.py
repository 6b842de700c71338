"""LoRA jobs for the gloo worker pool (parallel_harness.py): one adapter training step on a dp / dp x ep mesh.

The base is frozen; every rank holds the same adapter values (`lora_state`, made in the parent), reads its own
equal slice of the global batch (slice index = global rank), and takes one clipped SGD step on the adapters.
`lora_reference` is the one-process run over the same slices.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import glm53
from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import clip_grad_norm_, parallelize
from glm53.peft import quantize_model
from glm53.peft.fp8_storage import hold_bf16
from tests.helpers.expert_jobs import build_ep_mesh
from tests.helpers.parallel_jobs import CLIP_NORM, LR, build_mesh, full

RANK, ALPHA = 4, 8
FP8_BLOCK = (8, 8)  # several blocks per expert matrix of the tiny config (hidden 32, expert width 16)


def lora_model(config: dict, state: dict, lora_state: dict, fp8: bool = False, bf16: bool = False) -> Glm53ForCausalLM:
    """The adapted model; `fp8`: its text linears and experts quantised to FP8_BLOCK-block FP8 first (a frozen
    FP8 base, fp32 adapters; the quantisation is deterministic, so every rank and the reference hold the same);
    `bf16`: the frozen text linears and experts held in bf16 (glm53.peft.hold_bf16), fp32 adapters."""
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    if fp8:
        quantize_model(model, block=FP8_BLOCK)
    glm53.apply_lora(model, RANK, ALPHA)
    if bf16:
        hold_bf16(model)
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


def lora_reference(
    config: dict, state: dict, lora_state: dict, ids: torch.Tensor, world: int, fp8: bool = False, bf16: bool = False
) -> dict:
    model = lora_model(config, state, lora_state, fp8, bf16)
    per = ids.shape[0] // world
    return _step(model, [ids[k * per : (k + 1) * per] for k in range(world)], 1)


def lora_step(
    config: dict,
    state: dict,
    lora_state: dict,
    ids: torch.Tensor,
    dp: int,
    ep: int = 1,
    tp: int = 1,
    fp8: bool = False,
    bf16: bool = False,
) -> dict:
    """One adapter step on a dp x ep x tp mesh; the tp ranks of a data rank read the same slice."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    if ep > 1 and tp > 1:  # glm53.parallel's order: ("dp", "ep", "tp"), dp kept
        mesh = init_device_mesh("cpu", (dp, ep, tp), mesh_dim_names=("dp", "ep", "tp"))
    else:
        mesh = build_ep_mesh(dp, ep) if ep > 1 else build_mesh(dp, tp)
    model = lora_model(config, state, lora_state, fp8, bf16)
    parallelize(model, mesh)
    world, data_rank = dp * ep * tp, dist.get_rank() // tp  # (dp, tp) meshes: tp is the inner dimension
    per = ids.shape[0] // (dp * ep)
    gathered = _gathered_bytes(model, ids[data_rank * per : (data_rank + 1) * per]) if fp8 or bf16 else None
    out = _step(model, [ids[data_rank * per : (data_rank + 1) * per]], world)
    dist.all_reduce(out["loss"])
    out["loss"] /= world
    frozen_grads = [n for n, p in model.named_parameters() if "lora_" not in n and p.grad is not None]
    placements = {n: _layout(p) for n, p in model.named_parameters() if "lora_" in n}
    scales = {n: _layout(b)[0] for n, b in model.named_buffers() if ".mlp.experts." in n and n.endswith("_scale_inv")}
    fp8 = sorted(n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn)
    bf16 = {n: _layout(p)[0] for n, p in model.named_parameters() if _local(p).dtype == torch.bfloat16}
    return dict(
        out,
        frozen_grads=frozen_grads,
        placements=placements,
        expert_scales=scales,
        fp8_params=fp8,
        bf16_shards=bf16,
        gathered=gathered,
    )


def _gathered_bytes(model, ids: torch.Tensor) -> dict:
    """The bytes FSDP's all-gathers send from this rank in one no-grad forward (every unit gathered once) beside
    this rank's padded shard bytes of every parameter (FP8 values at 1 byte, bf16 at 2) and its FP8 and bf16
    shard elements."""
    sent = []
    keep = dist.all_gather_single

    def record(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size())
        return keep(output, input, *args, **kwargs)

    dist.all_gather_single = record
    try:
        with torch.no_grad():
            model(ids)
    finally:
        dist.all_gather_single = keep
    shard = sum(_padded_numel(p) * p.element_size() for p in model.parameters())
    fp8 = sum(_padded_numel(p) for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    bf16 = sum(_padded_numel(p) for p in model.parameters() if p.dtype == torch.bfloat16)
    return dict(sent=sum(sent), shard=shard, fp8=fp8, bf16=bf16)


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p


def _padded_numel(p) -> int:
    """Elements of this rank's shard as FSDP pads it: every dimension ceil(size / the ranks splitting it)."""
    if not isinstance(p, DTensor):
        return p.numel()
    split = [1] * p.dim()
    for size, placement in zip(p.device_mesh.shape, p.placements):
        if hasattr(placement, "dim"):
            split[placement.dim] *= size
    return math.prod(-(-n // k) for n, k in zip(p.shape, split))


def _layout(p) -> tuple:
    """(this rank's local shape, {mesh dimension: placement}) of a parameter."""
    if not isinstance(p, DTensor):
        return tuple(p.shape), {}
    names = p.device_mesh.mesh_dim_names or ()
    return tuple(p.to_local().shape), {d: repr(pl) for d, pl in zip(names, p.placements)}


def _whole_base(*args, **kwargs):
    raise AssertionError("a rank read the whole base checkpoint")


def cli_train(argv: list[str], inspect: bool = False, build: str = "any", everything: bool = False) -> dict:
    """`python -m glm53 ARGV` on this pool rank as under torchrun (the pool's process group is the run's; the CLI's
    shutdown of it is skipped). `inspect`: build the trainer (its resume included) and return what it loaded,
    without training (`everything`: every parameter, not only the adapters). `build`: "meta" makes reading the
    whole base on a rank (glm53.peft's load_base / from_pretrained) fail; "whole" forces glm53.peft's whole build
    on every rank (the path before meta builds). -> {"rc", "stdout"} (+ `loaded_state` when inspecting)."""
    from glm53 import parallel
    from glm53.__main__ import main
    from glm53.peft import cli as peft_cli
    from glm53.training import trainer

    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(dist.get_rank()))
    out: dict = {}
    keep = parallel.runtime.shutdown, trainer.Trainer.run, peft_cli.load_base, peft_cli.meta_base
    keep_pretrained = Glm53ForCausalLM.__dict__.get("from_pretrained")  # None: inherited
    parallel.runtime.shutdown = lambda: None
    if inspect:
        trainer.Trainer.run = lambda self: out.update(loaded=loaded_state(self, everything)) or 0
    if build == "meta":
        peft_cli.load_base = _whole_base
        Glm53ForCausalLM.from_pretrained = classmethod(_whole_base)
    elif build == "whole":
        peft_cli.meta_base = lambda args, resuming_dcp: None
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            rc = main(argv)
    finally:
        parallel.runtime.shutdown, trainer.Trainer.run, peft_cli.load_base, peft_cli.meta_base = keep
        if keep_pretrained is None:
            vars(Glm53ForCausalLM).get("from_pretrained") and delattr(Glm53ForCausalLM, "from_pretrained")
        else:
            Glm53ForCausalLM.from_pretrained = keep_pretrained
        for k, v in env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return dict(out, rc=rc, stdout=text.getvalue())


def loaded_state(run, everything: bool = False) -> dict:
    """A trainer's step, adapters and AdamW state as full tensors keyed by parameter name (every rank);
    `everything`: also every parameter (`params`), which require gradients (`trainable`) and the checkpoint bytes
    this rank read (`bytes_read`, None when the model was not loaded per rank), the bytes of this rank's local
    shards per dtype (`local_bytes`) and the FP8 block scales (`scales`); FP8 values come as their uint8 bits."""
    optim = {}
    for name, p in run.model.named_parameters():
        if p.requires_grad:
            optim[name] = {k: full(v) if torch.is_tensor(v) else v for k, v in run.optimizer.state[p].items()}
    adapters = {n: full(p) for n, p in run.model.named_parameters() if "lora_" in n}
    out = dict(step=run.start, adapters=adapters, optim=optim)
    if everything:
        reader = getattr(run.model, "checkpoint_reader", None)
        out.update(
            params={n: _full_bits(p) for n, p in run.model.named_parameters()},
            scales={n: full(b) for n, b in run.model.named_buffers() if n.endswith("_scale_inv")},
            trainable=sorted(n for n, p in run.model.named_parameters() if p.requires_grad),
            bytes_read=None if reader is None else reader.bytes_read,
            largest_read=None if reader is None else reader.largest_read,
            local_bytes=_local_bytes(run.model),
        )
    return out


def _full_bits(p) -> torch.Tensor:
    """full(p); an FP8 parameter as its uint8 bits (gathered as bytes: gloo has no float8)."""
    if p.dtype != torch.float8_e4m3fn:
        return full(p)
    bits = _local(p).detach().view(torch.uint8)
    if isinstance(p, DTensor):
        bits = DTensor.from_local(bits, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
    return bits.clone()


def _local_bytes(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in model.parameters():
        t = _local(p)
        key = str(t.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


__all__ = ["lora_step", "lora_reference", "lora_model", "cli_train", "loaded_state"]
