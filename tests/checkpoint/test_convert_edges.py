"""from_transformers_state_dict on keys outside the text model: vision keys are dropped, anything else is refused
with every offending key named; the conv split and the gate rename go to the right glm53 names."""

from __future__ import annotations

import pytest
import torch

from glm53.checkpoint import from_transformers_state_dict
from glm53.errors import CheckpointError

T = "model.language_model."


def test_unknown_keys_are_refused_by_name():
    state = {"lm_head.weight": torch.zeros(2), "model.visual.blocks.0.w": torch.zeros(1),
             "transformer.h.0.w": torch.zeros(1), "model.other.w": torch.zeros(1)}  # fmt: skip
    with pytest.raises(CheckpointError, match=r"outside the text model and vision tower:\n  model\.other\.w\n  "
                                              r"transformer\.h\.0\.w$"):  # fmt: skip
        from_transformers_state_dict(state)


def test_conv_thirds_and_gate_names():
    conv, dt_bias = torch.arange(12.0).view(6, 1, 2), torch.ones(2)  # conv: q rows 0-1, k rows 2-3, v rows 4-5
    state = {f"{T}layers.0.self_attn.conv1d.weight": conv, f"{T}layers.0.self_attn.forget_gate.dt_bias": dt_bias,
             "model.visual.patch.w": torch.zeros(1), "lm_head.weight": torch.zeros(3)}  # fmt: skip
    out = from_transformers_state_dict(state)
    attn = "model.layers.0.self_attn."
    assert sorted(out) == ["lm_head.weight", f"{attn}dt_bias", f"{attn}k_conv1d.weight", f"{attn}q_conv1d.weight",
                           f"{attn}v_conv1d.weight"]  # fmt: skip
    for i, part in enumerate("qkv"):
        assert torch.equal(out[f"model.layers.0.self_attn.{part}_conv1d.weight"], conv[2 * i : 2 * i + 2])
    assert out["model.layers.0.self_attn.dt_bias"] is dt_bias
