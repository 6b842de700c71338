"""Glm53VisionConfig: transformers' field names, defaults and aliases; errors name the field and its value; the
token ids and the vision config round-trip through the text config's outer part."""

from __future__ import annotations

import re

import pytest
from transformers import Glm5NextConfig, Glm5NextVisionConfig

from glm53 import Glm53Config
from glm53.errors import ConfigError
from glm53.vision import Glm53VisionConfig, MultimodalTokenIds, has_vision, vision_parts, with_vision, without_vision
from tests.helpers.vision import TOKENS, TOWER, text_config


def test_defaults_equal_transformers():
    ref = Glm5NextVisionConfig().to_dict()
    ours = Glm53VisionConfig().to_dict()
    for key, value in ours.items():
        if key != "extra":
            assert ref[key] == value, key
    assert ours["rope_parameters"] == {"rope_type": "axial", "rope_theta": 10000.0}
    assert MultimodalTokenIds().to_dict() == {k: getattr(Glm5NextConfig(), k) for k in TOKENS}


def test_aliases_and_round_trip():
    config = Glm53VisionConfig.from_dict(
        {"num_attention_heads": 4, "num_hidden_layers": 3, "hidden_size": 32, "transformers_version": "5.23.0"}
    )
    assert (config.num_heads, config.depth, config.head_dim) == (4, 3, 8)
    assert config.extra == {"transformers_version": "5.23.0"}
    again = Glm53VisionConfig.from_dict(config.to_dict())
    assert again == config and again.to_dict()["model_type"] == "glm5_next_vision"
    # transformers reads what glm53 writes
    ref = Glm5NextVisionConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    assert (ref.num_heads, ref.depth, ref.hidden_size) == (4, 3, 32)


BAD = {
    "depth-0": (dict(depth=0), "vision_config.depth must be a positive int, got 0"),
    "heads-divide": (
        dict(hidden_size=30, num_heads=4),
        "vision_config.num_heads (4) must divide vision_config.hidden_size (30)",
    ),
    "head-dim-4": (dict(hidden_size=12, num_heads=2), "head width hidden_size / num_heads = 6 must be divisible by 4"),
    "rope-type": (
        dict(rope_parameters={"rope_type": "default"}),
        "rope_parameters['rope_type'] must be 'axial', got 'default'",
    ),
    "rope-theta": (
        dict(rope_parameters={"rope_type": "axial", "rope_theta": "big"}),
        "rope_theta'] must be a finite number > 1, got 'big'",
    ),
    "eps": (dict(rms_norm_eps=-1.0), "vision_config.rms_norm_eps must be a positive finite number, got -1.0"),
    "alias-conflict": (
        dict(num_heads=2, num_attention_heads=4),
        "sets num_heads=2 and its alias num_attention_heads=4",
    ),
    "act": (dict(hidden_act="gelu"), "vision_config.hidden_act must be 'silu', got 'gelu'"),
    "bias-type": (dict(attention_bias="yes"), "vision_config.attention_bias must be true or false, got 'yes'"),
    "patch-list": (dict(patch_size=[14, 14]), "vision_config.patch_size must be a positive int, got [14, 14]"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_fields_raise_naming_field_and_value(case):
    fields, message = BAD[case]
    with pytest.raises(ConfigError, match=re.escape(message)):
        Glm53VisionConfig.from_dict(fields)


def test_out_hidden_size_must_equal_text_hidden_size():
    text = text_config()
    with pytest.raises(
        ConfigError, match=re.escape("vision_config.out_hidden_size (1536) must equal the text hidden_size (36)")
    ):
        with_vision(text, Glm53VisionConfig(), TOKENS)


def test_token_ids_must_lie_in_the_vocabulary():
    text = text_config()
    with pytest.raises(
        ConfigError, match=re.escape("image_token_id must be a token id in [0, vocab_size=320), got 154854")
    ):
        with_vision(text, TOWER)


def test_vl_config_round_trips_through_the_text_config():
    text = text_config()
    assert not has_vision(text)
    with pytest.raises(ConfigError, match="config has no vision_config"):
        vision_parts(text)
    vl = with_vision(text, TOWER, TOKENS)
    official = vl.to_official_dict()
    assert official["vision_config"]["out_hidden_size"] == 36 and official["image_token_id"] == 300
    back = Glm53Config.from_dict(official)  # the text config keeps parsing a VL config
    assert back.hidden_size == 36 and has_vision(back)
    vision, tokens = vision_parts(back)
    assert vision == Glm53VisionConfig.from_dict(TOWER) and tokens == MultimodalTokenIds(**TOKENS)
    # transformers reads the same file
    hf = Glm5NextConfig(**{k: v for k, v in official.items() if k not in ("model_type", "architectures")})
    assert hf.vision_config.out_hidden_size == 36 and hf.video_start_token_id == 304
    text_only = without_vision(back).to_official_dict()
    assert "vision_config" not in text_only and "image_token_id" not in text_only
