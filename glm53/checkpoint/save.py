"""Writing a Glm53ForCausalLM in the official layout, atomically (shards.py)."""

from __future__ import annotations

import os

import torch

from ..precision import keeps_fp32
from .layout import named_state, official_items
from .shards import ShardedWriter, atomic_directory, copy_side_files, write_json


def save_checkpoint(model: torch.nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | None = None, overwrite: bool = False) -> str:  # fmt: skip
    """Write `model` to `path` in the official layout (what `Glm53ForCausalLM.save_pretrained` calls).

    config.json is `Glm53Config.to_official_dict()` (model_type glm5_next, nested text_config) with the dtype
    recorded and any `quantization_config` dropped (weights are written dequantised). `dtype` casts floating
    tensors except those transformers keeps in fp32 (glm53.precision.FP32_KEEP); None keeps each tensor's dtype. Shards
    are at most `max_shard_size` ("5GB", "200MB" or bytes), with an index when there is more than one. The
    write is atomic (glm53.checkpoint.shards.atomic_directory): an existing `path` raises unless `overwrite`, which
    replaces the checkpoint but keeps the directory's other files (tokenizer...) as transformers does.
    """
    stored = dtype or model.model.embed_tokens.weight.dtype
    config = model.config.to_official_dict()
    config.pop("quantization_config", None)
    config["text_config"].pop("quantization_config", None)
    config["text_config"].pop("torch_dtype", None)
    config.pop("torch_dtype", None)
    config["text_config"]["dtype"] = config["dtype"] = str(stored).replace("torch.", "")
    with atomic_directory(path, overwrite=overwrite) as tmp:
        writer = ShardedWriter(tmp, max_shard_size)
        for name, tensor in named_state(model):
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(torch.float32 if keeps_fp32(name) else dtype)
            if name == "lm_head.weight":
                writer.add(name, tensor)
            else:
                for key, part in official_items(name[len("model."):], tensor):
                    writer.add(key, part)
        writer.finish()
        write_json(os.path.join(tmp, "config.json"), config)
        if os.path.isdir(path):
            copy_side_files(os.fspath(path), tmp)
    return os.path.abspath(os.fspath(path))
