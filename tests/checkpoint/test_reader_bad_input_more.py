"""A checkpoint directory holding both a single weights file and a shard index (a copy over another checkpoint)
is a CheckpointError naming both, not a silent pick of one. Legend: no tensors beyond a tiny model's weights."""

import shutil

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.config import Glm53Config
from glm53.errors import CheckpointError


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
