"""The exporter's bookkeeping written out (one process): writer ranks largest key first to the least-loaded rank,
and an export equals `save_pretrained` of the same model: the same tensors and dtypes (bf16 with the fp32
keep-list), the index's total_size, config.json's dtype, files cut at the shard size. On gloo, one rank failing
inside the shared directory fails every rank and leaves nothing behind.

Legend: sizes are bytes per official key; a writer is the rank that writes a key.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel.export import assign_writers, export_pretrained
from tests.helpers.checkpoints import read_all
from tests.helpers.export_edges_jobs import failing_write


def test_writers_take_the_largest_keys_first_each_to_the_least_loaded_rank():
    # 10 -> r0, 9 -> r1, 8 -> r1 (9 < 10), then the 1s to r0 (10, 11 < 17); ties go to the lowest rank
    assert assign_writers([10, 1, 1, 9, 8], 2) == [0, 0, 0, 1, 1]
    assert assign_writers([5, 5, 5], 3) == [0, 1, 2]
    assert assign_writers([4, 4], 1) == [0, 0]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["as-is", "bf16"])
def test_export_equals_save_pretrained(tmp_path, dtype):
    model = Glm53ForCausalLM(Glm53Config.tiny())
    shard = 30_000
    model.save_pretrained(tmp_path / "saved", max_shard_size=shard, dtype=dtype)
    export_pretrained(model, tmp_path / "exported", max_shard_size=shard, dtype=dtype)
    saved, exported = read_all(str(tmp_path / "saved")), read_all(str(tmp_path / "exported"))
    assert set(exported) == set(saved)
    for key, value in saved.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
    index = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in saved.values())
    files = {}
    for key, file in index["weight_map"].items():
        files[file] = files.get(file, 0) + exported[key].nbytes
    largest = max(v.nbytes for v in saved.values())
    assert len(files) > 2 and all(size <= max(shard, largest) for size in files.values())
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    expected = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["dtype"] == config["text_config"]["dtype"] == expected["dtype"]
    assert config["dtype"] == ("bfloat16" if dtype else "float32")


def test_one_failing_rank_fails_every_rank_and_leaves_nothing(pool2, tmp_path):
    """The ranks agree before rank 0 renames: a directory missing one rank's files never appears."""
    path = tmp_path / "run"
    seen = pool2.run(failing_write, path=str(path), failing_rank=1)
    assert seen[1] == "ValueError: rank 1 failed"
    assert seen[0].startswith("RuntimeError: another rank failed while writing"), seen
    assert not path.exists() and os.listdir(tmp_path) == []
