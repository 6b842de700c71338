"""Training checkpoints written by `glm53 train`: the official-layout model plus `trainer_state.pt`.

`trainer_state.pt` holds the step, the optimizer state, the data and torch RNG states; it is read with
weights_only=True. Under torchrun the run is saved with DCP instead (`save_distributed`: `train_state/`, every rank
writing its own shards) and resumes on any --dp x --tp layout.

One process: the weights and `trainer_state.pt` are one atomic unit. Both are written into the same temporary
directory, which one rename puts in place (glm53/checkpoint/atomic.py; other files of an existing directory,
such as earlier `step-N` checkpoints, are kept). Both carry the same run tag (a random save id and the step: in
every shard's safetensors header and in the trainer state), and resuming refuses weights and a trainer state
that were not written together.
"""

from __future__ import annotations

import json
import os
import uuid

import torch

from ..checkpoint.atomic import atomic_directory
from ..checkpoint.reader import checkpoint_files, open_safetensors
from ..checkpoint.save import check_savable, write_checkpoint_files
from ..checkpoint.shards import checkpoint_owns
from ..errors import CheckpointError
from ..losses import Glm53ForCausalLM
from ..peft import cli as peft_cli
from ..peft import has_lora

TRAINER_STATE = "trainer_state.pt"
RUN_TAG = "glm53_run_tag"  # "<save id>:<step>", in every shard's header and in trainer_state.pt


def trainer_state(
    step: int,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    par,
    layout: tuple[int, int],
    data: dict | None = None,
) -> dict:
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
        save_single(model, path, state)
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
    extra = {
        "step": state["step"],
        "layout": torch.tensor(layout),
        f"data_rng.dp{dp_rank}": state["rank_rng"]["data_rng"],
        f"torch_rng.rank{rank}": state["rank_rng"]["torch_rng"],
    }
    if state.get("data") is not None:  # the --data cursor, the same on every rank
        extra["data_state"] = _encode_data_state(state["data"])
    if has_lora(model):  # the adapter in peft's format + the trainable parameters' DCP state; no base
        adapter, files = peft_cli.adapter_writer(model)
        save_run_state(model, state["optimizer"], path, extra, export=False, adapter=adapter, adapter_files=files)
        return
    save_run_state(model, state["optimizer"], path, extra, export=export)


def resume_distributed(
    path: str,
    model: Glm53ForCausalLM,
    optimizer: torch.optim.Optimizer,
    par,
    layout: tuple[int, int],
    dp_rank: int,
    generator: torch.Generator,
) -> tuple[int, dict | None]:
    """Load a DCP run saved on any (dp, tp) layout; -> (its step, its --data cursor or None). This rank's data stream continues the saved one
    of the same dp index (the whole data order is the saved run's when --dp is unchanged) and its torch RNG state
    is restored when the saved run had this rank."""
    from ..parallel.run_checkpoint import load_run_state

    rank = par.rank() if par is not None else 0
    data_key, rng_key = f"data_rng.dp{dp_rank}", f"torch_rng.rank{rank}"
    defaults = {
        "step": 0,
        "layout": torch.tensor([0, 0, 0]),
        data_key: generator.get_state(),
        rng_key: torch.get_rng_state(),
        "data_state": torch.zeros(DATA_STATE_BYTES, dtype=torch.uint8),
    }
    got = load_run_state(path, model, optimizer, defaults, trainable_only=has_lora(model))
    generator.set_state(got[data_key])
    torch.set_rng_state(got[rng_key])
    saved = [int(v) for v in got["layout"]]
    layout = list(layout) + [1] * (3 - len(layout))
    if saved != layout and rank == 0:
        names = ("--dp", "--tp", "--ep")
        print(
            f"resuming a run saved on {' '.join(f'{n} {v}' for n, v in zip(names, saved))} on "
            f"{' '.join(f'{n} {v}' for n, v in zip(names, layout))}: model and optimizer resharded"
            + (
                ""
                if (saved[0], saved[2]) == (layout[0], layout[2])
                else "; the data order differs from the saved run's (it draws per data rank)"
            ),
            flush=True,
        )
    return int(got["step"]), _decode_data_state(got["data_state"])


DCP_STATE = "train_state"  # a torchrun run's DCP directory (parallel/run_checkpoint.py)


def _owned_by_training_save(name: str) -> bool:
    """A one-process save replaces the weights, trainer_state.pt and a torchrun run's train_state/ (else a later
    resume would find the older DCP state beside the new file and restart from it)."""
    return checkpoint_owns(name) or name in (TRAINER_STATE, DCP_STATE)


def save_single(model: Glm53ForCausalLM, path: str, state: dict) -> None:
    """One process: weights and trainer state written together, put in place by one rename (module docstring)."""
    check_savable(model, None, allow_non_finite=False)  # a NaN model would save into an unloadable checkpoint
    tag = f"{uuid.uuid4().hex}:{int(state['step'])}"
    with atomic_directory(path, overwrite=True, own=_owned_by_training_save) as tmp:
        write_checkpoint_files(model, tmp, metadata={RUN_TAG: tag})
        torch.save({**state, RUN_TAG: tag}, os.path.join(tmp, TRAINER_STATE))


def load_trainer_state(path: str) -> dict:
    """Read DIR/trainer_state.pt and check that it belongs with DIR's weights; bad files raise CheckpointError."""
    file = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--resume {path}: no {TRAINER_STATE} (was it saved by `glm53 train`?)")
    try:
        state = torch.load(file, weights_only=True)
    # torch.load reports a truncated, corrupted or foreign file through many types (zip, pickle, EOF, runtime).
    except Exception as e:
        raise CheckpointError(
            f"{file} cannot be read as a trainer state saved by `glm53 train`: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    if not isinstance(state, dict) or "optimizer" not in state or not _is_step(state.get("step")):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{file} is not a trainer state saved by `glm53 train` (needs 'step' and 'optimizer'; found {found})"
        )
    if "rank_rng" not in state:  # one process: the RNG states the trainer restores
        for key in ("data_rng", "torch_rng"):
            value = state.get(key)
            expected = torch.get_rng_state().shape  # the CPU generator's state (the data generator's too)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.shape != expected:
                found = (
                    f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                )
                raise CheckpointError(f"{file}: {key!r} must be a CPU RNG state (uint8 {tuple(expected)}), got {found}")
    check_run_tag(path, state)
    return state


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_run_tag(path: str, state: dict) -> None:
    """The weights' run tags (every shard) must equal the trainer state's: they were written by one save.

    States and weights without tags on both sides (written before tags, or by the distributed path) pass.
    """
    tags = {}
    for file in sorted(set(checkpoint_files(path).values())):
        with open_safetensors(file) as f:
            tags[os.path.basename(file)] = (f.metadata() or {}).get(RUN_TAG)
    expected = state.get(RUN_TAG)
    if expected is None and not any(tags.values()):
        return
    wrong = {name: tag for name, tag in tags.items() if tag != expected}
    if wrong:
        raise CheckpointError(
            f"{path}: the weights and {TRAINER_STATE} were not written by the same save "
            f"({TRAINER_STATE} has run tag {expected!r}, {wrong}); resuming would mix steps. "
            f"Resume from a complete checkpoint"
        )


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict, path: str) -> None:
    """Load an optimizer state after checking it was made for these parameters (count and shapes)."""
    file = os.path.join(path, TRAINER_STATE)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    try:
        ids = [i for group in saved["param_groups"] for i in group["params"]]
        per_param = saved["state"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{file}: 'optimizer' is not an optimizer state dict (missing {e})") from e
    if len(ids) != len(params):
        raise CheckpointError(
            f"{file}: the optimizer state is for {len(ids)} parameters, the model has "
            f"{len(params)}: a trainer state of another model"
        )
    for index, (i, p) in enumerate(zip(ids, params)):
        for name, value in per_param.get(i, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise CheckpointError(
                    f"{file}: optimizer state {name!r} of parameter {index} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(p.shape)}: a trainer state of "
                    f"another model"
                )
    optimizer.load_state_dict(saved)


__all__ = [
    "TRAINER_STATE",
    "RUN_TAG",
    "trainer_state",
    "save_run",
    "save_single",
    "save_distributed",
    "resume_distributed",
    "load_trainer_state",
    "check_run_tag",
    "restore_optimizer",
]
