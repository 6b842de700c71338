"""Glm53Config: released defaults, every accepted spelling of a config, round trips and every validation error.

Glm53Config: special token ids inside the vocabulary, the release's `linear_attn_config` layer lists inside
the model and disjoint, and num_hidden_layers checked before the schedules built from it. No tensors.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
from huggingface_hub.errors import StrictDataclassError

from glm53 import Glm53Config
from glm53.errors import ConfigError

KDA, MLA = "linear_attention", "indexed_attention"


def fields(config: Glm53Config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "extra"}


def hf_text_config(**kwargs):
    from transformers import Glm5NextTextConfig

    return Glm5NextTextConfig(**kwargs)


# ------------------------------------------------------------------------------------------------ defaults
def test_defaults_are_the_released_model():
    c = Glm53Config()
    assert c.num_hidden_layers == 45
    assert c.layer_types == [KDA if i % 4 != 3 else MLA for i in range(45)]
    assert c.layer_types[:4] == [KDA, KDA, KDA, MLA] and c.attention_layers[-1] == 43
    assert c.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 42
    assert c.indexer_types == ["full"] * 45
    assert (c.vocab_size, c.hidden_size, c.pad_token_id) == (154880, 4096, 154820)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (288, 8, 1)
    assert (c.moe_intermediate_size, c.routed_scaling_factor, c.n_group, c.topk_group) == (2048, 2.5, 1, 1)
    assert (c.num_attention_heads, c.num_key_value_heads, c.q_lora_rank, c.kv_lora_rank) == (64, 64, 1536, 512)
    assert (c.qk_nope_head_dim, c.v_head_dim, c.qk_rope_head_dim, c.qk_head_dim) == (256, 256, 0, 256)
    assert (c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim, c.linear_lower_bound) == (64, 128, 4, -5.0)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps) == (4, 20, 1e-6, 1e-5)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.index_kpool) == (32, 128, 2048, 4)
    assert c.index_kpool_always_select_tail is True and c.norm_topk_prob is True
    assert c.swiglu_limit == 10.0 and c.tie_word_embeddings is False


# Training fields transformers does not have (issue 6); their defaults keep inference behaviour.
TRAINING_FIELDS = {
    "router_z_loss_coef",
    "num_nextn_predict_layers",
    "mtp_depth",
    "mtp_loss_weight",
    "indexer_loss_weight",
    "indexer_loss_mode",
}


def test_defaults_agree_with_transformers_except_kpool():
    """transformers' Glm5NextTextConfig defaults to index_kpool 16; the released checkpoint uses 4."""
    ours, theirs = fields(Glm53Config()), hf_text_config()
    assert TRAINING_FIELDS <= set(ours) and not any(hasattr(theirs, k) for k in TRAINING_FIELDS)
    differing = {k for k, v in ours.items() if k not in TRAINING_FIELDS and getattr(theirs, k) != v}
    assert differing == {"index_kpool"}
    assert theirs.index_kpool == 16


def test_tiny_preset_is_small_and_complete():
    c = Glm53Config.tiny()
    assert c.hidden_size == 32 and c.num_hidden_layers == 4
    assert set(c.layer_types) == {KDA, MLA} and set(c.mlp_layer_types) == {"dense", "sparse"}
    assert Glm53Config.tiny(hc_mult=2).hc_mult == 2


# --------------------------------------------------------------------------------------------- from_dict
def test_from_dict_flat_and_nested_agree():
    text = dict(num_hidden_layers=4, hidden_size=64, vocab_size=500, pad_token_id=3, index_kpool=8, index_topk=16)
    flat = Glm53Config.from_dict(text)
    nested = Glm53Config.from_dict({"model_type": "glm5_next", "text_config": text, "vision_config": {"depth": 1}})
    assert fields(flat) == fields(nested)
    assert (flat.hidden_size, flat.vocab_size, flat.index_kpool, flat.num_hidden_layers) == (64, 500, 8, 4)
    assert nested.extra["_outer"] == {"model_type": "glm5_next", "vision_config": {"depth": 1}}


def test_nested_outer_tie_word_embeddings_wins():
    c = Glm53Config.from_dict(
        {"tie_word_embeddings": True, "text_config": {"num_hidden_layers": 4, "tie_word_embeddings": False}}
    )
    assert c.tie_word_embeddings is True


def test_from_dict_keeps_unknown_keys_and_drops_derived_ones():
    c = Glm53Config.from_dict(
        dict(num_hidden_layers=4, some_future_key=[1, 2], head_dim=0, qk_head_dim=256, transformers_version="5.23.0")
    )
    assert c.extra == {"some_future_key": [1, 2]}
    assert c.to_dict()["some_future_key"] == [1, 2]
    assert "head_dim" not in c.to_dict() and "transformers_version" not in c.to_dict()


@pytest.mark.parametrize("legacy", ["full_attention", "deepseek_sparse_attention"])
def test_legacy_layer_types(legacy):
    types = [KDA, KDA, legacy, KDA]
    c = Glm53Config.from_dict(dict(num_hidden_layers=4, layer_types=types))
    assert c.layer_types == [KDA, KDA, MLA, KDA]
    assert c.layer_types == hf_text_config(num_hidden_layers=4, layer_types=types).layer_types


PATTERNS = {
    "string-FSSF": "FSSFFSSF",
    "list": ["full", "shared", "full", "shared", "full", "full", "shared", "shared"],
}


@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_index_topk_pattern(pattern):
    types = [MLA] * 8
    c = Glm53Config.from_dict(dict(num_hidden_layers=8, layer_types=types, index_topk_pattern=pattern))
    expected = hf_text_config(num_hidden_layers=8, layer_types=types, index_topk_pattern=pattern).indexer_types
    assert c.indexer_types == expected
    assert c.indexer_types[:3] == ["full", "shared", "shared" if isinstance(pattern, str) else "full"]


def test_explicit_indexer_types_beat_the_pattern():
    types = ["shared", "shared", "full", "full"]
    c = Glm53Config.from_dict(dict(num_hidden_layers=4, indexer_types=types, index_topk_pattern="FSSS"))
    assert c.indexer_types == types


FREQ_CASES = [(1, 2), (2, 2), (3, 1), (0, 0), (4, 5), (2, 4)]


@pytest.mark.parametrize("freq,offset", FREQ_CASES, ids=[f"freq{f}-offset{o}" for f, o in FREQ_CASES])
def test_index_topk_freq_and_offset(freq, offset):
    kwargs = dict(num_hidden_layers=12, index_topk_freq=freq, index_skip_topk_offset=offset)
    c = Glm53Config.from_dict(kwargs)
    assert c.indexer_types == hf_text_config(**kwargs).indexer_types
    assert len(c.indexer_types) == 12


def test_index_topk_freq_default_offset():
    c = Glm53Config.from_dict(dict(num_hidden_layers=12, index_topk_freq=2))
    assert c.indexer_types == hf_text_config(num_hidden_layers=12, index_topk_freq=2).indexer_types
    assert c.indexer_types[:4] == ["full", "full", "shared", "full"]


LINEAR_CASES = {
    "sizes-bound": dict(head_dim=16, num_heads=3, short_conv_kernel_size=2, gate_lower_bound=-3.0),
    "no-bound-unsafe": dict(gate_lower_bound=None, safe_gate=False),
    "no-bound-safe": dict(gate_lower_bound=None),
}


@pytest.mark.parametrize("linear", LINEAR_CASES.values(), ids=LINEAR_CASES.keys())
def test_linear_attn_config(linear):
    c = Glm53Config.from_dict(dict(num_hidden_layers=4, linear_attn_config=linear))
    hf = hf_text_config(num_hidden_layers=4, linear_attn_config=linear)
    for name in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound"):
        assert getattr(c, name) == getattr(hf, name), name
    assert c.extra["linear_attn_config"] == linear
    assert c.to_dict()["linear_attn_config"] == linear


def test_linear_attn_config_expected_values():
    c = Glm53Config.from_dict(dict(num_hidden_layers=4, linear_attn_config=LINEAR_CASES["sizes-bound"]))
    assert (c.linear_head_dim, c.linear_num_heads, c.linear_conv_kernel_dim, c.linear_lower_bound) == (16, 3, 2, -3.0)
    assert (
        Glm53Config.from_dict(
            dict(num_hidden_layers=4, linear_attn_config=LINEAR_CASES["no-bound-unsafe"])
        ).linear_lower_bound
        is None
    )
    assert (
        Glm53Config.from_dict(
            dict(num_hidden_layers=4, linear_attn_config=LINEAR_CASES["no-bound-safe"])
        ).linear_lower_bound
        == -5.0
    )


def test_linear_attn_config_layer_lists_are_one_based():
    linear = dict(kda_layers=[1, 2, 4], full_attn_layers=[3])
    c = Glm53Config.from_dict(dict(num_hidden_layers=4, linear_attn_config=linear))
    assert c.layer_types == [KDA, KDA, MLA, KDA]


def test_linear_attn_config_conflicting_flat_field_raises():
    """transformers lets the dict win silently; glm53 refuses an ambiguous config, naming both values."""
    with pytest.raises(ValueError, match=r"linear_head_dim=32 disagrees with linear_attn_config\['head_dim'\]=16"):
        Glm53Config.from_dict(dict(num_hidden_layers=4, linear_head_dim=32, linear_attn_config={"head_dim": 16}))
    agree = Glm53Config.from_dict(dict(num_hidden_layers=4, linear_head_dim=16, linear_attn_config={"head_dim": 16}))
    assert agree.linear_head_dim == 16


def test_linear_attn_config_safe_gate_bounds_a_flat_none_like_transformers():
    d = dict(num_hidden_layers=4, linear_lower_bound=None, linear_attn_config={"head_dim": 128})
    assert Glm53Config.from_dict(d).linear_lower_bound == hf_text_config(**d).linear_lower_bound == -5.0
    d["linear_attn_config"] = {"safe_gate": False}
    assert Glm53Config.from_dict(d).linear_lower_bound is hf_text_config(**d).linear_lower_bound is None


# ------------------------------------------------------------------------------------------- round trips
ROUND_TRIP = {
    "defaults": {},
    "tiny": dict(vocab_size=320, hidden_size=32, num_hidden_layers=4, q_lora_rank=24, pad_token_id=0),
    "schedules": dict(
        num_hidden_layers=4,
        layer_types=[KDA, MLA, KDA, MLA],
        mlp_layer_types=["dense", "sparse"] * 2,
        indexer_types=["full", "full", "full", "shared"],
        linear_lower_bound=None,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("kwargs", ROUND_TRIP.values(), ids=ROUND_TRIP.keys())
def test_to_dict_round_trip(kwargs):
    c = Glm53Config(**kwargs)
    d = c.to_dict()
    assert Glm53Config.from_dict(d) == c
    assert json.loads(json.dumps(d)) == d  # JSON-serialisable
    assert Glm53Config.from_dict(json.loads(json.dumps(d))) == c


@pytest.mark.parametrize("kwargs", ROUND_TRIP.values(), ids=ROUND_TRIP.keys())
def test_official_dict_round_trip(kwargs):
    c = Glm53Config(**kwargs)
    official = c.to_official_dict()
    assert official["model_type"] == "glm5_next" and official["text_config"]["model_type"] == "glm5_next_text"
    assert official["tie_word_embeddings"] == c.tie_word_embeddings
    again = Glm53Config.from_dict(official)
    assert fields(again) == fields(c)
    assert again.to_official_dict() == official


def test_official_dict_loads_in_transformers():
    from transformers import Glm5NextConfig

    c = Glm53Config.tiny(
        layer_types=[KDA, MLA, KDA, MLA], indexer_types=["full", "full", "full", "shared"], linear_lower_bound=None
    )
    official = c.to_official_dict()
    hf = Glm5NextConfig(**{k: v for k, v in official.items() if k not in ("model_type", "architectures")})
    for name, value in fields(c).items():
        assert getattr(hf.text_config, name) == value, name


def test_from_pretrained_dir_and_file(tmp_path):
    c = Glm53Config.tiny()
    (tmp_path / "config.json").write_text(json.dumps(c.to_official_dict()))
    assert fields(Glm53Config.from_pretrained(tmp_path)) == fields(c)
    assert fields(Glm53Config.from_pretrained(str(tmp_path / "config.json"))) == fields(c)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json at"):
        Glm53Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        Glm53Config.from_pretrained(tmp_path)


@pytest.mark.parametrize("kpool", [4, 16], ids=lambda k: f"kpool{k}")
def test_config_saved_by_transformers(tmp_path, kpool):
    from transformers import Glm5NextConfig

    text = dict(
        num_hidden_layers=6,
        hidden_size=48,
        vocab_size=300,
        index_kpool=kpool,
        index_topk=32,
        indexer_types=["full", "full", "full", "full", "full", "full"],
        n_group=2,
        topk_group=1,
        linear_lower_bound=None,
        pad_token_id=1,
    )
    hf = Glm5NextConfig(text_config=text, vision_config=dict(depth=1), tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    c = Glm53Config.from_pretrained(tmp_path)
    for name, value in fields(c).items():
        if name in TRAINING_FIELDS:
            assert value == getattr(Glm53Config, name, value), name  # absent from transformers: our default
            continue
        expected = hf.tie_word_embeddings if name == "tie_word_embeddings" else getattr(hf.text_config, name)
        assert value == expected, name
    assert (c.index_kpool, c.num_hidden_layers, c.tie_word_embeddings, c.n_group) == (kpool, 6, True, 2)


# ------------------------------------------------------------------------------------------- validation
def tiny(**overrides):
    return Glm53Config.tiny(**overrides)


ERRORS = {
    "layer_types-length": (dict(layer_types=[KDA, MLA, KDA]), r"layer_types has 3 entries but num_hidden_layers is 4"),
    "mlp_layer_types-length": (
        dict(mlp_layer_types=["dense"] * 5),
        r"mlp_layer_types has 5 entries but num_hidden_layers is 4",
    ),
    "indexer_types-length": (dict(indexer_types=["full"]), r"indexer_types has 1 entries but num_hidden_layers is 4"),
    "unknown-layer-type": (
        dict(layer_types=[KDA, "mamba", KDA, MLA]),
        r"layer_types\[1\] is 'mamba'; expected one of \['linear_attention', 'indexed_attention'\]",
    ),
    "unknown-mlp-type": (
        dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]),
        r"mlp_layer_types\[1\] is 'moe'; expected one of \['dense', 'sparse'\]",
    ),
    "unknown-indexer-type": (
        dict(indexer_types=["full", "full", "full", "half"]),
        r"indexer_types\[3\] is 'half'; expected one of \['full', 'shared'\]",
    ),
    "topk-not-divisible-by-kpool": (
        dict(index_topk=10, index_kpool=4),
        r"index_topk \(10\) must be divisible by index_kpool \(4\)",
    ),
    "q_lora_rank-None": (dict(q_lora_rank=None), r"q_lora_rank is required by the DSA indexer .* got None"),
    "qk_rope_head_dim-positive": (dict(qk_rope_head_dim=64), r"qk_rope_head_dim must be 0 .* got 64"),
    "kv-heads-differ": (dict(num_key_value_heads=1), r"num_key_value_heads \(1\) must equal num_attention_heads \(2\)"),
    "shared-before-full": (
        dict(indexer_types=["shared", "shared", "shared", "shared"]),
        r"indexer_types\[3\] is 'shared' but no earlier indexed_attention layer has a 'full'",
    ),
    "shared-after-shared-only": (
        dict(layer_types=[MLA, KDA, KDA, MLA], indexer_types=["shared", "full", "full", "full"]),
        r"indexer_types\[0\] is 'shared' but no earlier",
    ),
    "num_hidden_layers-zero": (
        dict(num_hidden_layers=0, layer_types=[], mlp_layer_types=[]),
        r"num_hidden_layers must be a positive int, got 0",
    ),
    "hidden_size-zero": (dict(hidden_size=0), r"hidden_size must be a positive int, got 0"),
    "index_kpool-zero": (dict(index_kpool=0), r"index_kpool must be a positive int, got 0"),
    "hc_mult-bool": (dict(hc_mult=True), r"hc_mult must be a positive int, got True"),
    "experts-float": (dict(n_routed_experts=8.0), r"n_routed_experts must be a positive int, got 8.0"),
    "experts-not-divisible-by-groups": (dict(n_group=3), r"n_routed_experts \(8\) must be divisible by n_group \(3\)"),
    "topk_group-exceeds-groups": (dict(n_group=2, topk_group=3), r"topk_group \(3\) must not exceed n_group \(2\)"),
    "experts_per_tok-exceeds-experts": (
        dict(num_experts_per_tok=9),
        r"num_experts_per_tok \(9\) must not exceed n_routed_experts \(8\)",
    ),
    "one-expert-per-group": (dict(n_group=8), r"n_group \(8\) leaves fewer than 2 experts per group"),
    "groups-too-few-experts": (
        dict(n_group=4, topk_group=1, num_experts_per_tok=3),
        r"topk_group \(1\) groups hold fewer experts than num_experts_per_tok \(3\)",
    ),
    "hidden_act": (dict(hidden_act="gelu"), r"hidden_act must be 'silu', got 'gelu'"),
    "lower-bound-positive": (dict(linear_lower_bound=5.0), r"linear_lower_bound must be negative or None, got 5.0"),
    "swiglu_limit-zero": (dict(swiglu_limit=0.0), r"swiglu_limit must be positive, got 0.0"),
    "pad_token_id-out-of-range": (dict(pad_token_id=320), r"pad_token_id \(320\) must lie in \[0, vocab_size=320\)"),
}


@pytest.mark.parametrize("overrides,message", ERRORS.values(), ids=ERRORS.keys())
def test_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_validation_also_runs_on_replace():
    with pytest.raises(ValueError, match=r"index_topk \(6\) must be divisible by index_kpool \(4\)"):
        tiny().replace(index_topk=6)


DICT_ERRORS = {
    "not-a-dict": ([1, 2], r"config must be a dict, got list"),
    "pattern-bad-letter": (
        dict(num_hidden_layers=4, index_topk_pattern="FSXF"),
        r"index_topk_pattern 'FSXF' has characters other than 'F' and 'S': \['X'\]",
    ),
    "freq-not-int": (dict(num_hidden_layers=4, index_topk_freq="2"), r"index_topk_freq must be an int, got '2'"),
    "linear_attn_config-not-dict": (
        dict(num_hidden_layers=4, linear_attn_config=[1]),
        r"linear_attn_config must be a dict, got \[1\]",
    ),
    "linear_attn_config-layer-unlisted": (
        dict(num_hidden_layers=4, linear_attn_config=dict(kda_layers=[1, 2, 4])),
        r"linear_attn_config lists layer 3 in neither kda_layers nor full_attn_layers",
    ),
    "pattern-length": (
        dict(num_hidden_layers=4, index_topk_pattern="FS"),
        r"indexer_types has 2 entries but num_hidden_layers is 4",
    ),
}


@pytest.mark.parametrize("d,message", DICT_ERRORS.values(), ids=DICT_ERRORS.keys())
def test_from_dict_errors(d, message):
    with pytest.raises(ValueError, match=message):
        Glm53Config.from_dict(d)


ORACLE_REJECTS = {
    "kv-heads": dict(num_key_value_heads=1),
    "rope": dict(qk_rope_head_dim=64),
    "topk-kpool": dict(index_topk=10, index_kpool=4),
    "q_lora_rank-None": dict(q_lora_rank=None),
}


@pytest.mark.parametrize("overrides", ORACLE_REJECTS.values(), ids=ORACLE_REJECTS.keys())
def test_transformers_rejects_the_same_configs(overrides):
    """The checks transformers also makes: glm53 must reject at least what the oracle rejects."""
    from tests.helpers.oracle import hf_text_kwargs

    kwargs = hf_text_kwargs(Glm53Config.tiny())
    kwargs.update(overrides)
    with pytest.raises(StrictDataclassError):
        hf_text_config(**kwargs)
    with pytest.raises(ValueError):
        Glm53Config(**kwargs)


def test_outer_text_fields_that_text_config_contradicts_are_named_and_not_written_back():
    """The text model reads text_config only; an outer vocab_size that disagrees was accepted without a word and
    written back by every save, keeping the contradiction. Now: a warning naming both values, text_config's used,
    the outer one dropped; an outer field text_config lacks is said to be unread; agreeing duplicates are quiet."""
    import warnings as w

    from glm53 import Glm53Config as C

    text = C.tiny().to_dict()
    with pytest.warns(
        UserWarning, match=r"vocab_size=999 outside text_config contradicts text_config's vocab_size=320"
    ):
        config = C.from_dict({"text_config": text, "vocab_size": 999, "model_type": "glm5_next"})
    assert config.vocab_size == 320
    official = config.to_official_dict()
    assert "vocab_size" not in official and official["text_config"]["vocab_size"] == 320
    lacking = {k: v for k, v in text.items() if k != "rms_norm_eps"}
    with pytest.warns(UserWarning, match=r"rms_norm_eps=0\.5 sits outside text_config and is not read"):
        C.from_dict({"text_config": lacking, "rms_norm_eps": 0.5})
    with w.catch_warnings():
        w.simplefilter("error")
        assert C.from_dict({"text_config": text, "vocab_size": 320}).to_official_dict()["vocab_size"] == 320


# --------------------------------------------------------------------- special tokens, linear_attn_config, layer counts
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
