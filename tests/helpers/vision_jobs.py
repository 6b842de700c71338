"""Jobs for the vision tower's gloo tests (run on every rank of a parallel_harness.WorkerPool): a VL model built on
meta, parallelized (dp2 or tp2) and filled by `load_pretrained`, one forward/backward on this rank's batch.
Under dp2 rank 0's batch holds an image and a video and rank 1's is text only: rank 1 runs the tower on its
zero-weighted dummy image, so FSDP's collectives match and the gradients equal one process's."""

from __future__ import annotations

import torch

from glm53 import Glm53Config, Glm53ForConditionalGeneration
from glm53.parallel import loss_parallel_context, parallelize
from glm53.parallel.load import load_pretrained
from tests.helpers.ckpt_jobs import mean_over_data_ranks
from tests.helpers.parallel_jobs import build_mesh, full


def _loss(model, batch: dict) -> torch.Tensor:
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return model(**batch, labels=labels).loss


def sharded_vl_step(path: str, batches: list[dict], dp: int, tp: int) -> dict:
    mesh = build_mesh(dp, tp)
    with torch.device("meta"):
        model = Glm53ForConditionalGeneration(Glm53Config.from_pretrained(path))
    parallelize(model, mesh)
    load_pretrained(model, path)
    batch = batches[mesh.get_local_rank("dp")] if "dp" in mesh.mesh_dim_names else batches[0]
    with loss_parallel_context(model):
        loss = _loss(model, batch)
        loss.backward()
    loss = mean_over_data_ranks(full(loss.detach()), mesh)
    return dict(
        loss=loss,
        always_run_tower=model.always_run_tower,
        grads={n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None},
        params={n: full(p.detach()) for n, p in model.named_parameters()},
    )


def reference_vl_step(path: str, batches: list[dict]) -> dict:
    """One process: the mean of each batch's loss, its gradients."""
    model = Glm53ForConditionalGeneration.from_pretrained(path)
    loss = sum(_loss(model, b) for b in batches) / len(batches)
    loss.backward()
    return dict(
        loss=loss.detach(),
        grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        params={n: p.detach().clone() for n, p in model.named_parameters()},
    )
