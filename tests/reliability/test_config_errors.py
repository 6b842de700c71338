"""Config values of the wrong type or range raise ConfigError naming the field; unknown keys warn once."""

import json
import math
import warnings

import pytest

from glm53 import Glm53Config
from glm53.config_checks import _BOOL, _FLOAT_RANGES, _POSITIVE_INT
from glm53.errors import ConfigError

BOOL_FIELDS = list(_BOOL)
POSITIVE_INT_FIELDS = [n for n in _POSITIVE_INT if n != "num_hidden_layers"]


def tiny_dict(**changes):
    d = Glm53Config.tiny().to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize("name", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["false", 0, 1, None], ids=["str-false", "int0", "int1", "null"])
def test_bool_fields_refuse_non_bools(name, value):
    with pytest.raises(ConfigError, match=rf"^{name} must be a bool .*got {value!r}"):
        Glm53Config.from_dict(tiny_dict(**{name: value}))


def test_string_false_does_not_tie_the_head():
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        Glm53Config.from_dict({"text_config": tiny_dict(), "tie_word_embeddings": "false"})


@pytest.mark.parametrize("name", POSITIVE_INT_FIELDS + ["num_hidden_layers"])
@pytest.mark.parametrize("value", [True, 2.0, "2"], ids=["true", "float", "str"])
def test_int_fields_refuse_bools_floats_and_strings(name, value):
    with pytest.raises(ConfigError, match=rf"^{name} must be a positive int, got {value!r}"):
        Glm53Config.from_dict(tiny_dict(**{name: value}))


def _bad_values(name):
    low, low_in, high, high_in = _FLOAT_RANGES[name]
    bad = [math.nan, math.inf, "0.1", True]
    if low is not None:
        bad.append(low - 1.0 if low_in else low)
    if high is not None:
        bad.append(high + 1.0 if high_in else high)
    return bad


FLOAT_CASES = [(n, v) for n in _FLOAT_RANGES for v in _bad_values(n)]


@pytest.mark.parametrize("name,value", FLOAT_CASES, ids=[f"{n}-{v!r}" for n, v in FLOAT_CASES])
def test_float_fields_check_type_finiteness_and_range(name, value):
    with pytest.raises(ConfigError, match=rf"^{name} must be .*got {value!r}"):
        Glm53Config.from_dict(tiny_dict(**{name: value}))


def test_ints_are_accepted_where_floats_are_meant():
    c = Glm53Config.from_dict(tiny_dict(routed_scaling_factor=2, swiglu_limit=7, initializer_range=0))
    assert (c.routed_scaling_factor, c.swiglu_limit, c.initializer_range) == (2, 7, 0)


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("layer_types", "linear_attention", r"layer_types must be a list of strings"),
        ("mlp_layer_types", ["dense", 1, "sparse", "sparse"], r"mlp_layer_types\[1\] must be a string, got 1"),
        ("eos_token_id", [1, "2"], r"eos_token_id must be a non-negative int"),
        ("bos_token_id", -1, r"bos_token_id must be a non-negative int or None, got -1"),
        ("hidden_act", 5, r"hidden_act must be a string, got 5"),
        ("n_shared_experts", -1, r"n_shared_experts must be an int >= 0, got -1"),
    ],
    ids=["layer_types-str", "mlp-item", "eos", "bos", "hidden_act", "n_shared"],
)
def test_other_field_types(name, value, message):
    with pytest.raises(ConfigError, match=message):
        Glm53Config.from_dict(tiny_dict(**{name: value}))


def test_text_config_must_be_a_dict():
    with pytest.raises(ConfigError, match=r"text_config must be a dict .*got list"):
        Glm53Config.from_dict({"text_config": [1, 2], "model_type": "glm5_next"})


def test_unknown_flat_keys_give_one_warning_naming_them():
    with pytest.warns(UserWarning) as record:
        c = Glm53Config.from_dict(tiny_dict(my_key=1, other_key="x", rope_theta=1e6, dtype="bfloat16"))
    assert len(record) == 1
    message = str(record[0].message)
    assert "my_key" in message and "other_key" in message and "rope_theta" not in message
    assert c.to_dict()["my_key"] == 1  # kept for round trips


def test_transformers_config_keys_do_not_warn(tmp_path):
    from transformers import Glm5NextConfig

    Glm5NextConfig(text_config=dict(num_hidden_layers=2), vision_config=dict(depth=1)).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Glm53Config.from_pretrained(tmp_path)


def test_config_file_read_errors_name_the_file(tmp_path, monkeypatch):
    file = tmp_path / "config.json"
    file.write_bytes(b'{"num_hidden_layers": 4, "x": "\xff\xfe"}')
    with pytest.raises(ConfigError, match=r"config.json is not UTF-8") as info:
        Glm53Config.from_pretrained(tmp_path)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)
    file.write_text(json.dumps(tiny_dict()))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr("builtins.open", denied)
    with pytest.raises(ConfigError, match=r"config.json cannot be read: Permission denied") as info:
        Glm53Config.from_pretrained(tmp_path)
    assert isinstance(info.value.__cause__, PermissionError)


@pytest.mark.parametrize(
    "d,message",
    [
        (dict(index_topk_freq=True), r"index_topk_freq must be an int, got True"),
        (dict(index_skip_topk_offset="2"), r"index_skip_topk_offset must be an int, got '2'"),
        (dict(index_topk_pattern=7), r"index_topk_pattern must be a string of 'F'/'S' or a list, got 7"),
        (dict(linear_attn_config={"safe_gate": "false"}), r"linear_attn_config\['safe_gate'\] must be a bool"),
        (dict(linear_attn_config={"kda_layers": "1,2"}), r"linear_attn_config\['kda_layers'\] must be a list"),
        (dict(linear_attn_config={"head_dim": "8"}), r"linear_head_dim must be a positive int, got '8'"),
    ],
    ids=["freq-bool", "offset-str", "pattern-int", "safe_gate-str", "kda_layers-str", "linear-head_dim-str"],
)
def test_release_schedule_keys_are_typed(d, message):
    base = {k: v for k, v in tiny_dict().items() if k not in ("indexer_types", "linear_head_dim")}
    with pytest.raises(ConfigError, match=message):
        Glm53Config.from_dict({**base, **d})


@pytest.mark.parametrize(
    "quant,message",
    [
        ({"weight_block_size": 128}, r"weight_block_size must be two positive ints, got 128"),
        ({"weight_block_size": [True, 8]}, r"weight_block_size must be two positive ints, got \[True, 8\]"),
        ("fp8", r"quantization_config must be a dict, got 'fp8'"),
    ],
)
def test_quantization_block_size_is_typed(quant, message):
    from glm53.checkpoint.fp8 import weight_block_size

    with pytest.raises(ConfigError, match=message):
        weight_block_size(quant)
