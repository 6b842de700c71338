"""Writing a directory atomically without losing what the user keeps in it.

No tensors here. `atomic_directory(target)` hands out a hidden temporary directory beside `target` (same file
system); when the caller's block succeeds the temporary directory becomes `target` by rename, so a kill or an
error leaves the old `target` or none, never a half-written one. Rules (tests/reliability/test_data_loss.py):
- A regular file (or anything not a directory) at `target` is refused, with or without `overwrite`.
- Overwriting replaces only the checkpoint's own entries (`own` names, e.g. config.json, the weights, the
  index, old shards): everything else in the old directory (adapters, READMEs, tokenizer files, symlinks,
  subdirectories) is hard-linked (same file, byte for byte, nothing copied) into the new one before the swap,
  and the directory keeps its mode. A new directory gets the umask's mode.
- Every file written into the temporary tree gets the umask's mode (0666 & ~umask), whatever its writer chose:
  safetensors writes 0600, so weights beside a 0644 config.json were unreadable to the users a shared checkpoint
  is for. Files carried from the old directory keep theirs (they are the same inodes).
- Every file and directory of the temporary tree is fsynced before the swap, and the parent directory after it, so a
  power cut cannot leave a complete-looking target with empty files or lose the swap once it returned.
- The swap is one atomic exchange of the two directories where Linux offers it (renameat2), so a kill at any
  point leaves the complete old or the complete new directory at `target`.
- Temporary directories are named `.NAME.tmp-<host>-<pid>-<random>` and the fallback swap's holder of the old
  directory `.NAME.old-<host>-<pid>-<random>`: a later write to the same target removes those whose process on this host
  is gone (provably ours and not in use), restores an old directory a kill left in a holder with no target, and
  logs what it did.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger("glm53.checkpoint")

_REPLACED = "replaced"  # the old directory's name inside its holder once the swap is done
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _new_name(name: str, kind: str) -> str:
    return f".{name}.{kind}-{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


def _stale_pattern(name: str) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(name)}\.(tmp|old)-([0-9a-f]{{8}})-(\d+)-[0-9a-f]{{8}}$")


def _process_gone(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists but belongs to someone else
        return False
    return False


def clean_stale(target: str) -> list[str]:
    """Remove the temporaries a killed write to `target` left behind (see the module docstring) -> their paths."""
    parent, name = os.path.split(target)
    pattern, host = _stale_pattern(name), _host_tag()
    cleaned = []
    for entry in sorted(os.listdir(parent)):
        m = pattern.match(entry)
        path = os.path.join(parent, entry)
        if not m or m[2] != host or not _process_gone(int(m[3])) or os.path.islink(path) or not os.path.isdir(path):
            continue
        if m[1] == "old" and os.path.isdir(os.path.join(path, name)):
            if os.path.lexists(target):  # not ours to judge: someone made a new target since
                logger.warning("%s holds a previous %s from a killed write; left in place", path, target)
                continue
            os.rename(os.path.join(path, name), target)
            logger.warning("restored %s from %s (a write to it was killed mid-swap)", target, path)
        shutil.rmtree(path)
        logger.warning("removed %s, left by a killed write to %s (process %s)", path, target, m[3])
        cleaned.append(path)
    return cleaned


def _check_target(target: str, overwrite: bool) -> None:
    if os.path.lexists(target) and not os.path.isdir(target):
        raise FileExistsError(f"{target} exists and is not a directory; refusing to replace it with a checkpoint")
    if os.path.lexists(target) and not overwrite:
        raise FileExistsError(f"{target} already exists (pass overwrite=True / --overwrite to replace it)")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst, follow_symlinks=False)


def carry_foreign(old: str, new: str, own: Callable[[str], bool]) -> list[str]:
    """Hard-link every entry of `old` that is not `own` and not already in `new` into `new` -> their names.

    Symlinks stay symlinks (their targets are not read), subdirectories are linked file by file.
    """
    carried = []
    for name in sorted(os.listdir(old)):
        src, dst = os.path.join(old, name), os.path.join(new, name)
        if own(name) or os.path.lexists(dst):
            continue
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)
        carried.append(name)
    return carried


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it; set straight back
    os.umask(mask)
    return mask


def apply_umask(directory: str) -> None:
    """Give every regular file under `directory` the mode a plain `open(..., "w")` would: 0666 & ~umask."""
    mode = 0o666 & ~current_umask()
    for root, _, names in os.walk(directory):
        for name in names:
            file = os.path.join(root, name)
            if os.path.isfile(file) and not os.path.islink(file):
                os.chmod(file, mode)


def fsync_tree(directory: str) -> None:
    """fsync every regular file under `directory` (subdirectories too: a distributed checkpoint's shards), then
    each directory after its contents (the names it holds)."""
    for root, _, names in os.walk(directory, topdown=False):
        for name in names:
            file = os.path.join(root, name)
            if os.path.isfile(file) and not os.path.islink(file):
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(root)


def fsync_dir(directory: str) -> None:
    """Make a directory's entries (a rename into it) durable: fsync on the directory itself (POSIX)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # a file system that cannot sync a directory says EINVAL: nothing to do
            raise
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE) -> False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a file system without the flag
        return False
    raise OSError(err, os.strerror(err), b)


def _swap(tmp: str, target: str, parent: str, name: str) -> None:
    """Replace directory `target` by `tmp`: one atomic exchange where the system has it (the old directory then
    sits at `tmp`, which is deleted), else two renames with the old directory parked in a marked holder (a kill
    between them leaves no `target`; the next write to it restores the old one)."""
    if _exchange(tmp, target):
        shutil.rmtree(tmp)
        return
    holder = os.path.join(parent, _new_name(name, "old"))
    os.mkdir(holder, 0o700)
    os.rename(target, os.path.join(holder, name))
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(os.path.join(holder, name), target)
        os.rmdir(holder)
        raise
    os.rename(os.path.join(holder, name), os.path.join(holder, _REPLACED))
    shutil.rmtree(holder)


@contextmanager
def atomic_directory(
    target: str | os.PathLike, overwrite: bool = False, own: Callable[[str], bool] = lambda name: True
) -> Iterator[str]:
    """Yield a temporary directory beside `target`; on success it becomes `target`, on error it is deleted.

    `own(name)` says which entries of an existing `target` the new directory replaces; the others are kept
    (hard-linked across). The default owns everything (a plain replace). See the module docstring.
    """
    target = os.path.abspath(os.fspath(target))
    if os.path.islink(target) and os.path.isdir(target):
        target = os.path.realpath(target)  # write where the link points; the link stays
    _check_target(target, overwrite)
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    clean_stale(target)
    tmp = os.path.join(parent, _new_name(name, "tmp"))
    os.mkdir(tmp, 0o777)  # the umask applies
    try:
        yield tmp
        apply_umask(tmp)  # before carry_foreign: the user's own files keep their modes
        fsync_tree(tmp)
        _check_target(target, overwrite)  # the target may have appeared while writing
        if os.path.isdir(target):
            carry_foreign(target, tmp, own)
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
            _swap(tmp, target, parent, name)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)  # the rename itself


__all__ = ["apply_umask", "atomic_directory", "carry_foreign", "clean_stale", "fsync_dir", "fsync_tree"]
