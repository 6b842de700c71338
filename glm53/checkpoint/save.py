"""Writing a Glm53ForCausalLM in the official layout, atomically (atomic.py, shards.py).

Legend: tensors keep their own shapes; only dtypes change here.
"""

from __future__ import annotations

import logging
import os

import torch

from ..errors import CheckpointError
from ..precision import beyond_range, keeps_fp32, range_error, resolve_dtype
from .atomic import atomic_directory
from .layout import named_state, official_config, official_pairs
from .shards import ShardedWriter, checkpoint_owns, write_json

logger = logging.getLogger("glm53.checkpoint")

SAVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def non_finite_tensors(model: torch.nn.Module) -> list[str]:
    """Names of the floating parameters and buffers holding NaN or inf."""
    # NOTE: syncs (one per tensor)
    return [name for name, t in named_state(model) if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def check_savable(
    model: torch.nn.Module, dtype: torch.dtype | str | None, allow_non_finite: bool
) -> torch.dtype | None:
    """-> the resolved save dtype; raise before anything is written for a non-floating dtype (TypeError) or a
    model holding NaN/inf (CheckpointError naming the tensors: the loader would refuse the checkpoint)."""
    dtype = None if dtype is None else resolve_dtype(dtype, "dtype")
    if dtype is not None and dtype not in SAVE_DTYPES:
        # FP8 needs per-block scales (glm53.checkpoint.fp8); a plain cast would write weights nobody can load.
        raise TypeError(f"dtype must be one of {[str(d) for d in SAVE_DTYPES]} to save, got {dtype}")
    if dtype is not None:
        state = named_state(model)
        overflows = {n: p for n, t in state if not keeps_fp32(n) and (p := beyond_range(t, dtype)) is not None}
        if overflows:  # the checkpoint would hold inf, which from_pretrained refuses
            raise CheckpointError(range_error(overflows, dtype, "saving as"))
    if not allow_non_finite and (bad := non_finite_tensors(model)):
        shown = bad if len(bad) <= 10 else [*bad[:10], f"... ({len(bad)} in all)"]
        raise CheckpointError(
            f"refusing to save a model holding NaN or inf in {shown} (pass allow_non_finite=True "
            f"to write it anyway; from_pretrained will refuse to load it)"
        )
    return dtype


def write_checkpoint_files(
    model: torch.nn.Module,
    directory: str,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write config.json and the (sharded) weights of `model` into the existing `directory`.

    `metadata` goes into every shard's safetensors header (the training checkpoint's run tag, state.py).
    """
    stored = dtype or model.model.embed_tokens.weight.dtype
    config = official_config(model)
    config.pop("quantization_config", None)
    config["text_config"].pop("quantization_config", None)
    config["text_config"].pop("torch_dtype", None)
    config.pop("torch_dtype", None)
    config["text_config"]["dtype"] = config["dtype"] = str(stored).replace("torch.", "")
    writer = ShardedWriter(directory, max_shard_size, metadata=metadata)
    for name, tensor in named_state(model):
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(torch.float32 if keeps_fp32(name) else dtype)
        for key, part in official_pairs(name, tensor):
            writer.add(key, part)
    writer.finish()
    write_json(os.path.join(directory, "config.json"), config)


def save_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    allow_non_finite: bool = False,
) -> str:
    """Write `model` to `path` in the official layout (what `Glm53ForCausalLM.save_pretrained` calls).

    config.json is `Glm53Config.to_official_dict()` (model_type glm5_next, nested text_config) with the dtype
    recorded and any `quantization_config` dropped (weights are written dequantised). `dtype` (a floating
    torch.dtype or its name) casts floating tensors except those transformers keeps in fp32
    (glm53.precision.FP32_KEEP); None keeps each tensor's dtype. Shards are at most `max_shard_size` ("5GB",
    "200MB" or bytes), with an index when there is more than one. A model holding NaN or inf is refused unless
    `allow_non_finite`. The write is atomic (atomic.py): an existing `path` raises unless `overwrite`, which
    replaces the checkpoint's own files (config, weights, index, old shards) and keeps every other file of the
    directory; a regular file at `path` is always refused.
    """
    for name, flag in (("overwrite", overwrite), ("allow_non_finite", allow_non_finite)):
        if not isinstance(flag, bool):  # overwrite="no" is truthy: it would replace a checkpoint
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    dtype = check_savable(model, dtype, allow_non_finite)
    if model.mtp is None and (dropped := getattr(model, "mtp_checkpoint_keys", [])):
        logger.warning(
            "not writing the %d MTP tensors the source checkpoint held (the model has "
            "num_nextn_predict_layers=0): %s will have no MTP layer",
            len(dropped),
            path,
        )
    with atomic_directory(path, overwrite=overwrite, own=checkpoint_owns) as tmp:
        write_checkpoint_files(model, tmp, max_shard_size=max_shard_size, dtype=dtype)
    return os.path.abspath(os.fspath(path))
