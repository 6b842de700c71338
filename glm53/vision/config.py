"""Glm53VisionConfig (the `vision_config` of a glm5_next config.json) and the multimodal token ids.

Field names, defaults and aliases are transformers' `Glm5NextVisionConfig`: `num_attention_heads` is read as
`num_heads` and `num_hidden_layers` as `depth`; `rope_parameters` is filled with the axial rope (theta 10000)
when absent. The six token ids (`image_token_id`, ...) live in the outer config beside `text_config`. Both are
kept in the text config's `extra["_outer"]` (config.py keeps parsing VL configs as it always did); `vision_parts`
reads them back and `with_vision` writes them in. Every error names the field and its value.
Legend: D tower width (hidden_size), H heads, hd head width D/H, O out width (out_hidden_size).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import Glm53Config
from ..errors import ConfigError
from ..utils import is_int

VISION_MODEL_TYPE = "glm5_next_vision"
DEFAULT_ROPE = {"rope_theta": 10000.0, "rope_type": "axial"}
ALIASES = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}
_POSITIVE_INTS = (
    "depth",
    "hidden_size",
    "num_heads",
    "in_channels",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "out_hidden_size",
    "intermediate_size",
    "projection_intermediate_size",
)


@dataclass
class Glm53VisionConfig:
    depth: int = 24  # vision blocks
    hidden_size: int = 1024  # tower width D
    hidden_act: str = "silu"  # SwiGLU activation (only "silu")
    attention_bias: bool = True  # biases on qkv, proj and the block MLP's three projections
    attention_dropout: float = 0.0  # read by transformers only for flash attention in training; must be 0 here
    num_heads: int = 16  # attention heads H (head width D / H, a multiple of 4 for the axial rope)
    in_channels: int = 3  # image channels C
    image_size: int | list[int] = 336  # informational (the model takes any grid)
    patch_size: int = 14  # patch side P in pixels
    rms_norm_eps: float = 1e-5  # eps of every vision RMSNorm (block norms, q/k norms, post_layernorm)
    spatial_merge_size: int = 2  # m: m x m patches merge into one text token
    temporal_patch_size: int = 2  # T: frames per patch (an image is repeated T times)
    out_hidden_size: int = 1536  # O: width of the merged features (must equal the text hidden size)
    intermediate_size: int = 4096  # block MLP inner width
    initializer_range: float = 0.02  # std of normal weight init
    rope_parameters: dict | None = None  # {"rope_type": "axial", "rope_theta": ...}; filled when absent
    projection_intermediate_size: int = 10240  # merger SwiGLU inner width
    swiglu_limit: float = 10.0  # clamp on SwiGLU gate (above) and up (both sides), blocks and merger
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # other on-disk keys, kept for round trips

    def __post_init__(self) -> None:
        if self.rope_parameters is None:
            self.rope_parameters = dict(DEFAULT_ROPE)
        elif isinstance(self.rope_parameters, dict):
            self.rope_parameters = {**self.rope_parameters}
            self.rope_parameters.setdefault("rope_type", DEFAULT_ROPE["rope_type"])
            self.rope_parameters.setdefault("rope_theta", DEFAULT_ROPE["rope_theta"])
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def patch_width(self) -> int:
        """Values per pixel row: C * T * P * P (1176 for the release)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field (`vision_config.<field>`) and its value."""
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"vision_config.{name} must be a positive int, got {value!r}")
        for name in ("rms_norm_eps", "swiglu_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"vision_config.{name} must be a positive finite number, got {value!r}")
        value = self.initializer_range
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"vision_config.initializer_range must be a finite number >= 0, got {value!r}")
        if isinstance(self.attention_dropout, bool) or self.attention_dropout != 0:
            raise ConfigError(
                f"vision_config.attention_dropout must be 0 (the tower has no dropout in glm53), got "
                f"{self.attention_dropout!r}"
            )
        if not isinstance(self.attention_bias, bool):
            raise ConfigError(f"vision_config.attention_bias must be true or false, got {self.attention_bias!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"vision_config.hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.hidden_size % self.num_heads != 0:
            raise ConfigError(
                f"vision_config.num_heads ({self.num_heads}) must divide vision_config.hidden_size ({self.hidden_size})"
            )
        if self.head_dim % 4 != 0:
            raise ConfigError(
                f"vision_config head width hidden_size / num_heads = {self.head_dim} must be divisible "
                f"by 4 (the axial rope splits it into row and column halves of pairs)"
            )
        rope = self.rope_parameters
        if not isinstance(rope, dict):
            raise ConfigError(f"vision_config.rope_parameters must be a dict, got {rope!r}")
        if rope.get("rope_type") != "axial":
            raise ConfigError(
                f"vision_config.rope_parameters['rope_type'] must be 'axial', got {rope.get('rope_type')!r}"
            )
        theta = rope.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
            raise ConfigError(f"vision_config.rope_parameters['rope_theta'] must be a finite number > 1, got {theta!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Glm53VisionConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"vision_config must be a dict, got {type(d).__name__}: {d!r}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        if d.get("model_type", VISION_MODEL_TYPE) != VISION_MODEL_TYPE:
            raise ConfigError(f"vision_config.model_type must be {VISION_MODEL_TYPE!r}, got {d['model_type']!r}")
        for key, value in d.items():
            if key == "model_type":
                continue
            target = ALIASES.get(key, key)
            if target in names:
                if target in kwargs and kwargs[target] != value:
                    raise ConfigError(
                        f"vision_config sets {target}={kwargs[target]!r} and its alias {key}={value!r}; they disagree"
                    )
                kwargs[target] = value
            else:
                extra[key] = value
        if "head_dim" in extra and extra["head_dim"] != kwargs.get("hidden_size", 1024) // kwargs.get("num_heads", 16):
            raise ConfigError(
                f"vision_config.head_dim={extra['head_dim']!r} disagrees with hidden_size / num_heads "
                f"(transformers would use head_dim; glm53 does not support that)"
            )
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The on-disk `vision_config` (transformers' names, model_type included)."""
        out = dict(self.extra)
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        out["rope_parameters"] = dict(self.rope_parameters)
        out["model_type"] = VISION_MODEL_TYPE
        return out


TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "image_start_token_id",
    "image_end_token_id",
    "video_start_token_id",
    "video_end_token_id",
)


@dataclass(frozen=True)
class MultimodalTokenIds:
    image_token_id: int = 154854  # <|image|>: the placeholder of image AND video-frame features
    video_token_id: int = 154855  # <|video|>: a pre-expansion marker (never in processed ids)
    image_start_token_id: int = 154830  # <|begin_of_image|>
    image_end_token_id: int = 154831  # <|end_of_image|>
    video_start_token_id: int = 154832  # <|begin_of_video|>: opens a video span (placeholders inside are frames)
    video_end_token_id: int = 154833  # <|end_of_video|>

    @classmethod
    def from_outer(cls, outer: dict[str, Any]) -> "MultimodalTokenIds":
        return cls(**{name: outer[name] for name in TOKEN_FIELDS if name in outer})

    def check(self, vocab_size: int) -> None:
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or not 0 <= value < vocab_size:
                raise ConfigError(f"{name} must be a token id in [0, vocab_size={vocab_size}), got {value!r}")

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in TOKEN_FIELDS}


def has_vision(config: Glm53Config) -> bool:
    """Whether the config declares a vision tower (an outer `vision_config`)."""
    return isinstance(config.extra.get("_outer", {}).get("vision_config"), dict)


def vision_parts(config: Glm53Config) -> tuple[Glm53VisionConfig, MultimodalTokenIds]:
    """The vision config and token ids a VL text config carries; raises ConfigError when they do not fit it."""
    outer = config.extra.get("_outer", {})
    if "vision_config" not in outer:
        raise ConfigError(
            "config has no vision_config: a text-only checkpoint (use Glm53ForCausalLM, or "
            "glm53.vision.with_vision to add a tower)"
        )
    vision = Glm53VisionConfig.from_dict(outer["vision_config"])
    tokens = MultimodalTokenIds.from_outer(outer)
    check_fits(config, vision, tokens)
    return vision, tokens


def check_fits(config: Glm53Config, vision: Glm53VisionConfig, tokens: MultimodalTokenIds) -> None:
    if vision.out_hidden_size != config.hidden_size:
        raise ConfigError(
            f"vision_config.out_hidden_size ({vision.out_hidden_size!r}) must equal the text "
            f"hidden_size ({config.hidden_size}): the merged image features replace token "
            f"embeddings"
        )
    tokens.check(config.vocab_size)


def with_vision(
    config: Glm53Config, vision: Glm53VisionConfig | dict, tokens: MultimodalTokenIds | dict | None = None
) -> Glm53Config:
    """A copy of the text `config` declaring `vision` and the token ids (validated against it)."""
    vision = vision if isinstance(vision, Glm53VisionConfig) else Glm53VisionConfig.from_dict(vision)
    if tokens is None:
        tokens = MultimodalTokenIds.from_outer(config.extra.get("_outer", {}))
    tokens = tokens if isinstance(tokens, MultimodalTokenIds) else MultimodalTokenIds(**tokens)
    check_fits(config, vision, tokens)
    outer = {**config.extra.get("_outer", {}), "vision_config": vision.to_dict(), **tokens.to_dict()}
    return config.replace(extra={**config.extra, "_outer": outer})


def without_vision(config: Glm53Config) -> Glm53Config:
    """A copy of `config` declaring no tower (what a text-only model saves: no phantom vision_config)."""
    outer = {k: v for k, v in config.extra.get("_outer", {}).items() if k != "vision_config" and k not in TOKEN_FIELDS}
    return config.replace(extra={**config.extra, "_outer": outer})


__all__ = [
    "Glm53VisionConfig",
    "MultimodalTokenIds",
    "TOKEN_FIELDS",
    "check_fits",
    "has_vision",
    "vision_parts",
    "with_vision",
    "without_vision",
]
