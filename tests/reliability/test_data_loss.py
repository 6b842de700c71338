"""Saving never loses user data: overwrite keeps foreign files byte for byte, a file in the way is refused,
modes follow the umask, killed saves leave the old checkpoint intact and their temporaries are cleaned later."""

import hashlib
import logging
import os
import stat

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import atomic
from glm53.checkpoint.shards import INDEX_FILE
from glm53.errors import CheckpointError


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Glm53ForCausalLM(Glm53Config.tiny())


def snapshot(root) -> dict[str, object]:
    """Every entry under `root`: file bytes' hash, symlink target, or "dir"."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def add_user_files(path):
    (path / "adapter_model.safetensors").write_bytes(b"user adapter bytes")
    (path / "README.md").write_text("# my model\n")
    (path / "tokenizer.json").write_text('{"v": 1}')
    os.symlink("README.md", path / "README.link")
    (path / "notes").mkdir()
    (path / "notes" / "a.txt").write_text("a")


def test_overwrite_keeps_foreign_files_and_drops_stale_shards(model, tmp_path):
    path = tmp_path / "ckpt"
    model.save_pretrained(path, max_shard_size="100KB")
    assert (path / INDEX_FILE).is_file()
    add_user_files(path)
    os.chmod(path, 0o750)
    user = {k: v for k, v in snapshot(path).items() if not k.startswith(("model", "config"))}
    model.save_pretrained(path, overwrite=True)  # one file now: the old shards and index must go
    after = snapshot(path)
    assert {k: after.get(k) for k in user} == user  # byte-identical, symlink still a symlink
    assert sorted(k for k in after if k.startswith("model")) == ["model.safetensors"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o750
    assert Glm53ForCausalLM.from_pretrained(path).config.num_hidden_layers == 4


def test_overwrite_without_the_atomic_exchange(model, tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # the two-rename fallback
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    add_user_files(path)
    user = {k: v for k, v in snapshot(path).items() if not k.startswith(("model", "config"))}
    model.save_pretrained(path, overwrite=True)
    assert {k: snapshot(path).get(k) for k in user} == user
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_regular_file_in_the_way_is_refused(model, tmp_path, overwrite):
    path = tmp_path / "ckpt"
    path.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match=rf"{path} exists and is not a directory"):
        model.save_pretrained(path, overwrite=overwrite)
    assert path.read_bytes() == b"precious"
    assert [n for n in os.listdir(tmp_path) if n != "ckpt"] == []


def test_new_directories_follow_the_umask(model, tmp_path):
    old = os.umask(0o022)
    try:
        model.save_pretrained(tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt").st_mode) == 0o755


def test_save_refuses_non_floating_dtypes_and_non_finite_tensors(model, tmp_path):
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype .* got torch.int64"):
        model.save_pretrained(tmp_path / "a", dtype=torch.int64)
    with pytest.raises(TypeError, match=r"dtype must be one of .* got torch.float8_e4m3fn"):
        model.save_pretrained(tmp_path / "a", dtype=torch.float8_e4m3fn)
    assert not os.path.lexists(tmp_path / "a")
    model.save_pretrained(tmp_path / "b", dtype="bfloat16")  # a name is accepted
    assert Glm53ForCausalLM.from_pretrained(tmp_path / "b").model.norm.weight.dtype == torch.bfloat16
    broken = Glm53ForCausalLM(Glm53Config.tiny())
    with torch.no_grad():
        broken.model.layers[1].mlp.gate.e_score_correction_bias[0] = float("nan")
    with pytest.raises(CheckpointError, match=r"NaN or inf in \['model.layers.1.mlp.gate.e_score_correction_bias'\]"):
        broken.save_pretrained(tmp_path / "c")
    assert not os.path.lexists(tmp_path / "c")
    broken.save_pretrained(tmp_path / "c", allow_non_finite=True)
    with pytest.raises(CheckpointError, match=r"e_score_correction_bias' holds NaN"):
        Glm53ForCausalLM.from_pretrained(tmp_path / "c")


def _fake_temp(parent, name, kind, pid):
    path = parent / f".{name}.{kind}-{atomic._host_tag()}-{pid}-0123abcd"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"x" * 100)
    return path


def _dead_pid():
    pid = 999_999
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid -= 1


def test_stale_temporaries_are_cleaned_only_when_provably_ours(model, tmp_path, caplog):
    model.save_pretrained(tmp_path / "ckpt")
    stale = _fake_temp(tmp_path, "ckpt", "tmp", _dead_pid())
    live = _fake_temp(tmp_path, "ckpt", "tmp", os.getppid())  # a running process: in use
    other_target = _fake_temp(tmp_path, "other", "tmp", _dead_pid())
    foreign = tmp_path / ".ckpt.tmp-handmade"
    foreign.mkdir()
    with caplog.at_level(logging.WARNING, logger="glm53.checkpoint"):
        model.save_pretrained(tmp_path / "ckpt", overwrite=True)
    assert not stale.exists() and live.exists() and other_target.exists() and foreign.exists()
    assert f"removed {stale}" in caplog.text


def test_a_swap_killed_between_renames_is_restored(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    add_user_files(tmp_path / "ckpt")
    before = snapshot(tmp_path / "ckpt")
    holder = _fake_temp(tmp_path, "ckpt", "old", _dead_pid())
    os.remove(holder / "model.safetensors")
    os.rename(tmp_path / "ckpt", holder / "ckpt")  # the kill: old directory parked, no target
    atomic.clean_stale(str(tmp_path / "ckpt"))
    assert snapshot(tmp_path / "ckpt") == before and not holder.exists()
