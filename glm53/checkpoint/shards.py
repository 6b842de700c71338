"""Writing checkpoint directories: sharded safetensors with an index, written atomically.

Everything goes to a hidden temporary directory beside the target (same filesystem) and is renamed into
place only after every file is written and fsynced (atomic.py), so an exception, a kill or a full disk leaves
either the old target or none, never a half-written checkpoint that looks complete; overwriting keeps the
directory's files that are not the checkpoint's own (`checkpoint_owns`). Shards follow transformers' naming:
one `model.safetensors` when everything fits, else `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {key: file}}).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import save_file

from .atomic import atomic_directory  # noqa: F401  (re-exported: writers import it from here)
from .paths import allowed_roots, is_inside

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB", "2GiB" (decimal units as in transformers)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif not isinstance(size, str):  # a float 1.5 would read as "1.5" bytes
        raise ValueError(f"max_shard_size must be an int or a size like '5GB', got {size!r}")
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not m or m[2] not in _UNITS:
            raise ValueError(f"max_shard_size must be an int or a size like '5GB', got {size!r}")
        value = int(float(m[1]) * _UNITS[m[2]])
    if value < 1:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


# The checkpoint's own files: what overwriting a checkpoint directory replaces (everything else is kept).
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
CHECKPOINT_FILES = ("config.json", SINGLE_FILE, INDEX_FILE)


def checkpoint_owns(name: str) -> bool:
    """Whether `name` in a checkpoint directory is the checkpoint's own (config, weights, index, shards)."""
    return name in CHECKPOINT_FILES or bool(_SHARD_FILE.match(name))


class ShardedWriter:
    """Collect tensors in order and write a shard whenever the next tensor would exceed `max_shard_size`.

    Memory holds at most one shard. A single tensor larger than the limit gets a shard of its own.
    """

    def __init__(
        self, directory: str, max_shard_size: int | str = "5GB", metadata: dict[str, str] | None = None
    ) -> None:
        self.directory = directory
        self.max_bytes = parse_size(max_shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # keys per written shard
        self._keys: set[str] = set()
        self.total_size = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self._keys:
            raise ValueError(f"tensor {key!r} written twice")
        self._keys.add(key)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        # A private contiguous copy: safetensors refuses views that share storage (split experts, tied weights).
        self._pending[key] = tensor.detach().to("cpu", copy=True).contiguous()
        self._pending_bytes += nbytes
        self.total_size += nbytes

    def _temp_name(self, i: int) -> str:
        return os.path.join(self.directory, f"shard-{i:05d}.partial")

    def _flush(self) -> None:
        save_file(self._pending, self._temp_name(len(self._shards)), metadata=self.metadata)
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        """Write the last shard, give shards their final names, write the index when sharded -> weight map."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, keys in enumerate(self._shards):
            name = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self._temp_name(i), os.path.join(self.directory, name))
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
        return weight_map


def copy_side_files(src: str, dst: str) -> list[str]:
    """Copy SRC's top-level files that are not weights or config.json (tokenizer, generation config...) and its
    subdirectories (a training run's intermediate checkpoints, hard-linked rather than copied: they can be large)
    into DST, skipping names DST already has -> the names copied.

    Only files inside SRC are copied: a symlink that resolves outside it (paths.allowed_roots: SRC, or a hub
    cache snapshot's blobs) is skipped, at the top level and inside subdirectories; nothing but regular files
    and directories is read.
    """
    roots = allowed_roots(src)
    copied = []
    for name in sorted(os.listdir(src)):
        path, target = os.path.join(src, name), os.path.join(dst, name)
        if os.path.lexists(target) or not _inside(path, roots) or _linked_dir(path):
            continue
        if os.path.isdir(path):
            shutil.copytree(path, target, copy_function=_link_or_copy, ignore=_outside(roots))
        elif name in ("config.json", INDEX_FILE) or name.endswith(".safetensors") or not os.path.isfile(path):
            continue
        else:
            shutil.copy2(path, target)
        copied.append(name)
    return copied


def _inside(path: str, roots: list[str]) -> bool:
    resolved = os.path.realpath(path)
    return any(is_inside(resolved, root) for root in roots)


def _linked_dir(path: str) -> bool:
    return os.path.islink(path) and os.path.isdir(path)


def _outside(roots: list[str]):
    """copytree's `ignore`: entries that resolve outside `roots`, symlinked directories (which may loop), and
    anything but files and directories."""

    def ignore(directory: str, names: list[str]) -> list[str]:
        paths = {n: os.path.join(directory, n) for n in names}
        return [
            n
            for n, p in paths.items()
            if not _inside(p, roots) or _linked_dir(p) or not (os.path.isfile(p) or os.path.isdir(p))
        ]

    return ignore


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not supported
        shutil.copy2(src, dst)


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
