"""Jobs for the loss-normalisation tests: one step of data parallelism with gradient accumulation, normalised by
the global batch's loss counts (glm53.parallel.loss_denominators), and the single-process step it must equal.

Legend: B batch (the global batch's rows), T time.
"""

from __future__ import annotations

import warnings

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import loss_denominators, loss_parallel_context, parallelize
from tests.helpers.parallel_jobs import build_mesh, full

PARTS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss")


def single_process(config: dict, state: dict, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> dict:
    """One forward on the whole global batch (per-forward means: the global means) -> its losses and gradients."""
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(parts={n: getattr(out, n).detach() for n in PARTS}, grads=grads)


def accumulated_step(
    config: dict,
    state: dict,
    ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    dp: int,
    tp: int = 1,
    micro: int = 1,
) -> dict:
    """This rank's dp share of the rows in `micro` micro-batches, each normalised by the global counts."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    mesh = build_mesh(dp, tp)
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    parallelize(model, mesh)
    rank = mesh.get_local_rank("dp") if dp > 1 else 0
    per = ids.shape[0] // dp
    rows = torch.arange(rank * per, (rank + 1) * per).chunk(micro)
    counts = [model.loss_counts(labels[r], mask[r]) for r in rows]
    den = loss_denominators(sum(counts[1:], counts[0]), mesh)
    parts = {n: torch.zeros(()) for n in PARTS}
    for r in rows:
        with loss_parallel_context(model):
            out = model(ids[r], attention_mask=mask[r], labels=labels[r], loss_denominators=den)
            out.loss.backward()
        for n in PARTS:
            parts[n] += full(getattr(out, n))
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return dict(parts=parts, grads=grads)
