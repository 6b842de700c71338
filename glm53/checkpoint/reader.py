"""Reading official-layout safetensors: which file holds each key, and lazy, validated tensor reads.

Tensors are read with safetensors' `safe_open` (never pickle). FP8 weights (float8_e4m3fn with a
`<name>_scale_inv` companion, fp8.py) are dequantised as they are read, with the checkpoint's
`quantization_config.weight_block_size` (default 128 x 128); the non-finite check sees the dequantised values.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from . import fp8
from .shards import INDEX_FILE, SINGLE_FILE


def checkpoint_files(path: str) -> dict[str, str]:
    """Map every tensor key to the safetensors file holding it (single file or sharded with an index)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(path, v))})
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


class TensorReader:
    """Lazy tensor access over (possibly sharded) safetensors files, one open handle per file."""

    def __init__(self, files: dict[str, str], block_size: tuple[int, int] = fp8.DEFAULT_BLOCK_SIZE) -> None:
        self.files = files
        self.block_size = block_size
        self._handles: dict[str, object] = {}

    def _handle(self, key: str):
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype string ("BF16", "F8_E4M3", ...)."""
        return self._handle(key).get_slice(key).get_dtype()

    def check_fp8(self, key: str) -> str | None:
        """None if `key` is not FP8 or its scale fits, else a message naming the key."""
        if not fp8.is_fp8(self.dtype(key)):
            return None
        scale = key + fp8.SCALE_SUFFIX
        try:
            fp8.check_scale(key, self.shape(key), self.shape(scale) if scale in self.files else None,
                            self.block_size)  # fmt: skip
        except ValueError as e:
            return str(e)
        return None

    def get(self, key: str) -> torch.Tensor:
        """The tensor (FP8 ones dequantised to fp32); NaN or inf (after dequantisation) raises."""
        tensor = self._handle(key).get_tensor(key)
        if tensor.dtype == fp8.FP8_DTYPE:
            scale = key + fp8.SCALE_SUFFIX
            if scale not in self.files:
                raise CheckpointError(f"FP8 tensor {key!r} has no {scale!r} companion")
            tensor = fp8.dequantize(tensor, self._handle(scale).get_tensor(scale), self.block_size)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # NOTE: syncs
            raise CheckpointError(f"tensor {key!r} holds NaN or infinite values")
        return tensor
