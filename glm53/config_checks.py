"""Type and range checks for Glm53Config fields (config.py calls them from `validate`).

No tensors here. Every field has one kind (`FIELD_KINDS`): a JSON `true` is not an int, a string "false" is not
a bool, an int is accepted where a float is meant (JSON writes 1e-5 and 1 alike) but never the other way round,
and every float is finite and inside its range. Errors are `ConfigError` naming the field and the bad value.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import ConfigError
from .utils import is_int, is_number

# kind -> (description for the message, predicate on an already type-checked value)
_POSITIVE_INT = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "index_topk",
    "index_head_dim",
    "index_n_heads",
    "index_kpool",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "linear_num_heads",
    "linear_head_dim",
    "linear_conv_kernel_dim",
    "hc_mult",
    "hc_sinkhorn_iters",
    "max_position_embeddings",
)
_NON_NEGATIVE_INT = ("n_shared_experts", "qk_rope_head_dim", "num_nextn_predict_layers")
_BOOL = (
    "attention_bias",
    "index_kpool_always_select_tail",
    "norm_topk_prob",
    "output_router_logits",
    "tie_word_embeddings",
    "use_cache",
)
# float fields: (low, low inclusive, high, high inclusive); None = unbounded on that side
_FLOAT_RANGES: dict[str, tuple[float | None, bool, float | None, bool]] = {
    "rms_norm_eps": (0.0, False, None, False),
    "hc_eps": (0.0, False, None, False),
    "swiglu_limit": (0.0, False, None, False),
    "routed_scaling_factor": (0.0, False, None, False),
    "initializer_range": (0.0, True, None, False),
    "attention_dropout": (0.0, True, 1.0, False),
    "router_aux_loss_coef": (0.0, True, None, False),
    "router_z_loss_coef": (0.0, True, None, False),
    "mtp_loss_weight": (0.0, True, None, False),
    "indexer_loss_weight": (0.0, True, None, False),
    "linear_lower_bound": (None, False, 0.0, False),  # None (the softplus gate) is checked before
}
_STR = ("hidden_act", "indexer_loss_mode")
_LIST_OF_STR = ("layer_types", "mlp_layer_types", "indexer_types")
_OPTIONAL_TOKEN_ID = ("pad_token_id", "bos_token_id")

# Keys a config.json may carry that the text model does not read and that are no reason to warn: what
# transformers' PreTrainedConfig writes for every model, and DeepSeek-lineage release keys.
KNOWN_EXTRA_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "dtype",
        "torch_dtype",
        "id2label",
        "label2id",
        "is_encoder_decoder",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
        "head_dim",
        "qk_head_dim",
        "quantization_config",
        "first_k_dense_replace",
        "moe_layer_freq",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "scoring_func",
        "topk_method",
        "ep_size",
        "num_experts",
        "tokenizer_class",
        "sep_token_id",
        "decoder_start_token_id",
        "task_specific_params",
        "prefix",
        "index_topk_pattern",
        "index_topk_freq",
        "index_skip_topk_offset",
        "linear_attn_config",
    }
)


def _in_range(value: float, spec: tuple[float | None, bool, float | None, bool]) -> bool:
    low, low_in, high, high_in = spec
    if low is not None and not (value >= low if low_in else value > low):
        return False
    return high is None or (value <= high if high_in else value < high)


def _range_text(spec: tuple[float | None, bool, float | None, bool]) -> str:
    low, low_in, high, high_in = spec
    if high is None:
        return f"{'>=' if low_in else '>'} {low:g}"
    if low is None:
        return f"{'<=' if high_in else '<'} {high:g}"
    return f"in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


def check_ints(cfg: Any) -> None:
    for name in _POSITIVE_INT:
        value = getattr(cfg, name)
        if not is_int(value) or value < 1:
            raise ConfigError(f"{name} must be a positive int, got {value!r}")
    for name in _NON_NEGATIVE_INT:
        value = getattr(cfg, name)
        if not is_int(value) or value < 0:
            raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    if cfg.q_lora_rank is None or not is_int(cfg.q_lora_rank) or cfg.q_lora_rank < 1:
        raise ConfigError(
            f"q_lora_rank is required by the DSA indexer and must be a positive int, got {cfg.q_lora_rank!r}"
        )
    if not is_int(cfg.mtp_depth) or cfg.mtp_depth < 1:
        raise ConfigError(f"mtp_depth must be an int >= 1, got {cfg.mtp_depth!r}")


def check_bools_and_strings(cfg: Any) -> None:
    for name in _BOOL:
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be a bool (true/false), got {value!r} ({type(value).__name__})")
    for name in _STR:
        value = getattr(cfg, name)
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r} ({type(value).__name__})")


def check_floats(cfg: Any) -> None:
    for name, spec in _FLOAT_RANGES.items():
        value = getattr(cfg, name)
        if value is None and name == "linear_lower_bound":
            continue
        if not is_number(value):
            raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        if not math.isfinite(value) or not _in_range(value, spec):
            if name == "linear_lower_bound":
                raise ConfigError(f"linear_lower_bound must be negative or None, got {value!r}")
            if name == "swiglu_limit":
                raise ConfigError(f"swiglu_limit must be positive, got {value!r}")
            raise ConfigError(f"{name} must be a finite number {_range_text(spec)}, got {value!r}")


def check_special_token_ids(cfg: Any) -> None:
    """pad/bos/eos (and the other special ids) of a config: non-negative ints inside the vocabulary, or None."""
    for name in _OPTIONAL_TOKEN_ID:
        value = getattr(cfg, name)
        if value is not None and (not is_int(value) or value < 0):
            raise ConfigError(f"{name} must be a non-negative int or None, got {value!r}")
    eos = cfg.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(is_int(i) and i >= 0 for i in eos_ids):
        raise ConfigError(f"eos_token_id must be a non-negative int, a list of them or None, got {eos!r}")
    # Every special id indexes the embedding and the head: one past the vocabulary is never produced (EOS would
    # never stop generation) or fails deep in nn.Embedding.
    for name in (*_OPTIONAL_TOKEN_ID, "eos_token_id"):
        value = getattr(cfg, name)
        for i in value if isinstance(value, list) else [] if value is None else [value]:
            if not i < cfg.vocab_size:
                raise ConfigError(f"{name} ({value!r}) must lie in [0, vocab_size={cfg.vocab_size})")


def check_list_fields(cfg: Any) -> None:
    """The per-layer schedules are lists (or tuples) of strings; before __post_init__ copies them."""
    for name in _LIST_OF_STR:
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list of strings (one per layer) or None, got {value!r}")
        for i, item in enumerate(value or ()):
            if not isinstance(item, str):
                raise ConfigError(f"{name}[{i}] must be a string, got {item!r} ({type(item).__name__})")


def check_extra(extra: Any) -> None:
    if not isinstance(extra, dict):
        raise ConfigError(f"extra must be a dict, got {type(extra).__name__}")


def unknown_keys(keys: Any) -> list[str]:
    """The keys of a text config that neither the model nor KNOWN_EXTRA_KEYS account for."""
    return sorted(k for k in keys if k not in KNOWN_EXTRA_KEYS)


__all__ = [
    "KNOWN_EXTRA_KEYS",
    "check_ints",
    "check_bools_and_strings",
    "check_floats",
    "check_special_token_ids",
    "check_list_fields",
    "check_extra",
    "unknown_keys",
]
