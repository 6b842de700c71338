"""checkpoint_files / TensorReader on bad indexes and files: every case is a CheckpointError naming the index entry,
file or key (no AttributeError, KeyError or raw decode error), and nothing outside the directory is read.

A checkpoint directory holding both a single weights file and a shard index (a copy over another checkpoint)
is a CheckpointError naming both, not a silent pick of one. Legend: no tensors beyond a tiny model's weights.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import fp8
from glm53.checkpoint.reader import TensorReader, checkpoint_files
from glm53.checkpoint.shards import INDEX_FILE, SINGLE_FILE
from glm53.errors import CheckpointError

KEY = "model.language_model.norm.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny checkpoint, sharded (with an index) and as one file."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("reader")
    model = Glm53ForCausalLM(Glm53Config.tiny())
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    model.save_pretrained(root / "single")
    return root


def copy(src, dst):
    return shutil.copytree(src, dst, symlinks=True)


def write_index(path, weight_map_json: str) -> None:
    (path / INDEX_FILE).write_text('{"metadata": {}, "weight_map": ' + weight_map_json + "}")


@pytest.mark.parametrize("weight_map", ["[]", '"model.safetensors"', "null", "3"])
def test_weight_map_must_be_an_object(saved, tmp_path, weight_map):
    path = copy(saved / "sharded", tmp_path / "ckpt")
    write_index(path, weight_map)
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE} has no 'weight_map' object"):
        checkpoint_files(str(path))


def test_duplicate_keys_in_the_index_are_refused(saved, tmp_path):
    """JSON keeps the last of two equal keys: which shard a tensor comes from must not depend on that."""
    path = copy(saved / "sharded", tmp_path / "ckpt")
    index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    first, other = index[KEY], next(f for f in sorted(set(index.values())) if f != index[KEY])
    body = ", ".join(f'"{k}": "{v}"' for k, v in index.items())
    write_index(path, "{" + body + f', "{KEY}": "{other}"' + "}")
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE} names {KEY!r} more than once"):
        checkpoint_files(str(path))
    assert first != other


def test_index_not_utf8(saved, tmp_path):
    path = copy(saved / "sharded", tmp_path / "ckpt")
    (path / INDEX_FILE).write_bytes(b'{"weight_map": {"\xff": "x"}}')
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE} cannot be read as JSON") as info:
        checkpoint_files(str(path))
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


@pytest.mark.parametrize("entry", ["", 3, None, ["a"]], ids=repr)
def test_entry_that_is_not_a_file_name(saved, tmp_path, entry):
    path = copy(saved / "sharded", tmp_path / "ckpt")
    write_index(path, json.dumps({KEY: entry}))
    with pytest.raises(CheckpointError, match=rf"weight_map\['{KEY}'\]\) names a file that is not a file name"):
        checkpoint_files(str(path))


def test_absolute_entry_is_refused_even_inside_the_directory(saved, tmp_path):
    path = copy(saved / "sharded", tmp_path / "ckpt")
    inside = str(path / json.loads((path / INDEX_FILE).read_text())["weight_map"][KEY])
    write_index(path, json.dumps({KEY: inside}))
    with pytest.raises(CheckpointError, match=r"an absolute path; checkpoint files must be relative"):
        checkpoint_files(str(path))


def test_sibling_directory_sharing_the_prefix_is_outside(saved, tmp_path):
    """`ckpt-evil` starts with `ckpt` but is not inside it."""
    path = copy(saved / "sharded", tmp_path / "ckpt")
    evil = tmp_path / "ckpt-evil"
    evil.mkdir()
    save_file({KEY: torch.zeros(1)}, evil / "x.safetensors")
    write_index(path, json.dumps({KEY: "../ckpt-evil/x.safetensors"}))
    with pytest.raises(CheckpointError, match=r"names '../ckpt-evil/x.safetensors', which resolves to .*ckpt-evil"):
        checkpoint_files(str(path))


def test_entry_naming_a_directory_does_not_exist_as_a_shard(saved, tmp_path):
    path = copy(saved / "sharded", tmp_path / "ckpt")
    (path / "sub.safetensors").mkdir()
    write_index(path, json.dumps({KEY: "sub.safetensors"}))
    with pytest.raises(CheckpointError, match=r"names shard files that do not exist: \['sub.safetensors'\]"):
        checkpoint_files(str(path))


@pytest.mark.parametrize("layout,name", [("sharded", INDEX_FILE), ("single", SINGLE_FILE)])
def test_index_or_weights_symlinked_outside_are_refused(saved, tmp_path, layout, name):
    """The index or the single weights file itself may not be a link out of the directory."""
    path = copy(saved / layout, tmp_path / "ckpt")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.replace(path / name, outside / name)
    os.symlink(outside / name, path / name)
    with pytest.raises(CheckpointError, match=rf"names '{name}', which resolves to {outside / name}, outside"):
        checkpoint_files(str(path))


def test_reader_errors_name_the_file_and_key(saved, tmp_path):
    """TensorReader.get reads a key its file lacks / an FP8 tensor without a scale: CheckpointError naming both."""
    single = str(saved / "single" / SINGLE_FILE)
    with pytest.raises(CheckpointError, match=rf"{single}: cannot read tensor 'absent'") as info:
        TensorReader({"absent": single}).get("absent")
    assert isinstance(info.value.__cause__, SafetensorError)
    q, _ = fp8.quantize(torch.randn(8, 16), (4, 8))
    save_file({"w": q}, tmp_path / "q.safetensors")
    with pytest.raises(CheckpointError, match=r"FP8 tensor 'w' has no 'w_scale_inv' companion"):
        TensorReader({"w": str(tmp_path / "q.safetensors")}, (4, 8)).get("w")


# ---------------------------------------------------------------------------------- a weights file beside a shard index
@pytest.mark.parametrize("stale", ["single", "index"])
def test_single_file_beside_an_index(tmp_path, stale):
    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config.tiny(num_hidden_layers=1, mlp_layer_types=["dense"]))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    model.save_pretrained(tmp_path / "single")
    both = tmp_path / "both"
    shutil.copytree(tmp_path / ("sharded" if stale == "single" else "single"), both)
    if stale == "single":
        shutil.copy(tmp_path / "single" / "model.safetensors", both)
    else:
        for f in (tmp_path / "sharded").iterdir():
            if f.name != "config.json":
                shutil.copy(f, both)
    with pytest.raises(CheckpointError, match=r"holds both model.safetensors and model.safetensors.index.json"):
        Glm53ForCausalLM.from_pretrained(both)
