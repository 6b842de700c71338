"""What `glm53 train` under torchrun needs for checkpoints, behind one small interface (training code never
imports torch.distributed): the model built on meta and filled, the run saved and resumed with DCP.

A run directory holds the official layout (the export, skippable) plus `train_state/`, the DCP training state
(train_state.py); both are written into one temporary directory renamed into place once (export.py's
`shared_atomic_directory`), so a checkpoint is visible only when complete.
Legend: dp/tp the mesh dimensions; a "run" is a training checkpoint directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ..checkpoint.shards import checkpoint_owns
from ..config import Glm53Config
from ..losses import Glm53ForCausalLM
from .export import shared_atomic_directory, write_config, write_official
from .load import load_pretrained, materialize
from .parallelize import parallelize
from .train_state import read_training_state, write_training_state

DCP_DIR = "train_state"


def device_type(device: str) -> str:
    """ "cuda" (binding this process to torchrun's LOCAL_RANK GPU) when asked and available, else "cpu"."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return "cuda"
    return "cpu"


def bf16_policy() -> MixedPrecisionPolicy:
    """bf16 compute, fp32 gradient reduction; parallelize keeps glm53.precision's fp32 list in fp32 units."""
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def parallel_model(
    config: Glm53Config,
    mesh,
    *,
    init: str | None = None,
    bf16: bool = False,
    activation_checkpointing: bool = False,
    compile: str | None = None,  # noqa: A002
    model_class: type = Glm53ForCausalLM,
) -> Glm53ForCausalLM:
    """Build on meta, parallelize on `mesh`, materialise on its device; fill from the official checkpoint `init`
    (each rank reading its own slices) or leave the values to the caller (a DCP resume fills them). `compile`: the
    torch.compile backend for every block (None: eager). `model_class`: Glm53ForConditionalGeneration for a VL run."""
    with torch.device("meta"):
        model = model_class(config)
    parallelize(
        model,
        mesh,
        mp_policy=bf16_policy() if bf16 else None,
        activation_checkpointing=activation_checkpointing,
        compile=compile is not None,
        compile_backend=compile or "inductor",
    )
    if init is not None:
        return load_pretrained(model, init)
    materialize(model)
    return model


def has_run_state(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DCP_DIR, ".metadata"))


def save_run_state(
    model: Glm53ForCausalLM,
    optimizer: torch.optim.Optimizer,
    path: str,
    extra: dict,
    *,
    export: bool = True,
    adapter: Callable | None = None,
    adapter_files: tuple[str, ...] = (),
) -> None:
    """Write the run to `path` (replacing it, keeping foreign files): the official layout unless `export` is
    False (config.json always), and the DCP training state with `extra`; every rank writes its own part.

    A LoRA run (`adapter`, glm53.peft's writer `adapter(directory, full, write)`, and the names it writes,
    `adapter_files`): every rank gathers each adapter whole with `full` and rank 0 writes the adapter files
    (peft's format, readable on any layout and by peft); no official layout, and the DCP state holds only the
    trainable parameters and their optimizer state (the frozen base is re-read from --init on resume)."""
    owned = {DCP_DIR, *adapter_files}
    with shared_atomic_directory(path, overwrite=True, own=lambda name: name in owned or checkpoint_owns(name)) as tmp:
        if adapter is not None:
            adapter(tmp, full_tensor, dist.get_rank() == 0)
        elif export:
            write_official(model, tmp)
        elif dist.get_rank() == 0:
            write_config(model, tmp)
        write_training_state(os.path.join(tmp, DCP_DIR), model, optimizer, extra, trainable_only=adapter is not None)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly sharded) parameter on every rank (a collective for a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def load_run_state(
    path: str,
    model: Glm53ForCausalLM,
    optimizer: torch.optim.Optimizer,
    extra: dict,
    *,
    trainable_only: bool = False,
) -> dict:
    """Fill `model` and `optimizer` from the run at `path` (any layout); -> `extra` with the saved values.
    `trainable_only`: a LoRA run's state (the parameters that require gradients; the base was loaded already)."""
    return read_training_state(os.path.join(path, DCP_DIR), model, optimizer, extra, trainable_only=trainable_only)


__all__ = [
    "DCP_DIR",
    "device_type",
    "bf16_policy",
    "parallel_model",
    "has_run_state",
    "save_run_state",
    "load_run_state",
]
