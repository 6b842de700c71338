"""Training checkpoints written by `glm53 train`: the official-layout model plus `trainer_state.pt`.

`trainer_state.pt` holds the step, the optimizer state, the data and torch RNG states; it is read with
weights_only=True. Under torchrun the run is saved with DCP instead (`save_distributed`: `train_state/`, every rank
writing its own shards) and resumes on any --dp x --tp layout.
"""

from __future__ import annotations

import json
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


def save_run(model: Glm53ForCausalLM, path: str, state: dict, par=None, export: bool = True) -> None:
    """Write the official layout (atomic, via save_pretrained) and trainer_state.pt beside it.

    Under torchrun (`par` is glm53.parallel.runtime) the run is saved with DCP instead (`save_distributed`).
    """
    if par is None:
        model.save_pretrained(path, overwrite=True)
        torch.save(state, os.path.join(path, TRAINER_STATE))
        return
    save_distributed(model, path, state, par, export)


DATA_STATE_BYTES = 4096  # the --data cursor (small JSON) travels through DCP as a fixed-size byte tensor


def _encode_data_state(data: dict) -> torch.Tensor:
    raw = json.dumps(data, sort_keys=True).encode()
    if len(raw) > DATA_STATE_BYTES:
        raise ValueError(f"the --data position takes {len(raw)} bytes, more than {DATA_STATE_BYTES}")
    return torch.tensor(list(raw) + [0] * (DATA_STATE_BYTES - len(raw)), dtype=torch.uint8)


def _decode_data_state(t: torch.Tensor) -> dict | None:
    raw = bytes(t.tolist()).rstrip(b"\0")
    return json.loads(raw) if raw else None


def save_distributed(model: Glm53ForCausalLM, path: str, state: dict, par, export: bool) -> None:
    """Every rank writes its own shards of the model and optimizer (DCP, `train_state/`), the step, the layout
    and its RNG states; with `export` the official layout is written beside them by several ranks, one tensor at a
    time (glm53.parallel.export). One directory, renamed into place when complete."""
    from ..parallel.run_checkpoint import save_run_state

    rank, dp_rank = par.rank(), state["dp_rank"]  # dp_rank: set by the trainer
    # The TP ranks of one dp group hold the same data stream: one key per dp rank (DCP writes it once).
    layout = list(state["layout"]) + [1] * (3 - len(state["layout"]))  # [dp, tp, ep]
    extra = {"step": state["step"], "layout": torch.tensor(layout),
             f"data_rng.dp{dp_rank}": state["rank_rng"]["data_rng"],
             f"torch_rng.rank{rank}": state["rank_rng"]["torch_rng"]}  # fmt: skip
    if state.get("data") is not None:  # the --data cursor, the same on every rank
        extra["data_state"] = _encode_data_state(state["data"])
    save_run_state(model, state["optimizer"], path, extra, export=export)


def resume_distributed(path: str, model: Glm53ForCausalLM, optimizer: torch.optim.Optimizer, par,
                       layout: tuple[int, int], dp_rank: int, generator: torch.Generator
                       ) -> tuple[int, dict | None]:  # fmt: skip
    """Load a DCP run saved on any (dp, tp) layout; -> (its step, its --data cursor or None). This rank's data stream continues the saved one
    of the same dp index (the whole data order is the saved run's when --dp is unchanged) and its torch RNG state
    is restored when the saved run had this rank."""
    from ..parallel.run_checkpoint import load_run_state

    rank = par.rank() if par is not None else 0
    data_key, rng_key = f"data_rng.dp{dp_rank}", f"torch_rng.rank{rank}"
    defaults = {"step": 0, "layout": torch.tensor([0, 0, 0]), data_key: generator.get_state(),
                rng_key: torch.get_rng_state(), "data_state": torch.zeros(DATA_STATE_BYTES, dtype=torch.uint8)}  # fmt: skip
    got = load_run_state(path, model, optimizer, defaults)
    generator.set_state(got[data_key])
    torch.set_rng_state(got[rng_key])
    saved = [int(v) for v in got["layout"]]
    layout = list(layout) + [1] * (3 - len(layout))
    if saved != layout and rank == 0:
        names = ("--dp", "--tp", "--ep")
        print(f"resuming a run saved on {' '.join(f'{n} {v}' for n, v in zip(names, saved))} on "
              f"{' '.join(f'{n} {v}' for n, v in zip(names, layout))}: model and optimizer resharded"
              + ("" if (saved[0], saved[2]) == (layout[0], layout[2]) else "; the data order differs from the "
                 "saved run's (it draws per data rank)"), flush=True)  # fmt: skip
    return int(got["step"]), _decode_data_state(got["data_state"])


def load_trainer_state(path: str) -> dict:
    file = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--resume {path}: no {TRAINER_STATE} (was it saved by `glm53 train`?)")
    return torch.load(file, weights_only=True)


__all__ = ["TRAINER_STATE", "trainer_state", "save_run", "save_distributed", "resume_distributed", "load_trainer_state"]
