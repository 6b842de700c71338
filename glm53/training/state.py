"""Training checkpoints written by `glm53 train`: the official-layout model plus `trainer_state.pt`.

`trainer_state.pt` holds the step, the optimizer state, the data and torch RNG states (and, under torchrun, every
rank's RNG states and the (dp, tp) layout); it is read with weights_only=True.
"""

from __future__ import annotations

import os

import torch

from ..model.model import Glm53ForCausalLM

TRAINER_STATE = "trainer_state.pt"


def trainer_state(step: int, optimizer: torch.optim.Optimizer, generator: torch.Generator, par,
                  layout: tuple[int, int], data: dict | None = None) -> dict:  # fmt: skip
    """Single process: the optimizer's state dict and the RNG states. Distributed: the optimizer itself (save_run
    gathers its full state) and this rank's RNG states (gathered from every rank into `rank_rng`). `data`: the
    --data position (the same on every rank), when training on a file."""
    rng = {"data_rng": generator.get_state(), "torch_rng": torch.get_rng_state()}
    extra = {} if data is None else {"data": data}
    if par is None:
        return {"step": step, "optimizer": optimizer.state_dict(), **rng, **extra}
    return {"step": step, "optimizer": optimizer, "rank_rng": rng, "layout": list(layout), **extra}


def save_run(model: Glm53ForCausalLM, path: str, state: dict, par=None) -> None:
    """Write the official layout (atomic, via save_pretrained) and trainer_state.pt beside it.

    Under torchrun (`par` is glm53.parallel.runtime) every rank gathers the sharded parameters and the optimizer
    state to full tensors; rank 0 writes them with every rank's RNG states, then all ranks wait for it.
    """
    if par is None:
        model.save_pretrained(path, overwrite=True)
        torch.save(state, os.path.join(path, TRAINER_STATE))
        return
    full = par.full_state(model)
    optimizer = par.full_optimizer_state(model, state["optimizer"])
    state = {**state, "optimizer": optimizer, "rank_rng": par.gather_objects(state["rank_rng"])}
    if par.rank() == 0:
        with torch.device("meta"):
            plain = Glm53ForCausalLM(model.config)
        plain.load_state_dict(full, assign=True)
        plain.save_pretrained(path, overwrite=True)
        torch.save(state, os.path.join(path, TRAINER_STATE))
    par.barrier()


def load_trainer_state(path: str) -> dict:
    file = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--resume {path}: no {TRAINER_STATE} (was it saved by `glm53 train`?)")
    return torch.load(file, weights_only=True)


__all__ = ["TRAINER_STATE", "trainer_state", "save_run", "load_trainer_state"]
