"""Reading checkpoints: files outside the directory, unreadable files, wrong dtypes and layer counts raise
CheckpointError (CropError in the crop tool) naming the file, the entry or key, with the cause chained."""

import json
import os
import shutil
import time

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint.crop import CropError, crop
from glm53.checkpoint.fp8 import quantize
from glm53.checkpoint.shards import INDEX_FILE
from glm53.errors import CheckpointError, ConfigError

TEXT = "model.language_model."


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny sharded checkpoint (several shards + index)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("src") / "ckpt"
    Glm53ForCausalLM(Glm53Config.tiny()).save_pretrained(path, max_shard_size="100KB")
    assert (path / INDEX_FILE).is_file()
    return path


def copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def edit_index(path, change):
    index = json.loads((path / INDEX_FILE).read_text())
    change(index["weight_map"])
    (path / INDEX_FILE).write_text(json.dumps(index))


def first_shard(path):
    return sorted(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())[0]


# ------------------------------------------------------------------------------------------------------ paths
def outside_entries(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"x": torch.zeros(1)}, outside / "x.safetensors")
    return {
        "dotdot": "../outside/x.safetensors",
        "absolute": str(outside / "x.safetensors"),
        "passwd": "../../../../../../../../etc/passwd",
    }


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "passwd", "symlink"])
def test_index_entries_must_resolve_inside_the_checkpoint(sharded, tmp_path, kind):
    path = copy(sharded, tmp_path)
    key = f"{TEXT}embed_tokens.weight"
    if kind == "symlink":
        entry = "link.safetensors"
        os.symlink(tmp_path / "outside" / "x.safetensors" if outside_entries(tmp_path) else None, path / entry)
    else:
        entry = outside_entries(tmp_path)[kind]
    edit_index(path, lambda m: m.__setitem__(key, entry))
    with pytest.raises(CheckpointError, match=rf"weight_map\['{key}'\]\) names '{entry}'.*outside|absolute path"):
        Glm53ForCausalLM.from_pretrained(path)
    with pytest.raises(CropError, match=rf"names '{entry}'"):
        crop(path, tmp_path / "out", 2, dry_run=True)


def test_a_config_json_symlinked_out_of_the_checkpoint_is_refused(sharded, tmp_path):
    """config.json is read like every other file the checkpoint holds: a symlink leading out of the directory is
    an error naming it (it was followed, reading any JSON file on the machine as the model's config)."""
    path = copy(sharded, tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text((path / "config.json").read_text())
    (path / "config.json").unlink()
    os.symlink(elsewhere, path / "config.json")
    for load in (lambda: Glm53Config.from_pretrained(path), lambda: Glm53ForCausalLM.from_pretrained(path)):
        with pytest.raises(CheckpointError, match=r"names 'config.json', which resolves to .*elsewhere.json, outside"):
            load()
    with pytest.raises(CropError, match=r"names 'config.json', which resolves to .*elsewhere.json, outside"):
        crop(path, tmp_path / "out", 2, dry_run=True)


def test_hub_cache_snapshot_symlinks_into_blobs_are_allowed(sharded, tmp_path):
    repo = tmp_path / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / "blob-tokenizer.json").write_text('{"t": 1}')
    os.symlink("../../blobs/blob-tokenizer.json", snapshot / "tokenizer.json")
    for name in os.listdir(sharded):
        shutil.copy(sharded / name, blobs / f"blob-{name}")
        os.symlink(f"../../blobs/blob-{name}", snapshot / name)
    assert Glm53ForCausalLM.from_pretrained(snapshot).config.num_hidden_layers == 4
    crop(snapshot, tmp_path / "out", 2, dtype=torch.float32, log=open(os.devnull, "w"))
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"t": 1}'  # the blob's content


def test_crop_compares_resolved_paths(sharded, tmp_path):
    src = copy(sharded, tmp_path, "src")
    os.symlink(src, tmp_path / "alias")
    with pytest.raises(CropError, match=r"must not be SRC or lie inside it"):
        crop(src, tmp_path / "alias" / "inside", 2)
    assert sorted(os.listdir(src)) == sorted(os.listdir(sharded))


def test_crop_copies_only_regular_files_inside_src(sharded, tmp_path):
    src = copy(sharded, tmp_path, "src")
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the checkpoint")
    (src / "tokenizer.json").write_text("{}")
    os.symlink(secret, src / "notes.txt")
    (src / "extra").mkdir()
    os.symlink(secret, src / "extra" / "linked.txt")
    (src / "extra" / "real.txt").write_text("kept")
    os.symlink("real.txt", src / "extra" / "alias.txt")  # inside SRC: copied (by content)
    os.symlink("..", src / "extra" / "loop")  # a linked directory: never followed
    crop(src, tmp_path / "out", 2, dtype=torch.float32, log=open(os.devnull, "w"))
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "extra" / "real.txt").read_text() == "kept"
    assert not os.path.lexists(out / "notes.txt") and not os.path.lexists(out / "extra" / "linked.txt")
    assert (out / "extra" / "alias.txt").read_text() == "kept" and not os.path.lexists(out / "extra" / "loop")


# ----------------------------------------------------------------------------------------------- read errors
def _truncate(path):
    shard = path / first_shard(path)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return first_shard(path)


def _bad_header(path):
    (path / first_shard(path)).write_bytes(b"\xff" * 64)
    return first_shard(path)


def _wrong_shard(path):
    index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    key = f"{TEXT}norm.weight"
    other = next(f for f in sorted(set(index.values())) if f != index[key])
    edit_index(path, lambda m: m.__setitem__(key, other))
    return rf"{other}: cannot read tensor '{key}'"


def _bad_index(path):
    (path / INDEX_FILE).write_text('{"weight_map": {')
    return rf"{INDEX_FILE} cannot be read as JSON"


READ_ERRORS = {
    "truncated": (_truncate, SafetensorError),
    "bad-header": (_bad_header, SafetensorError),
    "key-in-wrong-shard": (_wrong_shard, SafetensorError),
    "malformed-index": (_bad_index, json.JSONDecodeError),
}


@pytest.mark.parametrize("kind", READ_ERRORS)
def test_read_errors_name_the_file(sharded, tmp_path, kind):
    make, cause = READ_ERRORS[kind]
    path = copy(sharded, tmp_path)
    culprit = make(path)
    with pytest.raises(CheckpointError, match=culprit) as info:
        Glm53ForCausalLM.from_pretrained(path)
    assert isinstance(info.value.__cause__, cause)
    with pytest.raises(CropError, match=culprit):
        crop(path, tmp_path / "out", 2, dtype=torch.float32, log=open(os.devnull, "w"))


def test_unreadable_shard_says_permission_denied(sharded, tmp_path, monkeypatch):
    path = copy(sharded, tmp_path)
    shard = str(path / first_shard(path))
    os.chmod(shard, 0)
    real = os.access
    # The tests may run as root, which reads any file: report the mode-0000 shard as unreadable, as for a user.
    monkeypatch.setattr(os, "access", lambda f, mode, **kw: False if str(f) == shard else real(f, mode, **kw))
    message = rf"{first_shard(path)} cannot be read: permission denied \(mode 0o0\)"
    with pytest.raises(CheckpointError, match=message):
        Glm53ForCausalLM.from_pretrained(path)
    with pytest.raises(CropError, match=message):
        crop(path, tmp_path / "out", 2, dtype=torch.float32, log=open(os.devnull, "w"))


def test_other_os_errors_keep_their_cause(sharded, tmp_path, monkeypatch):
    from glm53.checkpoint import reader

    path = copy(sharded, tmp_path)

    def failing(file, **kwargs):
        raise OSError(5, "Input/output error", file)

    monkeypatch.setattr(reader, "safe_open", failing)
    with pytest.raises(CheckpointError, match=r"cannot be read as safetensors: Input/output error") as info:
        Glm53ForCausalLM.from_pretrained(path)
    assert isinstance(info.value.__cause__, OSError)


def test_non_utf8_config(sharded, tmp_path):
    path = copy(sharded, tmp_path)
    (path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(ConfigError, match=r"config.json is not UTF-8") as info:
        Glm53ForCausalLM.from_pretrained(path)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)
    with pytest.raises(CropError, match=r"config.json cannot be read as JSON"):
        crop(path, tmp_path / "out", 2, dry_run=True)


# ---------------------------------------------------------------------------------------------------- dtypes
def _single(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "single"
    Glm53ForCausalLM(Glm53Config.tiny()).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.int8, torch.uint8], ids=str)
def test_floating_parameters_refuse_non_floating_tensors(tmp_path, dtype):
    path = _single(tmp_path)
    state = load_file(path / "model.safetensors")
    key = f"{TEXT}layers.0.mlp.down_proj.weight"
    state[key] = (state[key] * 100).to(dtype)
    save_file(state, path / "model.safetensors")
    found = {torch.int64: "I64", torch.bool: "BOOL", torch.int8: "I8", torch.uint8: "U8"}[dtype]
    with pytest.raises(CheckpointError, match=rf"{key}: {found}, but model.layers.0.mlp.down_proj.weight is float32"):
        Glm53ForCausalLM.from_pretrained(path)


def test_fp8_scale_must_be_floating(tmp_path):
    path = _single(tmp_path)
    state = load_file(path / "model.safetensors")
    key = f"{TEXT}layers.0.mlp.down_proj.weight"
    q, scale = quantize(state[key], (4, 8))
    state[key], state[key + "_scale_inv"] = q, scale.to(torch.int32)
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"FP8 scale '{key}_scale_inv' is I32"):
        Glm53ForCausalLM.from_pretrained(path)


def test_layer_count_is_compared_before_building(tmp_path, monkeypatch):
    path = _single(tmp_path)
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    text["num_hidden_layers"] = 200_000
    for name in ("layer_types", "mlp_layer_types", "indexer_types"):
        text[name] = (text[name] * 50_000)[:200_000]
    (path / "config.json").write_text(json.dumps(config))
    built = []
    monkeypatch.setattr(Glm53ForCausalLM, "__init__", lambda self, cfg: built.append(cfg) or 1 / 0)
    began = time.perf_counter()
    with pytest.raises(
        CheckpointError,
        match=r"num_hidden_layers=200000 but the checkpoint has no tensors for "
        r"199996 of those layers .* it holds layers 0..3",
    ):
        Glm53ForCausalLM.from_pretrained(path)
    assert not built and time.perf_counter() - began < 10
