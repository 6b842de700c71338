"""Glm53Config: the text model's hyper-parameters, named as transformers' `Glm5NextTextConfig` names them.

Defaults describe the released GLM-5.3-Flash (docs/model.md). `from_dict` accepts what the release and
transformers write: a nested `text_config` (multimodal `glm5_next`) or a flat text-only config, legacy layer-type
names, the `index_topk_pattern` / `index_topk_freq` / `index_skip_topk_offset` schedules and the
`linear_attn_config` dict. Keys the text model does not use are kept in `extra` so `to_dict()` round-trips.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from .config_checks import (
    check_bools_and_strings,
    check_extra,
    check_floats,
    check_ints,
    check_list_fields,
    check_special_token_ids,
    unknown_keys,
)
from .errors import ConfigError
from .utils import is_int

LINEAR_ATTENTION = "linear_attention"  # KDA layer
INDEXED_ATTENTION = "indexed_attention"  # NoPE MLA + DSA indexer layer
LAYER_TYPES = (LINEAR_ATTENTION, INDEXED_ATTENTION)
# Names older checkpoints use for the MLA+DSA layer (transformers maps both to "indexed_attention").
LEGACY_LAYER_TYPES = {"full_attention": INDEXED_ATTENTION, "deepseek_sparse_attention": INDEXED_ATTENTION}
MLP_TYPES = ("dense", "sparse")
SAFE_GATE_LOWER_BOUND = -5.0  # the KDA gate bound a `linear_attn_config` with safe_gate implies (transformers)
INDEXER_TYPES = ("full", "shared")
INDEXER_LOSS_MODES = ("dense", "sparse")

# Keys of a config.json that describe the checkpoint, not the text model; accepted and dropped.
_IGNORED_KEYS = {"head_dim", "qk_head_dim", "model_type", "transformers_version", "architectures"}


@dataclass
class Glm53Config:
    # --- sizes ---
    vocab_size: int = 154880  # token vocabulary
    hidden_size: int = 4096  # model width D
    intermediate_size: int = 12288  # width of the dense SwiGLU MLPs
    moe_intermediate_size: int = 2048  # width of each routed expert (and of each shared expert)
    num_hidden_layers: int = 45  # decoder blocks (the MTP layer is stored after them, as layers.{N})
    # --- NoPE MLA ---
    num_attention_heads: int = 64  # MLA heads
    num_key_value_heads: int = 64  # must equal num_attention_heads (MLA has no GQA here)
    q_lora_rank: int | None = 1536  # query low-rank width (required: the indexer reads it)
    kv_lora_rank: int = 512  # compressed KV latent width
    qk_nope_head_dim: int = 256  # per-head query/key width (all NoPE)
    qk_rope_head_dim: int = 0  # rotary part of q/k; GLM-5.3 is NoPE, so it must be 0
    v_head_dim: int = 256  # per-head value width
    attention_bias: bool = False  # bias on q_a_proj, kv_a_proj_with_mqa and o_proj
    attention_dropout: float = 0.0  # dropout on attention probabilities (training only)
    # --- DSA indexer ---
    index_topk: int = 2048  # tokens each query may attend to (before the tail)
    index_head_dim: int = 128  # indexer head width
    index_n_heads: int = 32  # indexer heads
    index_kpool: int = 4  # consecutive tokens pooled into one candidate (released checkpoint: 4)
    index_kpool_always_select_tail: bool = True  # also attend to the visible incomplete pool
    indexer_types: list[str] | None = None  # per layer "full" (run the indexer) or "shared" (reuse top-k)
    # --- MoE ---
    n_routed_experts: int = 288  # routed experts per MoE layer
    n_shared_experts: int = 1  # shared experts (fused into one MLP of width n * moe_intermediate_size)
    num_experts_per_tok: int = 8  # experts each token is routed to
    n_group: int = 1  # expert groups for group-limited routing
    topk_group: int = 1  # groups each token may use
    routed_scaling_factor: float = 2.5  # multiplier on the routing weights
    norm_topk_prob: bool = True  # renormalise the chosen experts' scores to sum to 1
    router_aux_loss_coef: float = 0.001  # weight of the sequence-wise balance loss (training, with labels)
    router_z_loss_coef: float = 0.0  # weight of the router z-loss (training, with labels); 0 = off
    output_router_logits: bool = False  # return router logits from forward
    # --- layer schedule ---
    layer_types: list[str] | None = None  # per layer "linear_attention" (KDA) or "indexed_attention" (MLA)
    mlp_layer_types: list[str] | None = None  # per layer "dense" or "sparse" (MoE)
    # --- KDA ---
    linear_num_heads: int = 64  # KDA heads
    linear_head_dim: int = 128  # KDA head width (keys and values)
    linear_conv_kernel_dim: int = 4  # causal depthwise conv width on q, k, v
    linear_lower_bound: float | None = -5.0  # forget-gate lower bound; None selects the softplus gate
    # --- mHC ---
    hc_mult: int = 4  # residual streams N
    hc_eps: float = 1e-6  # floor in the mHC pre/comb weights and Sinkhorn
    hc_sinkhorn_iters: int = 20  # Sinkhorn iterations on the comb matrix
    # --- training (losses.py, mtp.py; defaults keep inference unchanged) ---
    num_nextn_predict_layers: int = 0  # MTP layers stored as layers.{N}, layers.{N+1}, ... (0 = no MTP module)
    mtp_depth: int = 1  # future tokens the MTP predicts; depth d uses MTP layer min(d, layers - 1)
    mtp_loss_weight: float = 0.1  # weight of the MTP loss (mean over depths) in .loss
    indexer_loss_weight: float = 0.0  # weight of the DSA indexer KL loss in .loss (0 = not computed)
    indexer_loss_mode: str = "dense"  # "dense": KL over every candidate pool; "sparse": over the selected pools
    # --- misc ---
    hidden_act: str = "silu"  # activation of SwiGLU and the KDA convs (only "silu" is supported)
    swiglu_limit: float = 10.0  # clamp on SwiGLU gate (above) and up (both sides)
    rms_norm_eps: float = 1e-5  # epsilon of every RMSNorm (and of mHC's unweighted input norm)
    initializer_range: float = 0.02  # std of normal weight init
    max_position_embeddings: int = 1048576  # informational: NoPE has no position table
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    pad_token_id: int | None = 154820  # padding token (its embedding row is zero-initialised)
    bos_token_id: int | None = None  # informational
    eos_token_id: int | list[int] | None = None  # informational
    use_cache: bool = True  # informational (glm53 has no generation cache yet)
    # Keys of the source config that the text model does not use, kept verbatim for round trips.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not is_int(n) or n < 1:
            raise ConfigError(f"num_hidden_layers must be a positive int, got {n!r}")
        check_list_fields(self)
        if self.layer_types is None:
            self.layer_types = [LINEAR_ATTENTION if i % 4 != 3 else INDEXED_ATTENTION for i in range(n)]
        else:
            self.layer_types = [LEGACY_LAYER_TYPES.get(t, t) for t in self.layer_types]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        self.layer_types = list(self.layer_types)
        self.mlp_layer_types = list(self.mlp_layer_types)
        self.indexer_types = list(self.indexer_types)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == INDEXED_ATTENTION]

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ConfigError (a ValueError) naming the first bad field and its value."""
        check_ints(self)
        check_bools_and_strings(self)
        check_floats(self)
        check_special_token_ids(self)
        check_list_fields(self)
        check_extra(self.extra)
        self._validate_schedules()
        self._validate_attention()
        self._validate_experts()
        self._validate_training()
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act must be 'silu', got {self.hidden_act!r}")

    def _validate_schedules(self) -> None:
        """Per-layer lists: one entry per layer, known names, a 'full' indexer before every 'shared' one."""
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            value = getattr(self, name)
            if len(value) != n:
                raise ConfigError(f"{name} has {len(value)} entries but num_hidden_layers is {n}: {value!r}")
        for name, allowed in (
            ("layer_types", LAYER_TYPES),
            ("mlp_layer_types", MLP_TYPES),
            ("indexer_types", INDEXER_TYPES),
        ):
            for i, value in enumerate(getattr(self, name)):
                if value not in allowed:
                    raise ConfigError(f"{name}[{i}] is {value!r}; expected one of {list(allowed)}")
        seen_full = False
        for i in self.attention_layers:
            if self.indexer_types[i] == "full":
                seen_full = True
            elif not seen_full:
                raise ConfigError(
                    f"indexer_types[{i}] is 'shared' but no earlier indexed_attention layer has a 'full' indexer "
                    f"to share top-k from: {self.indexer_types!r}"
                )

    def _validate_attention(self) -> None:
        if self.num_attention_heads != self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads ({self.num_key_value_heads!r}) must equal num_attention_heads "
                f"({self.num_attention_heads!r})"
            )
        if self.qk_rope_head_dim != 0:
            raise ConfigError(f"qk_rope_head_dim must be 0 (GLM-5.3 attention is NoPE), got {self.qk_rope_head_dim!r}")
        if self.index_topk % self.index_kpool != 0:
            raise ConfigError(
                f"index_topk ({self.index_topk!r}) must be divisible by index_kpool ({self.index_kpool!r})"
            )

    def _validate_experts(self) -> None:
        if self.n_routed_experts % self.n_group != 0:
            raise ConfigError(
                f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group!r})"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group!r}) must not exceed n_group ({self.n_group})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok!r}) must not exceed n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.n_routed_experts // self.n_group < 2 and self.n_group > 1:
            raise ConfigError(
                f"n_group ({self.n_group!r}) leaves fewer than 2 experts per group; group scores sum "
                f"the top-2 experts of each group"
            )
        if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
            raise ConfigError(
                f"topk_group ({self.topk_group!r}) groups hold fewer experts than num_experts_per_tok "
                f"({self.num_experts_per_tok})"
            )

    def _validate_training(self) -> None:
        if self.num_nextn_predict_layers > self.mtp_depth:
            raise ConfigError(
                f"num_nextn_predict_layers ({self.num_nextn_predict_layers}) must not exceed "
                f"mtp_depth ({self.mtp_depth!r}): an MTP layer past the last depth would never be "
                f"used"
            )
        if self.indexer_loss_mode not in INDEXER_LOSS_MODES:
            raise ConfigError(
                f"indexer_loss_mode is {self.indexer_loss_mode!r}; expected one of {list(INDEXER_LOSS_MODES)}"
            )

    # ------------------------------------------------------------ conversions
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Glm53Config":
        """Build from a config dict: nested (`text_config`) or flat, in transformers' or the release's spelling."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a dict, got {type(d).__name__}")
        outer: dict[str, Any] = {}
        if "text_config" in d and not isinstance(d["text_config"], dict):
            raise ConfigError(
                f"text_config must be a dict (the text model's config), got "
                f"{type(d['text_config']).__name__}: {d['text_config']!r}"
            )
        if isinstance(d.get("text_config"), dict):
            text = dict(d["text_config"])
            outer = {k: v for k, v in d.items() if k != "text_config"}
            # The multimodal wrapper's own tie_word_embeddings decides whether lm_head is tied.
            if "tie_word_embeddings" in outer:
                text["tie_word_embeddings"] = outer.pop("tie_word_embeddings")
        else:
            text = dict(d)
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        layers = text.get("num_hidden_layers", 45)
        if not is_int(layers) or layers < 1:  # before the schedules below are built from it
            raise ConfigError(f"num_hidden_layers must be a positive int, got {layers!r}")
        schedule = {
            k: text.pop(k) for k in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset") if k in text
        }
        linear = text.pop("linear_attn_config", None)
        for key, value in text.items():
            if key in names:
                kwargs[key] = value
            elif key not in _IGNORED_KEYS or key in ("model_type", "architectures"):
                extra[key] = value
        if unknown := unknown_keys(extra):
            # Release configs carry keys glm53 does not read: kept (to_dict round-trips them), not an error.
            warnings.warn(f"config keys glm53 does not use (kept, ignored): {unknown}", stacklevel=2)
        if linear is not None:
            if not isinstance(linear, dict):
                raise ConfigError(f"linear_attn_config must be a dict, got {linear!r}")
            extra["linear_attn_config"] = linear
            _apply_linear_attn_config(kwargs, linear)
        if kwargs.get("indexer_types") is None and schedule:
            extra.update({f"_schedule.{k}": v for k, v in schedule.items()})
            kwargs["indexer_types"] = _indexer_schedule(schedule, kwargs.get("num_hidden_layers", 45))
        if outer:
            extra["_outer"] = _drop_contradictions(outer, d["text_config"], names)
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The flat text config (transformers' field names) plus the preserved extra keys."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out = {k: (list(v) if isinstance(v, list) else v) for k, v in out.items()}
        for key, value in self.extra.items():
            if key.startswith("_"):
                continue
            out.setdefault(key, value)
        return out

    def to_official_dict(self) -> dict[str, Any]:
        """config.json as the release and transformers write it: `glm5_next` with a nested `text_config`."""
        text = self.to_dict()
        text["model_type"] = "glm5_next_text"
        text.pop("architectures", None)
        text["head_dim"] = self.qk_rope_head_dim
        text["qk_head_dim"] = self.qk_head_dim
        outer = dict(self.extra.get("_outer", {}))
        outer.update(
            model_type="glm5_next",
            architectures=["Glm5NextForConditionalGeneration"],
            tie_word_embeddings=self.tie_word_embeddings,
            text_config=text,
        )
        return outer

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Glm53Config":
        """Read a checkpoint directory's config.json, or a config.json path."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a checkpoint directory or config.json path, got {type(path).__name__}")
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json at {file}")
        if os.path.isdir(path):  # a checkpoint's config.json symlinked out of it would read any file on the machine
            from .checkpoint.paths import confined

            confined(path, "config.json", path)
        try:
            with open(file, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{file} is not UTF-8 text: {e}") from e
        except OSError as e:
            raise ConfigError(f"{file} cannot be read: {e.strerror or e}") from e
        return cls.from_dict(d)

    def replace(self, **changes: Any) -> "Glm53Config":
        """A copy with some fields changed (re-validated)."""
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- presets
    @classmethod
    def tiny(cls, **overrides: Any) -> "Glm53Config":
        """A few-thousand-parameter model with every feature on: for tests, demos and debugging."""
        base = dict(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            v_head_dim=8,
            index_topk=8,
            index_head_dim=8,
            index_n_heads=4,
            index_kpool=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            linear_num_heads=2,
            linear_head_dim=8,
            pad_token_id=0,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        )
        base.update(overrides)
        return cls(**base)


def _drop_contradictions(outer: dict[str, Any], text: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """`outer` without the text-model fields that `text_config` contradicts, with one warning naming each.

    The text model reads `text_config` only (transformers' Glm5NextTextModel too): an outer `vocab_size` that
    disagrees with it changes nothing, and writing both back would keep the contradiction in every later save.
    An outer text field `text_config` lacks is not read either (the text default applies): said, and kept.
    """
    kept = {}
    for key, value in outer.items():
        if key not in names or key == "tie_word_embeddings":
            kept[key] = value
        elif key not in text:
            warnings.warn(
                f"config key {key}={value!r} sits outside text_config and is not read (the text model "
                f"reads text_config, whose default applies); move it into text_config",
                stacklevel=3,
            )
            kept[key] = value
        elif text[key] != value:
            warnings.warn(
                f"config key {key}={value!r} outside text_config contradicts text_config's "
                f"{key}={text[key]!r}: text_config's is used and the outer one dropped",
                stacklevel=3,
            )
        else:
            kept[key] = value
    return kept


def _apply_linear_attn_config(kwargs: dict[str, Any], linear: dict[str, Any]) -> None:
    """Map the release's `linear_attn_config` onto the flat fields (explicit flat fields win)."""
    mapping = {
        "head_dim": "linear_head_dim",
        "num_heads": "linear_num_heads",
        "short_conv_kernel_size": "linear_conv_kernel_dim",
        "gate_lower_bound": "linear_lower_bound",
    }
    for src, dst in mapping.items():
        if src not in linear:
            continue
        if dst in kwargs and kwargs[dst] != linear[src]:
            # transformers silently lets the dict win; an ambiguous checkpoint config is an error here.
            raise ConfigError(f"{dst}={kwargs[dst]!r} disagrees with linear_attn_config[{src!r}]={linear[src]!r}")
        kwargs[dst] = linear[src]
    if not isinstance(linear.get("safe_gate", True), bool):
        raise ConfigError(f"linear_attn_config['safe_gate'] must be a bool, got {linear['safe_gate']!r}")
    for name in ("kda_layers", "full_attn_layers"):
        listed = linear.get(name, [])
        if not isinstance(listed, list) or not all(is_int(i) for i in listed):
            raise ConfigError(f"linear_attn_config[{name!r}] must be a list of 1-based layer numbers, got {listed!r}")
        outside = [i for i in listed if not 1 <= i <= kwargs.get("num_hidden_layers", 45)]
        if outside:
            raise ConfigError(
                f"linear_attn_config[{name!r}] names layers {outside} outside 1.."
                f"{kwargs.get('num_hidden_layers', 45)} (num_hidden_layers)"
            )
    both = sorted(set(linear.get("kda_layers", [])) & set(linear.get("full_attn_layers", [])))
    if both:
        raise ConfigError(f"linear_attn_config lists layers {both} in both kda_layers and full_attn_layers")
    # transformers: a "safe gate" (the dict's default) always has a bound; with none given it is -5.
    if linear.get("safe_gate", True) and kwargs.get("linear_lower_bound", -5.0) is None:
        kwargs["linear_lower_bound"] = SAFE_GATE_LOWER_BOUND
    n = kwargs.get("num_hidden_layers", 45)
    if "layer_types" not in kwargs and ("kda_layers" in linear or "full_attn_layers" in linear):
        # Release configs number layers from 1 in these lists.
        kda = set(linear.get("kda_layers", []))
        full = set(linear.get("full_attn_layers", []))
        types = []
        for i in range(n):
            if i + 1 in kda:
                types.append(LINEAR_ATTENTION)
            elif i + 1 in full:
                types.append(INDEXED_ATTENTION)
            else:
                raise ConfigError(f"linear_attn_config lists layer {i + 1} in neither kda_layers nor full_attn_layers")
        kwargs["layer_types"] = types


def _indexer_schedule(schedule: dict[str, Any], n: int) -> list[str]:
    """indexer_types from `index_topk_pattern` ("FSSF..." or a list) or `index_topk_freq`/`index_skip_topk_offset`."""
    pattern = schedule.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, (str, list)):
            raise ConfigError(f"index_topk_pattern must be a string of 'F'/'S' or a list, got {pattern!r}")
        if isinstance(pattern, str):
            letters = {"F": "full", "S": "shared"}
            bad = [c for c in pattern if c not in letters]
            if bad:
                raise ConfigError(f"index_topk_pattern {pattern!r} has characters other than 'F' and 'S': {bad}")
            return [letters[c] for c in pattern]
        return list(pattern)
    freq = schedule.get("index_topk_freq", 1)
    if not is_int(freq):
        raise ConfigError(f"index_topk_freq must be an int, got {freq!r}")
    freq = max(freq, 1)  # transformers clamps a freq below 1 to 1
    offset = schedule.get("index_skip_topk_offset", 2)
    if not is_int(offset):
        raise ConfigError(f"index_skip_topk_offset must be an int, got {offset!r}")
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


__all__ = ["Glm53Config", "LINEAR_ATTENTION", "INDEXED_ATTENTION"]
