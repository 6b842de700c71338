"""The memory planner and the checkpoint read plan count the vision tower when the config declares one; the
tower's read splits over FSDP ranks like the text model's."""

from __future__ import annotations

import torch

from glm53 import Glm53ForConditionalGeneration
from glm53.parallel.ckpt_plan import plan_rank
from glm53.tools.plan import measure
from glm53.vision import with_vision
from tests.helpers.vision import TOKENS, TOWER, text_config


def tower_numel(config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Glm53ForConditionalGeneration(config).visual.parameters())


def test_planner_counts_the_tower():
    text = text_config()
    vl = with_vision(text, TOWER, TOKENS)
    n = tower_numel(vl)
    assert n > 0
    a, b = measure(text, 2, 1, 1, torch.float32), measure(vl, 2, 1, 1, torch.float32)
    assert b["total_params"] - a["total_params"] == n
    assert b["params"] - a["params"] == 4 * n // 2  # fp32 bytes, FSDP-sharded over dp 2 (every tensor even here)


def test_checkpoint_plan_counts_the_tower_in_bf16():
    text = text_config()
    vl = with_vision(text, TOWER, TOKENS)
    n = tower_numel(vl)
    a, b = plan_rank(text, 0, 2, 1), plan_rank(vl, 0, 2, 1)
    assert b.checkpoint_bytes - a.checkpoint_bytes == 2 * n  # bf16 on disk: the release has no FP8 vision tensors
    assert 0 < b.read_bytes - a.read_bytes <= 2 * n * 0.6  # rank 0 reads about half of the tower


def test_freeze_groups_split_the_tower():
    import pytest

    from glm53 import Glm53ForCausalLM
    from glm53.vision import group_parameter_names

    with torch.device("meta"):
        model = Glm53ForConditionalGeneration(with_vision(text_config(), TOWER, TOKENS))
    tower = group_parameter_names(model, "vision_tower")
    projector = group_parameter_names(model, "projector")
    assert not set(tower) & set(projector)
    assert set(tower) | set(projector) == {n for n, _ in model.named_parameters() if n.startswith("visual.")}
    assert "visual.blocks.1.attn.q_norm.weight" in tower and "visual.post_layernorm.weight" in tower
    assert "visual.patch_embed.proj.weight" in tower and "visual.merger.post_projection_norm.bias" in projector
    assert "visual.downsample.weight" in projector and len(projector) == 8
    with pytest.raises(ValueError, match="unknown parameter group 'towers'; the vision groups are"):
        group_parameter_names(model, "towers")
    with torch.device("meta"):
        text = Glm53ForCausalLM(text_config())
    with pytest.raises(ValueError, match="needs a model with a vision tower"):
        group_parameter_names(text, "projector")
