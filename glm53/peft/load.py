"""Loading a frozen base for parameter-efficient fine-tuning: bf16 (FP8 checkpoints dequantised on load, as
`Glm53ForCausalLM.from_pretrained`) or FP8 (the checkpoint's block-scaled weights kept as they are, glm53.peft.fp8).

The model is built on the meta device, its held weights (glm53.peft.fp8) are replaced by meta FP8 / bf16 tensors,
and only then materialised, so no wider copy of them ever exists. With base_dtype "fp8" every text linear and
routed expert whose checkpoint weights are FP8 is held in FP8; `quantize=True` quantises bf16/fp32 checkpoint
weights of the same modules to the release's block format while loading (one tensor at a time). With "bf16" the
same modules' weights (those `hold` selects) are held in bf16 under a wider training `dtype`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from ..checkpoint import fp8 as fp8_format
from ..checkpoint.load import _plan, check_layer_count, quantization_config
from ..checkpoint.reader import TensorReader, checkpoint_files
from ..config import Glm53Config
from ..errors import CheckpointError, ConfigError
from ..model.moe import Experts
from ..precision import cast_model, resolve_dtype
from .fp8 import SCALE
from .fp8_storage import fp8_modules, hold_bf16, quantize_blocks, set_fp8
from .lora import expert_factors, linear_factors
from .views import EXPERT_WEIGHTS

BASE_DTYPES = ("bf16", "fp8")


def load_base(
    cls,
    path: str | os.PathLike,
    base_dtype: str = "bf16",
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    quantize: bool = False,
    device: str | torch.device = "cpu",
    hold: Callable[[str], bool] | None = None,
):
    """`cls` (Glm53ForCausalLM) from an official-layout directory with its base in `base_dtype`.

    dtype: the training precision of everything not held in FP8 / bf16 (adapters added later follow it too).
    hold(name): with "bf16", which text linear / expert weights (glm53 names) are held in bf16 and frozen (None:
    all of them; the rest load in `dtype` to train). Raises ConfigError for an unknown base_dtype, and for "fp8"
    on a checkpoint without block-scaled FP8 weights unless `quantize` is set; every key problem raises
    CheckpointError before data is read, as the loader does."""
    if base_dtype not in BASE_DTYPES:
        raise ConfigError(f"base_dtype must be one of {list(BASE_DTYPES)}, got {base_dtype!r}")
    dtype = resolve_dtype(dtype, "dtype")
    if base_dtype == "bf16" and dtype == torch.bfloat16:  # nothing is held narrower than the model
        return cls.from_pretrained(path, dtype=dtype, device=device)
    path = os.fspath(path)
    config = Glm53Config.from_pretrained(path)
    files = checkpoint_files(path)
    check_layer_count(files, config, path)
    block = fp8_format.weight_block_size(quantization_config(config))
    reader = TensorReader(files, block)
    with torch.device("meta"):
        model = cls(config)
    plan = _plan(model, files, reader, config.num_hidden_layers)
    cast_model(model, dtype)
    if base_dtype == "bf16":
        hold_bf16(model, dtype, select=hold or (lambda name: True))
        fp8_names = []
    else:
        fp8_names = _fp8_placeholders(model, plan, reader, block, dtype, quantize, path)
    model.to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():
        _fill(model, plan, reader, set(fp8_names), block)
    if model.mtp is not None and not plan.mtp_found:
        model.mtp.init_weights()
    model.mtp_checkpoint_keys = sorted(plan.mtp_set_aside)
    return model.eval()  # as from_pretrained: .train() to train


def fp8_placeholders(
    model: nn.Module, path: str | os.PathLike, dtype: torch.dtype, quantize: bool = False
) -> list[str]:
    """Meta FP8 placeholders (values and block scales) on a meta `model` (without adapters yet) for every text linear
    and routed expert that the checkpoint at `path` stores in FP8 (all of them with `quantize`), widened to `dtype`
    -> their module names. For a model built on meta and filled per rank after parallelizing
    (glm53.parallel.load_pretrained reads them raw, or with `quantize` quantises the wider ones on read)."""
    path = os.fspath(path)
    files = checkpoint_files(path)
    block = fp8_format.weight_block_size(quantization_config(Glm53Config.from_pretrained(path)))
    reader = TensorReader(files, block)
    plan = _plan(model, files, reader, model.config.num_hidden_layers)
    return _fp8_placeholders(model, plan, reader, block, dtype, quantize, path)


def _fp8_placeholders(model, plan, reader, block, dtype, quantize: bool, path: str) -> list[str]:
    """Meta FP8 placeholders for every FP8-eligible module the checkpoint stores in FP8 (all with `quantize`)."""
    keys = _module_keys(model, plan)
    stored = {name: all(fp8_format.is_fp8(reader.dtype(k)) for k in ks) for name, ks in keys.items()}
    if not any(stored.values()) and not quantize:
        raise ConfigError(
            f"{path}: base_dtype='fp8' but the checkpoint has no block-scaled FP8 weights "
            f"(no '*{SCALE}' tensors); pass quantize=True (--quantize-base) to quantise it on load, "
            "or use base_dtype='bf16'"
        )
    fp8_names = [name for name in keys if stored[name] or quantize]
    modules = dict(model.named_modules())
    for name in fp8_names:  # materialised as FP8 by the caller
        _meta_fp8(modules[name], block, dtype)
    return fp8_names


def _module_keys(model: nn.Module, plan) -> dict[str, list[str]]:
    """{FP8-eligible module name: the checkpoint keys of its base weight(s)}."""
    out = {}
    for name, module in fp8_modules(model).items():
        if isinstance(module, Experts):
            ks = [k for p in ("gate_up_proj", "down_proj") for k in plan.experts.get(f"{name}.{p}", {}).values()]
        else:
            ks = [plan.direct[f"{name}.weight"]] if f"{name}.weight" in plan.direct else []
        if ks:
            out[name] = ks
    return out


def _meta_fp8(module: nn.Module, block: tuple[int, int], dtype: torch.dtype) -> None:
    names = ("gate_up_proj", "down_proj") if isinstance(module, Experts) else ("weight",)
    for name in names:
        w = getattr(module, name)
        parts = 2 if name == "gate_up_proj" else 1
        rows = w.shape[-2] // parts
        go, gi = fp8_format.scale_shape((rows, w.shape[-1]), block)
        q = torch.empty(w.shape, dtype=fp8_format.FP8_DTYPE, device="meta")
        set_fp8(module, name, q, torch.empty(*w.shape[:-2], parts * go, gi, device="meta"), block, dtype, parts)


def _read_fp8(reader: TensorReader, key: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    if fp8_format.is_fp8(reader.dtype(key)):
        return reader.get_fp8(key)
    return quantize_blocks(reader.get(key), block)


def _fill(model: nn.Module, plan, reader: TensorReader, fp8_names: set[str], block: tuple[int, int]) -> None:
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    modules = dict(model.named_modules())
    for name, key in plan.direct.items():
        owner = name.rsplit(".", 1)[0]
        if owner in fp8_names and name.endswith(".weight"):
            q, s = _read_fp8(reader, key, block)
            tensors[name].copy_(q)
            tensors[name + SCALE].copy_(s)
        else:
            tensors[name].copy_(reader.get(key))
    for name, parts in plan.experts.items():
        owner, param = name.rsplit(".", 1)
        target = tensors[name]
        rows = target.shape[1] // 2 if param == "gate_up_proj" else target.shape[1]
        if owner not in fp8_names:
            for (e, part), key in parts.items():
                offset = rows if part == "up" else 0
                target[e, offset : offset + rows].copy_(reader.get(key))
            continue
        scale = getattr(modules[owner], param + SCALE)
        srows = scale.shape[1] // 2 if param == "gate_up_proj" else scale.shape[1]
        for (e, part), key in parts.items():
            q, s = _read_fp8(reader, key, block)
            if tuple(s.shape) != (srows, scale.shape[2]):
                raise CheckpointError(f"{key + SCALE}: shape {tuple(s.shape)}, expected {(srows, scale.shape[2])}")
            offset, soffset = (rows, srows) if part == "up" else (0, 0)
            target[e, offset : offset + rows].copy_(q)
            scale[e, soffset : soffset + srows].copy_(s)


def fresh_adapters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole initial value) of every adapter factor of `model`, whose adapters `apply_lora` added on the
    meta device (so hold no values): each module's factors made again on CPU by apply_lora's own constructors
    (`linear_factors`, `expert_factors`) in its order, so after the same seed they equal what apply_lora gives
    one process, on every rank. One module's factors are whole at a time."""
    modules = dict(model.named_modules())
    for name in model.lora_settings["modules"]:
        module = modules[name]
        if not isinstance(module, Experts):
            dtype = module.lora_A.weight.dtype
            A, B = linear_factors(module.in_features, module.out_features, module.lora_rank, "cpu", dtype)
            yield f"{name}.lora_A.weight", A.weight.detach()
            yield f"{name}.lora_B.weight", B.weight.detach()
            continue
        for w in [w for w in EXPERT_WEIGHTS if hasattr(module, w + "_lora_A")]:
            dtype = getattr(module, w + "_lora_A").dtype
            A, B = expert_factors(getattr(module, w).shape, module.lora_rank, "cpu", dtype)
            yield f"{name}.{w}_lora_A", A
            yield f"{name}.{w}_lora_B", B


__all__ = ["BASE_DTYPES", "load_base", "fp8_placeholders", "fresh_adapters"]
