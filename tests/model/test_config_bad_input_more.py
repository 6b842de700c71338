"""Glm53Config: special token ids inside the vocabulary, the release's `linear_attn_config` layer lists inside
the model and disjoint, and num_hidden_layers checked before the schedules built from it. No tensors."""

import re
import warnings

import pytest

from glm53.config import Glm53Config
from glm53.errors import ConfigError


@pytest.mark.parametrize(
    "field,value",
    [
        ("bos_token_id", 320),
        ("bos_token_id", 10**9),
        ("eos_token_id", 320),
        ("eos_token_id", [1, 320]),
        ("pad_token_id", 320),
    ],
)
def test_special_ids_outside_the_vocabulary(field, value):
    with pytest.raises(ConfigError, match=re.escape(f"{field} ({value!r}) must lie in [0, vocab_size=320)")):
        Glm53Config.tiny(**{field: value})


def _release(**linear):
    d = {k: v for k, v in Glm53Config.tiny().to_dict().items() if k != "layer_types"}
    return {**d, "linear_attn_config": linear}


@pytest.mark.parametrize(
    "linear,message",
    [
        (dict(kda_layers=[1, 2, 3, 5], full_attn_layers=[4]), "['kda_layers'] names layers [5] outside 1..4"),
        (dict(kda_layers=[1, 2, 3], full_attn_layers=[0, 4]), "['full_attn_layers'] names layers [0] outside"),
        (dict(kda_layers=[1, 2, 3], full_attn_layers=[-4, 4]), "['full_attn_layers'] names layers [-4] outside"),
        (dict(kda_layers=[1, 2, 3, 4], full_attn_layers=[4]), " lists layers [4] in both kda_layers and full_attn"),
    ],
)
def test_linear_attn_config_layer_lists(linear, message):
    with pytest.raises(ConfigError, match=re.escape(f"linear_attn_config{message}")):
        Glm53Config.from_dict(_release(**linear))
    assert Glm53Config.from_dict(_release(kda_layers=[1, 2, 3], full_attn_layers=[4])).attention_layers == [3]


@pytest.mark.parametrize("layers", ["4", 4.0, True, 0, -2, None, [4]])
@pytest.mark.parametrize(
    "schedule",
    [
        {"index_topk_freq": 2},
        {"index_topk_pattern": "FSFS"},
        {"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4]}},
    ],
)
def test_num_hidden_layers_checked_before_the_schedules(layers, schedule):
    d = {k: v for k, v in Glm53Config.tiny().to_dict().items() if k not in ("layer_types", "indexer_types")}
    message = re.escape(f"num_hidden_layers must be a positive int, got {layers!r}")
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=message):
        warnings.simplefilter("ignore")
        Glm53Config.from_dict({**d, "num_hidden_layers": layers, **schedule})
