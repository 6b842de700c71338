"""Training state (model, optimizer, step, data position, RNG) saved and resumed with DCP, on any layout.

Legend: dp/tp the mesh dimensions of `parallelize`. Every rank writes its own shards (torch.distributed.checkpoint's
FileSystemWriter: one `.distcp` file per rank plus `.metadata`) and nobody gathers a tensor, so a rank holds its
own state plus DCP's staging copy of one item. Loading reshards: a checkpoint saved on dp4 loads on dp2 x tp2 or in
one process. Keys are layout-independent: `model.<fqn>`, `optim.<fqn>.<exp_avg|exp_avg_sq|step>`, the packed
gate/up experts split in two parts (pieces.dcp_views), `optim.param_groups` and `extra.<name>` for the caller's
objects (step, per-rank RNG and data states: a key a rank does not save, such as `extra.rng.rank5`, is simply
absent on load).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .pieces import dcp_views

PARAM_GROUPS = "optim.param_groups"


def _flat(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict, dict | None]:
    """(DCP state dict, model state dict, optimizer state dict); the DCP entries alias the other two."""
    model_sd = get_model_state_dict(model)
    flat: dict[str, object] = {}
    for name, tensor in model_sd.items():
        flat.update(dcp_views(f"model.{name}", tensor))
    optim_sd = None
    if optimizer is not None:
        optim_sd = get_optimizer_state_dict(model, optimizer)  # initialises an empty AdamW state (zero step)
        for fqn, state in optim_sd["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    flat.update(dcp_views(f"optim.{fqn}.{key}", value))
                else:
                    flat[f"optim.{fqn}.{key}"] = value
        flat[PARAM_GROUPS] = optim_sd["param_groups"]
    return flat, model_sd, optim_sd


def _no_dist() -> bool:
    return not dist.is_initialized()


def write_training_state(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                         extra: dict | None = None) -> None:  # fmt: skip
    """Write the state into `directory` (existing, shared by all ranks; call on every rank).

    `extra` maps names to picklable objects or tensors; give per-rank objects per-rank names.
    """
    flat, _, _ = _flat(model, optimizer)
    for name, value in (extra or {}).items():
        flat[f"extra.{name}"] = value
    dcp.save(flat, checkpoint_id=directory, no_dist=_no_dist())


def saved_keys(directory: str) -> set[str]:
    """The keys stored in a DCP training-state directory (read from its metadata)."""
    return set(FileSystemReader(directory).read_metadata().state_dict_metadata)


def read_training_state(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                        extra: dict | None = None) -> dict:  # fmt: skip
    """Load model (and optimizer) state from `directory` into `model` on its current layout (call on every rank).

    `extra` maps names to default objects (a tensor's shape must match the saved one); those present in the
    checkpoint are returned loaded, the others as given. The optimizer's param_groups (lr, betas...) are restored.
    """
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"{directory} holds no DCP training state (no .metadata)")
    stored = saved_keys(directory)
    flat, model_sd, optim_sd = _flat(model, optimizer)
    missing = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor) and k not in stored)
    if missing:
        raise KeyError(f"{directory} lacks training-state keys {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                       f"(saved from a different model or without the optimizer?)")  # fmt: skip
    wanted = {f"extra.{n}": v for n, v in (extra or {}).items() if f"extra.{n}" in stored}
    flat.update(wanted)
    dcp.load(flat, checkpoint_id=directory, no_dist=_no_dist())
    with torch.no_grad():
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=True))
    if optimizer is not None:
        optim_sd["param_groups"] = flat[PARAM_GROUPS]
        _copy_scalars(flat, optim_sd)
        set_optimizer_state_dict(model, optimizer, optim_sd)
    return {**(extra or {}), **{k[len("extra."):]: flat[k] for k in wanted}}


def _copy_scalars(flat: dict, optim_sd: dict) -> None:
    """DCP replaces non-tensor and 0-d entries in `flat` rather than writing into them: copy them back."""
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                state[key] = flat[f"optim.{fqn}.{key}"]


__all__ = ["write_training_state", "read_training_state", "saved_keys"]
