"""Confining the files a checkpoint names to the checkpoint directory.

No tensors here. `model.safetensors.index.json` names shard files; a name such as `../../x.safetensors`, an
absolute path or a symlink leading out of the directory would make a load or a crop read any file on the machine.
Every such file must resolve (realpath, symlinks followed) inside the directory. One allowance: a Hugging Face
hub cache snapshot (`.../snapshots/<revision>/`) holds symlinks into the repository's `blobs/` folder, so for a
directory inside `snapshots/` that folder counts as inside too.
"""

from __future__ import annotations

import os

from ..errors import CheckpointError


def is_inside(path: str, root: str) -> bool:
    """Whether `path` (already resolved) is `root` or lies below it (`root` resolved too)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def allowed_roots(directory: str) -> list[str]:
    """The resolved folders files of checkpoint `directory` may live in."""
    root = os.path.realpath(directory)
    roots = [root]
    snapshots = os.path.dirname(root)
    if os.path.basename(snapshots) == "snapshots":
        roots.append(os.path.join(os.path.dirname(snapshots), "blobs"))
    return roots


def confined(directory: str, name: object, source: str) -> str:
    """The path of file `name` that `source` (index file, config) names in checkpoint `directory`.

    Raises CheckpointError naming the entry when it is not a relative name or resolves outside the directory.
    """
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{source} names a file that is not a file name: {name!r}")
    if os.path.isabs(name):
        raise CheckpointError(
            f"{source} names {name!r}, an absolute path; checkpoint files must be relative to {directory}"
        )
    path = os.path.join(directory, name)
    resolved = os.path.realpath(path)
    if not any(is_inside(resolved, root) for root in allowed_roots(directory)):
        raise CheckpointError(
            f"{source} names {name!r}, which resolves to {resolved}, outside the checkpoint "
            f"directory {os.path.realpath(directory)}"
        )
    return path


__all__ = ["is_inside", "allowed_roots", "confined"]
