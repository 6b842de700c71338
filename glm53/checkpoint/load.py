"""Loading an official-layout checkpoint into a Glm53ForCausalLM.

Every key and shape is checked before any data is read (one error lists every problem), tensors are read lazily
(reader.py) and non-finite tensors are rejected, so a bad checkpoint raises before a model is returned. This
module never imports the model: `load_checkpoint` takes the class to build.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..config import Glm53Config
from ..errors import CheckpointError, ConfigError
from ..precision import beyond_range, cast_model, range_error, resolve_dtype
from . import fp8
from .layout import (
    EXPERT_KEY,
    LAYER_KEY,
    TEXT_PREFIX,
    VISION_MODULE,
    VISION_PREFIX,
    mtp_internal,
    official_key,
    official_to_internal,
)
from .reader import FLOAT_DTYPES, TensorReader, checkpoint_files

logger = logging.getLogger("glm53.checkpoint")


@dataclass
class LoadPlan:
    """Which checkpoint key fills which model tensor, and what is set aside."""

    direct: dict[str, str] = field(default_factory=dict)  # model name -> checkpoint key
    experts: dict[str, dict[tuple[int, str], str]] = field(default_factory=lambda: defaultdict(dict))
    # ^ fused expert parameter -> (expert, "gate" | "up" | "down") -> checkpoint key
    mtp_set_aside: list[str] = field(default_factory=list)  # MTP keys the model has no place for
    vision: list[str] = field(default_factory=list)  # vision-tower keys a model without a tower skips
    unexpected: list[str] = field(default_factory=list)

    @property
    def mtp_found(self) -> bool:
        return any(n.startswith("mtp.") for n in [*self.direct, *self.experts])

    def used_keys(self) -> list[str]:
        return list(self.direct.values()) + [k for parts in self.experts.values() for k in parts.values()]


def _model_name(key: str, num_layers: int, n_mtp: int) -> tuple[str, str | None]:
    """A checkpoint key -> ("model", glm53 name), ("vision", the tower's glm53 name) or (kind, None) with kind
    "mtp" or "unexpected"."""
    if key.startswith(VISION_PREFIX):
        return "vision", VISION_MODULE + key[len(VISION_PREFIX) :]
    if key == "lm_head.weight":
        return "model", key
    if not key.startswith(TEXT_PREFIX):
        return "unexpected", None
    local = key[len(TEXT_PREFIX) :]
    m = LAYER_KEY.match(local)
    if m and int(m[1]) >= num_layers:
        name = mtp_internal(local, num_layers, n_mtp)
        return ("model", name) if name is not None else ("mtp", None)
    return "model", "model." + official_to_internal(local)


def _match_keys(targets: dict, files: dict[str, str], reader: TensorReader, num_layers: int, n_mtp: int) -> LoadPlan:
    """Sort every checkpoint key into the plan (FP8 scales travel with their weight)."""
    plan = LoadPlan()
    for key in files:
        if key.endswith(fp8.SCALE_SUFFIX):
            weight = key[: -len(fp8.SCALE_SUFFIX)]
            if not (weight in files and fp8.is_fp8(reader.dtype(weight))):
                plan.unexpected.append(key)  # a scale beside a non-FP8 weight
            continue
        kind, name = _model_name(key, num_layers, n_mtp)
        if kind == "vision" and name in targets:  # a model with a tower (Glm53ForConditionalGeneration)
            kind = "model"
        if kind != "model":
            {"vision": plan.vision, "mtp": plan.mtp_set_aside, "unexpected": plan.unexpected}[kind].append(key)
        elif (m := EXPERT_KEY.match(key[len(TEXT_PREFIX) :])) and name in targets:
            plan.experts[name][(int(m[2]), m[3])] = key
        elif name in targets and name not in plan.direct:
            plan.direct[name] = key
        else:
            plan.unexpected.append(key)
    for name in [n for n in plan.experts if n in plan.direct]:
        # Fused and per-expert forms of one tensor: the per-expert keys are the official layout, and loading
        # both would let one silently overwrite the other.
        plan.unexpected.append(plan.direct.pop(name))
    return plan


def _expert_problems(
    name: str, shape: tuple, plan: LoadPlan, reader: TensorReader, num_layers: int, missing: list, bad_shape: list
) -> None:
    """Check one fused expert parameter [E, rows, cols] against its per-expert keys."""
    E, rows, cols = shape
    parts = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
    expected = (rows // len(parts), cols)
    prefix = official_key(name.rsplit(".", 1)[0], num_layers)
    for e in range(E):
        for part in parts:
            key = plan.experts[name].get((e, part))
            if key is None:
                missing.append(f"{prefix}.{e}.{part}_proj.weight {expected}")
            elif reader.shape(key) != expected:
                bad_shape.append(f"{key}: {reader.shape(key)}, expected {expected}")
    plan.unexpected.extend(k for (e, _), k in plan.experts[name].items() if e >= E)


def _plan(model: torch.nn.Module, files: dict[str, str], reader: TensorReader, num_layers: int) -> LoadPlan:
    """Match checkpoint keys to model tensors; raise one CheckpointError listing every problem."""
    targets = dict(model.named_parameters(remove_duplicate=False))  # keep a tied lm_head.weight visible
    targets.update(dict(model.named_buffers()))
    n_mtp = model.config.num_nextn_predict_layers if getattr(model, "mtp", None) is not None else 0
    plan = _match_keys(targets, files, reader, num_layers, n_mtp)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:
        plan.direct.pop("lm_head.weight", None)  # the embedding provides it; a stored copy is ignored
    # A checkpoint without any MTP tensor (e.g. written by transformers, which drops them) leaves the MTP
    # module to be initialised; a partial MTP layer is an error like any other missing key.
    mtp_found = plan.mtp_found
    missing, bad_shape = [], []
    for name, tensor in targets.items():
        if (tied and name == "lm_head.weight") or (name.startswith("mtp.") and not mtp_found):
            continue
        if name in plan.direct:
            found = reader.shape(plan.direct[name])
            if found != tuple(tensor.shape):
                bad_shape.append(f"{plan.direct[name]}: {found}, expected {tuple(tensor.shape)}")
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            _expert_problems(name, tuple(tensor.shape), plan, reader, num_layers, missing, bad_shape)
        else:
            missing.append(f"{official_key(name, num_layers)} {tuple(tensor.shape)}")
    bad_fp8 = [msg for key in plan.used_keys() if (msg := reader.check_fp8(key))]
    sections = [
        ("FP8 scales", bad_fp8),
        ("missing keys (expected shape)", missing),
        ("unexpected keys", plan.unexpected),
        ("mis-shaped keys", bad_shape),
        ("keys of a dtype the parameter cannot hold", _dtype_problems(targets, plan, reader)),
    ]
    problems = [f"{title}:\n  " + "\n  ".join(sorted(items)) for title, items in sections if items]
    if problems:
        raise CheckpointError("checkpoint does not match the model config:\n" + "\n".join(problems))
    return plan


def _dtype_problems(targets: dict, plan: LoadPlan, reader: TensorReader) -> list[str]:
    """A floating parameter accepts only floating tensors (FP8 with a floating scale): casting an int, bool or
    complex tensor into it would truncate or drop data silently."""
    pairs = [(name, key) for name, key in plan.direct.items()]
    pairs += [(name, key) for name, parts in plan.experts.items() for key in parts.values()]
    problems = []
    for name, key in pairs:
        found, target = reader.dtype(key), targets[name]
        if target.is_floating_point() and found not in FLOAT_DTYPES:
            problems.append(
                f"{key}: {found}, but {name} is {str(target.dtype).replace('torch.', '')} "
                f"(floating: one of {sorted(FLOAT_DTYPES)})"
            )
    return problems


def check_layer_count(files: dict[str, str], config: Glm53Config, path: str) -> None:
    """Compare the checkpoint's decoder layers with config.json before building anything: a config claiming far
    more layers than the checkpoint holds would otherwise spend minutes building a model that cannot load."""
    text = [key[len(TEXT_PREFIX) :] for key in files if key.startswith(TEXT_PREFIX)]
    layers = {int(m[1]) for local in text if (m := LAYER_KEY.match(local))}
    n = config.num_hidden_layers
    absent = sorted(set(range(n)) - layers)
    if absent:
        shown = absent if len(absent) <= 8 else [*absent[:4], "...", *absent[-2:]]
        raise CheckpointError(
            f"{path}: config.json has num_hidden_layers={n} but the checkpoint has no tensors for "
            f"{len(absent)} of those layers (layers {shown}); it holds layers "
            f"{_ranges(sorted(layers))}"
        )


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    out, start = [], values[0]
    for prev, cur in zip(values, [*values[1:], None]):
        if cur != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}..{prev}")
            start = cur
    return ", ".join(out)


def quantization_config(config: Glm53Config) -> dict | None:
    """The source config.json's `quantization_config` (outer or text level), if any."""
    return config.extra.get("_outer", {}).get("quantization_config") or config.extra.get("quantization_config")


def warn_text_only(plan: LoadPlan, path: str) -> None:
    """One warning per load when a model without a tower reads a vision-language checkpoint."""
    if plan.vision:
        logger.warning(
            "%s is a vision-language checkpoint: loading its text model only, %d vision-tower tensors "
            "(model.visual.*) skipped (glm53.Glm53ForConditionalGeneration loads them)",
            path,
            len(plan.vision),
        )


def _fitting(tensor: torch.Tensor, dtype: torch.dtype, key: str, path) -> torch.Tensor:
    """`tensor` unchanged; a CheckpointError when `dtype` (the model's) cannot hold its values (fp16 overflow)."""
    if (peak := beyond_range(tensor, dtype)) is not None:
        raise CheckpointError(f"{path}: " + range_error({key: peak}, dtype, "loading as"))
    return tensor


def load_checkpoint(
    cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
):
    """Build `cls` (Glm53ForCausalLM) from an official-layout directory; see the module docstring.

    dtype None keeps the config's stored `dtype`/`torch_dtype` when it names one, else fp32. Parameters that
    transformers keeps in fp32 stay fp32. With `num_nextn_predict_layers > 0` the MTP layers' keys
    (`layers.{N+j}.*`) load into `model.mtp.layers[j]` (a checkpoint with none of them leaves the MTP module
    freshly initialised, with a warning); MTP keys the model has no place for are set aside and listed in
    `model.mtp_checkpoint_keys`.
    """
    path = os.fspath(path)
    dtype = None if dtype is None else resolve_dtype(dtype, "dtype")
    config = Glm53Config.from_pretrained(path)
    if dtype is None:
        stored = config.extra.get("_outer", {}).get("dtype") or config.extra.get("dtype") or "float32"
        try:
            dtype = resolve_dtype(stored, "dtype")
        except TypeError as e:
            raise ConfigError(f"{path}/config.json: {e}") from e
    files = checkpoint_files(path)
    check_layer_count(files, config, path)
    reader = TensorReader(files, fp8.weight_block_size(quantization_config(config)))
    with torch.device("meta"):
        model = cls(config)
    plan = _plan(model, files, reader, config.num_hidden_layers)
    warn_text_only(plan, path)
    cast_model(model, dtype)  # on meta: no fp32 copy of a bf16 model; each copied tensor is checked (_fitting)
    model.to_empty(device=device)
    model.tie_weights()
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name, key in plan.direct.items():
            tensors[name].copy_(_fitting(reader.get(key), tensors[name].dtype, key, path))
        for name, parts in plan.experts.items():
            target = tensors[name]
            for (e, part), key in parts.items():
                rows = target.shape[1] // 2 if name.endswith("gate_up_proj") else target.shape[1]
                offset = rows if part == "up" else 0
                target[e, offset : offset + rows].copy_(_fitting(reader.get(key), target.dtype, key, path))
        if model.mtp is not None and not plan.mtp_found:
            logger.warning(
                "%s has no MTP tensors (layers.%d.*): the MTP module is freshly initialised",
                path,
                config.num_hidden_layers,
            )
            model.mtp.init_weights()
    model.mtp_checkpoint_keys = sorted(plan.mtp_set_aside)
    if model.mtp is None and plan.mtp_set_aside:
        logger.warning(
            "%s holds %d MTP tensors (layers.%d.*) but its config has num_nextn_predict_layers=0: they "
            "are not loaded, and a save_pretrained of this model will not write them (set "
            "num_nextn_predict_layers to keep them)",
            path,
            len(plan.mtp_set_aside),
            config.num_hidden_layers,
        )
    return model.eval()  # as transformers' from_pretrained: dropout off, no expert loads counted; .train() to train
