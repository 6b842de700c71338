"""atomic_directory at its edges, without a model: what is synced and when, a target that appears while writing,
a symlinked target, a failed second rename in the fallback swap, and temporaries of another host or a live process."""

from __future__ import annotations

import os

import pytest

from glm53.checkpoint import atomic


def write(directory, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)


def test_files_and_directories_are_synced_before_and_after_the_rename(tmp_path, monkeypatch):
    """Every file and the new directory are fsynced before it becomes the target (the data and the names it
    holds), and the parent after (the rename itself), so a power cut cannot leave a complete-looking target
    whose files are empty."""
    target = tmp_path / "ckpt"
    synced = []
    real = os.fsync

    def record(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), os.path.lexists(target)))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    with atomic.atomic_directory(target) as tmp:
        write(tmp, {"a.bin": b"a", "b.bin": b"b"})
        os.mkdir(os.path.join(tmp, "sub"))
        write(os.path.join(tmp, "sub"), {"c.bin": b"c"})
    before = [os.path.relpath(p, tmp) for p, exists in synced if not exists]
    assert sorted(before) == [".", "a.bin", "b.bin", "sub", "sub/c.bin"]
    assert before.index("sub/c.bin") < before.index("sub") < before.index(".")  # contents before their directory
    assert (str(tmp_path), True) in synced
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_target_that_appears_while_writing_is_not_replaced(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(FileExistsError, match=r"already exists"):
        with atomic.atomic_directory(target) as tmp:
            write(tmp, {"new.bin": b"new"})
            target.mkdir()
            write(target, {"theirs.bin": b"theirs"})
    assert os.listdir(target) == ["theirs.bin"] and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_symlinked_target_stays_a_link(tmp_path):
    real_dir, link = tmp_path / "real", tmp_path / "link"
    real_dir.mkdir()
    write(real_dir, {"old.bin": b"old", "keep.txt": b"mine"})
    os.symlink(real_dir, link)
    with atomic.atomic_directory(link, overwrite=True, own=lambda name: name.endswith(".bin")) as tmp:
        write(tmp, {"new.bin": b"new"})
    assert os.path.islink(link) and os.readlink(link) == str(real_dir)
    assert sorted(os.listdir(real_dir)) == ["keep.txt", "new.bin"]


def test_fallback_swap_restores_the_old_directory_when_the_second_rename_fails(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    target.mkdir()
    write(target, {"old.bin": b"old"})
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    real = os.rename

    def failing(src, dst):
        if os.path.basename(src).startswith(".ckpt.tmp-") and dst == str(target):
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="Input/output error"):
        with atomic.atomic_directory(target, overwrite=True) as tmp:
            write(tmp, {"new.bin": b"new"})
    assert os.listdir(target) == ["old.bin"] and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_temporaries_of_another_host_or_a_live_process_are_kept(tmp_path, monkeypatch):
    gone = 2**22 + 12345  # above the default pid_max: no such process
    other_user = gone + 1  # reported alive but not ours to signal (EPERM)
    real_kill = os.kill
    monkeypatch.setattr(
        os,
        "kill",
        lambda pid, sig: (
            (_ for _ in ()).throw(PermissionError(1, "Operation not permitted"))
            if pid == other_user
            else real_kill(pid, sig)
        ),
    )
    other_host = tmp_path / f".ckpt.tmp-{'0' * 8 if atomic._host_tag() != '0' * 8 else '1' * 8}-{gone}-0123abcd"
    live = tmp_path / f".ckpt.tmp-{atomic._host_tag()}-{os.getpid()}-0123abcd"
    foreign_owner = tmp_path / f".ckpt.tmp-{atomic._host_tag()}-{other_user}-0123abcd"
    dead = tmp_path / f".ckpt.tmp-{atomic._host_tag()}-{gone}-0123abcd"
    for path in (other_host, live, foreign_owner, dead):
        path.mkdir()
    assert atomic.clean_stale(str(tmp_path / "ckpt")) == [str(dead)]
    assert other_host.exists() and live.exists() and foreign_owner.exists() and not dead.exists()


def test_a_symlinked_subdirectory_is_carried_as_a_link(tmp_path):
    """Foreign symlinks (to a directory, or inside a subdirectory) stay links: their targets are not copied."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write(elsewhere, {"big.bin": b"x"})
    target = tmp_path / "ckpt"
    target.mkdir()
    os.symlink(elsewhere, target / "data")
    (target / "notes").mkdir()
    os.symlink(elsewhere / "big.bin", target / "notes" / "big.link")  # inside a carried subdirectory
    os.symlink(elsewhere, target / "notes" / "dir.link")
    with atomic.atomic_directory(target, overwrite=True, own=lambda name: name.endswith(".bin")) as tmp:
        write(tmp, {"new.bin": b"new"})
    assert os.path.islink(target / "data") and os.readlink(target / "data") == str(elsewhere)
    assert os.readlink(target / "notes" / "big.link") == str(elsewhere / "big.bin")
    assert os.readlink(target / "notes" / "dir.link") == str(elsewhere)


def test_a_parked_old_directory_never_replaces_a_target_made_since(tmp_path, caplog):
    gone = 2**22 + 12345  # above the default pid_max: no such process
    holder = tmp_path / f".ckpt.old-{atomic._host_tag()}-{gone}-0123abcd"
    (holder / "ckpt").mkdir(parents=True)
    write(holder / "ckpt", {"old.bin": b"old"})
    (tmp_path / "ckpt").mkdir()
    write(tmp_path / "ckpt", {"new.bin": b"new"})
    with caplog.at_level("WARNING", logger="glm53.checkpoint"):
        assert atomic.clean_stale(str(tmp_path / "ckpt")) == []
    assert os.listdir(tmp_path / "ckpt") == ["new.bin"] and os.listdir(holder / "ckpt") == ["old.bin"]
    assert "left in place" in caplog.text


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_get_the_umask_mode_and_carried_files_keep_theirs(tmp_path, umask):
    """safetensors writes its files 0600; a checkpoint's weights must be as readable as its config.json (the umask's
    0666 & ~umask), or a checkpoint shared with other users is unreadable. A user's own file carried across an
    overwrite keeps its mode (it is the same inode)."""
    import torch
    from safetensors.torch import save_file

    target = tmp_path / "ckpt"
    target.mkdir()
    write(target, {"notes.txt": b"mine"})
    os.chmod(target / "notes.txt", 0o640)
    old = os.umask(umask)
    try:
        with atomic.atomic_directory(target, overwrite=True, own=lambda name: name != "notes.txt") as tmp:
            save_file({"w": torch.zeros(2)}, os.path.join(tmp, "model.safetensors"))
            write(tmp, {"config.json": b"{}"})
    finally:
        os.umask(old)
    mode = lambda name: os.stat(target / name).st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json") == 0o666 & ~umask
    assert mode("notes.txt") == 0o640
