"""Reading official-layout safetensors: which file holds each key, and lazy, validated tensor reads.

Tensors are read with safetensors' `safe_open` (never pickle). FP8 weights (float8_e4m3fn with a
`<name>_scale_inv` companion, fp8.py) are dequantised as they are read, with the checkpoint's
`quantization_config.weight_block_size` (default 128 x 128); the non-finite check sees the dequantised values.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from . import fp8
from .paths import confined
from .shards import INDEX_FILE, SINGLE_FILE

# safetensors dtype strings of floating tensors (FP8 counts: it is dequantised with a floating scale).
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})


# What reading a safetensors file can raise: its own error type (bad header, missing key, truncation), OS errors
# (permissions, I/O) and bad UTF-8 in the header. All become CheckpointError naming the file (and key).
READ_ERRORS = (SafetensorError, OSError, UnicodeDecodeError, ValueError, RuntimeError)


def check_readable(file: str) -> None:
    """A shard this process may not read: say so (safetensors reports such a file as missing)."""
    if os.path.exists(file) and not os.access(file, os.R_OK):
        mode = oct(os.stat(file).st_mode & 0o777)
        raise CheckpointError(f"{file} cannot be read: permission denied (mode {mode})")


def open_safetensors(file: str):
    """`safe_open(file)`; a file that cannot be opened raises CheckpointError naming it, the cause chained."""
    check_readable(file)
    try:
        return safe_open(file, framework="pt")
    except READ_ERRORS as e:
        raise CheckpointError(f"{file} cannot be read as safetensors: {reason(e)}") from e


def reason(e: BaseException) -> str:
    return f"{e.strerror} (errno {e.errno})" if isinstance(e, OSError) and e.strerror else str(e)


def _weight_map(index: str) -> dict:
    repeated: list[str] = []

    def unique(pairs: list[tuple[str, object]]) -> dict:
        # json keeps the last of two equal keys: which shard a tensor is read from must not hinge on that.
        out: dict = {}
        for key, value in pairs:
            if key in out:
                repeated.append(key)
            out[key] = value
        return out

    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f, object_pairs_hook=unique)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index} cannot be read as JSON: {reason(e)}") from e
    if repeated:
        shown = ", ".join(repr(k) for k in sorted(set(repeated)))
        raise CheckpointError(f"{index} names {shown} more than once; each key may map to one file")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no 'weight_map' object")
    return weight_map


def checkpoint_files(path: str) -> dict[str, str]:
    """Map every tensor key to the safetensors file holding it (single file or sharded with an index).

    Every file must resolve inside `path` (paths.py); an entry naming anything else raises CheckpointError.
    """
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index) and os.path.lexists(os.path.join(path, SINGLE_FILE)):
        # Either could be stale (a copy over another checkpoint): reading one silently would pick at random.
        raise CheckpointError(
            f"{path} holds both {SINGLE_FILE} and {INDEX_FILE}: which weights are meant is "
            f"ambiguous; remove the stale one"
        )
    if os.path.isfile(index):
        confined(path, INDEX_FILE, path)
        weight_map = _weight_map(index)
        files = {key: confined(path, name, f"{index} (weight_map[{key!r}])") for key, name in weight_map.items()}
        missing = sorted({os.path.relpath(f, path) for f in files.values() if not os.path.isfile(f)})
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        confined(path, SINGLE_FILE, path)
        with open_safetensors(single) as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


class TensorReader:
    """Lazy tensor access over (possibly sharded) safetensors files, one open handle per file.

    Every read error is a CheckpointError naming the file and the key, with the cause chained.
    """

    def __init__(self, files: dict[str, str], block_size: tuple[int, int] = fp8.DEFAULT_BLOCK_SIZE) -> None:
        self.files = files
        self.block_size = block_size
        self._handles: dict[str, object] = {}

    def _handle(self, key: str):
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = open_safetensors(file)
        return self._handles[file]

    def _slice(self, key: str):
        handle = self._handle(key)
        try:
            return handle.get_slice(key)
        except READ_ERRORS as e:
            raise CheckpointError(f"{self.files[key]}: cannot read tensor {key!r}: {reason(e)}") from e

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype string ("BF16", "F8_E4M3", ...)."""
        return self._slice(key).get_dtype()

    def check_fp8(self, key: str) -> str | None:
        """None if `key` is not FP8 or its scale fits, else a message naming the key."""
        if not fp8.is_fp8(self.dtype(key)):
            return None
        scale = key + fp8.SCALE_SUFFIX
        if scale in self.files and self.dtype(scale) not in FLOAT_DTYPES:
            return f"FP8 scale {scale!r} is {self.dtype(scale)}; a scale must be floating ({sorted(FLOAT_DTYPES)})"
        try:
            fp8.check_scale(key, self.shape(key), self.shape(scale) if scale in self.files else None, self.block_size)
        except ValueError as e:
            return str(e)
        return None

    def _tensor(self, key: str) -> torch.Tensor:
        handle = self._handle(key)
        try:
            return handle.get_tensor(key)
        except READ_ERRORS as e:
            raise CheckpointError(f"{self.files[key]}: cannot read tensor {key!r}: {reason(e)}") from e

    def get(self, key: str) -> torch.Tensor:
        """The tensor (FP8 ones dequantised to fp32); NaN or inf (after dequantisation) raises."""
        tensor = self._tensor(key)
        if tensor.dtype == fp8.FP8_DTYPE:
            scale = key + fp8.SCALE_SUFFIX
            if scale not in self.files:
                raise CheckpointError(f"FP8 tensor {key!r} has no {scale!r} companion")
            tensor = fp8.dequantize(tensor, self._tensor(scale), self.block_size)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # NOTE: syncs
            raise CheckpointError(f"tensor {key!r} holds NaN or infinite values")
        return tensor

    def get_fp8(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 tensor as stored: (e4m3 values, fp32 `<key>_scale_inv`), for a base kept in FP8 (glm53.peft.fp8);
        NaN or inf in either raises."""
        q, scale = self._tensor(key), key + fp8.SCALE_SUFFIX
        if q.dtype != fp8.FP8_DTYPE or scale not in self.files:
            raise CheckpointError(
                f"tensor {key!r} is not block-scaled FP8 ({q.dtype}, scale {scale!r} "
                f"{'present' if scale in self.files else 'absent'})"
            )
        s = self._tensor(scale).float()
        if not (bool(torch.isfinite(s).all()) and bool(torch.isfinite(q.float()).all())):  # NOTE: syncs
            raise CheckpointError(f"tensor {key!r} (or its scale) holds NaN or infinite values")
        return q, s
