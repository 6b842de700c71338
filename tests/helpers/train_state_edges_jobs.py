"""Gloo jobs for the DCP training state's edges (tests/parallel/test_train_state_dcp.py), run on every rank.

Legend: dp the data ranks (here the whole world, a plain replicated model); a run directory holds `train_state/`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.training.state import resume_distributed, save_distributed, trainer_state


def rng_round_trip(path: str) -> dict:
    """Every rank saves its own data-generator and torch RNG states, scrambles both, resumes.
    -> {"data": restored data state == saved, "torch": restored torch state == saved, "step": the step}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    par = SimpleNamespace(rank=dist.get_rank)
    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config.tiny())
    optimizer = torch.optim.AdamW(model.parameters())
    generator = torch.Generator().manual_seed(100 + rank)
    torch.manual_seed(200 + rank)  # each rank's own torch RNG stream
    state = trainer_state(3, optimizer, generator, par, (world, 1))
    saved_torch, saved_data = torch.get_rng_state(), generator.get_state()
    save_distributed(model, path, {**state, "dp_rank": rank}, par, export=False)
    torch.manual_seed(999)
    other = torch.Generator().manual_seed(998)
    step, _ = resume_distributed(path, model, optimizer, par, (world, 1), rank, other)
    restored_torch = torch.equal(torch.get_rng_state(), saved_torch)
    return {"data": torch.equal(other.get_state(), saved_data), "torch": restored_torch, "step": step}


__all__ = ["rng_round_trip"]
