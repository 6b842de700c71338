"""Jobs for the VL model under context parallelism (gloo worker pool, parallel_harness.py): one forward/backward of
Glm53ForConditionalGeneration parallelized on a ("cp",) or ("dp", "cp") mesh, every cp rank passing the whole rows
of its dp rank (and their pixels) to `context_parallel_inputs`; and the one-process reference on all rows."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

from glm53 import Glm53ForConditionalGeneration
from glm53.errors import InputError
from glm53.parallel import context_parallel_inputs, init_mesh, loss_parallel_context, parallelize
from tests.helpers.parallel_jobs import full, labels_for, loss_parts

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _model(config, state: dict) -> Glm53ForConditionalGeneration:
    model = Glm53ForConditionalGeneration(config)
    model.load_state_dict(state)
    return model


def _vision(batch: dict) -> dict:
    return {k: batch[k] for k in VISION_KEYS if batch.get(k) is not None}


def cp_vl_step(config, state: dict, batches: list[dict], dp: int, cp: int, tp: int = 1) -> dict:
    """This rank's dp batch (`batches[dp rank]`), its cp slice (tp: the tower replicated, the text model
    tensor-parallel): loss and parts (means over dp), every gradient (whole tensors), this slice's logits and the
    rank's (dp, cp) coordinates."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    mesh = init_mesh(dp, tp, cp=cp)
    model = _model(config, state)
    parallelize(model, mesh, activation_checkpointing=True)
    dp_rank = mesh.get_local_rank("dp") if dp > 1 else 0
    batch = batches[dp_rank]
    kwargs = context_parallel_inputs(
        model,
        batch["input_ids"],
        labels=labels_for(batch["input_ids"], batch["attention_mask"]),
        attention_mask=batch["attention_mask"],
        **_vision(batch),
    )
    with loss_parallel_context(model):
        out = model(**kwargs)
        out.loss.backward()
    loss, parts = full(out.loss), loss_parts(out)
    if dp > 1:
        for value in (loss, *parts.values()):
            dist.all_reduce(value, group=mesh.get_group("dp"))
            value /= dp
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return dict(
        loss=loss,
        parts=parts,
        grads=grads,
        logits=full(out.logits),
        at=(dp_rank, mesh.get_local_rank("cp")),
        media={k: kwargs[k] for k in VISION_KEYS if k in kwargs},  # what this rank's tower ran on
    )


def cp_vl_reference(config, state: dict, batches: list[dict]) -> dict:
    """One process on every dp rank's rows at once (the rows in dp order, so their images too)."""
    model = _model(config, state)
    batch = {k: torch.cat([b[k] for b in batches]) for k in ("input_ids", "attention_mask")}
    for k in VISION_KEYS:
        given = [b[k] for b in batches if b.get(k) is not None]
        batch[k] = torch.cat(given) if given else None
    out = model(**batch, labels=labels_for(batch["input_ids"], batch["attention_mask"]))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(loss=out.loss.detach(), parts=loss_parts(out), grads=grads, logits=out.logits.detach())


def cp_vl_error_job(config, state: dict, batch: dict) -> str:
    """The message a bad batch (placeholders that do not match the grids) gives on this cp rank."""
    mesh = init_mesh(1, 1, cp=dist.get_world_size())
    model = _model(config, state)
    parallelize(model, mesh)
    try:  # context_parallel_inputs checks the whole batch (each rank keeps only its slice's images)
        kwargs = context_parallel_inputs(
            model,
            batch["input_ids"],
            labels=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            **_vision(batch),
        )
        model(**kwargs)
    except InputError as e:
        return str(e)
    raise AssertionError("the bad batch ran")


__all__ = ["cp_vl_error_job", "cp_vl_reference", "cp_vl_step"]
