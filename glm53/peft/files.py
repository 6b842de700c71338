"""Adapter files in peft's format: `adapter_config.json` + `adapter_model.safetensors`, transformers' module names.

Legend: E routed experts, r rank, O out features, I in features.
Keys are peft's: `base_model.model.<transformers module>.lora_A.weight` [r, I] and `.lora_B.weight` [O, r], the
module names those of transformers' Glm5NextForConditionalGeneration (text under `model.language_model.`, KDA's
gate under `self_attn.forget_gate.`, vision under `model.visual.`; glm53/checkpoint/convert.py). Routed experts are
peft's `target_parameters` (its `ParamWrapper`, peft >= 0.17): per fused parameter `lora_A` [E * r, I] (expert-major
rows) and `lora_B` [O, r * E] (expert-minor columns); with both experts parameters adapted, peft nests its wrappers
in the parameters' registration order, so gate_up_proj's factors are under `experts.base_layer.` and down_proj's
under `experts.`. glm53 holds them as A [E, r, I], B [E, O, r]. The MTP layers (no transformers module) are
written as `model.language_model.layers.{num_hidden_layers + j}.*`: glm53 reads them back, peft cannot place them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from ..checkpoint.layout import TEXT_PREFIX, VISION_PREFIX
from ..errors import CheckpointError, ConfigError
from ..model.moe import Experts
from .lora import EXPERT_WEIGHTS, apply_lora, has_lora

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_GATE = re.compile(r"^(layers\.\d+\.self_attn\.)(f_a_proj|f_b_proj)$")
_HF_GATE = re.compile(r"^(layers\.\d+\.self_attn\.)forget_gate\.(f_a_proj|f_b_proj)$")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def hf_module_name(name: str, num_layers: int) -> str:
    """A glm53 module name -> transformers' glm5_next module name."""
    if name.startswith("mtp."):
        m = _LAYER.match(name[len("mtp.") :])
        return f"{TEXT_PREFIX}layers.{num_layers + int(m[1])}." + name[len("mtp.") + m.end() :]
    if name.startswith("model.visual.") or name.startswith("visual."):
        return VISION_PREFIX + name.split("visual.", 1)[1]
    if name.startswith("model."):
        local = name[len("model.") :]
        if m := _GATE.match(local):
            local = f"{m[1]}forget_gate.{m[2]}"
        return TEXT_PREFIX + local
    return name


def glm53_module_name(hf: str, num_layers: int, vision_prefix: str = "model.visual.") -> str:
    """transformers' module name -> glm53's (the inverse of `hf_module_name`)."""
    if hf.startswith(VISION_PREFIX):
        return vision_prefix + hf[len(VISION_PREFIX) :]
    if hf.startswith(TEXT_PREFIX):
        local = hf[len(TEXT_PREFIX) :]
        if m := _HF_GATE.match(local):
            local = f"{m[1]}{m[2]}"
        if (m := _LAYER.match(local)) and int(m[1]) >= num_layers:
            return f"mtp.layers.{int(m[1]) - num_layers}." + local[m.end() :]
        return "model." + local
    return hf


def _adapted(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_rank")}


def _expert_keys(hf: str, module: Experts) -> dict[str, str]:
    """{fused parameter: peft key prefix} (peft's nesting: the first registered parameter is innermost)."""
    present = [p for p in EXPERT_WEIGHTS if hasattr(module, f"{p}_lora_A")]
    return {p: f"{PEFT_PREFIX}{hf}." + "base_layer." * (len(present) - 1 - i) for i, p in enumerate(present)}


def adapter_state(
    model: nn.Module, full: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The adapters as peft's keys and layouts (fp32 copies on the CPU). `full`: how to read a factor whole
    (a parallelized model's sharded parameters: glm53.parallel gathers them; called in the same order everywhere)."""
    n = model.config.num_hidden_layers
    whole = full or (lambda t: t)
    out = {}
    for name, module in _adapted(model).items():
        hf = hf_module_name(name, n)
        if isinstance(module, Experts):
            for param, prefix in _expert_keys(hf, module).items():
                A = whole(getattr(module, f"{param}_lora_A").detach())  # [E, r, I]
                B = whole(getattr(module, f"{param}_lora_B").detach())  # [E, O, r]
                out[prefix + "lora_A.weight"] = A.reshape(-1, A.shape[-1])
                out[prefix + "lora_B.weight"] = B.permute(1, 2, 0).reshape(B.shape[1], -1)
        else:
            out[f"{PEFT_PREFIX}{hf}.lora_A.weight"] = whole(module.lora_A.weight.detach())
            out[f"{PEFT_PREFIX}{hf}.lora_B.weight"] = whole(module.lora_B.weight.detach())
    return {k: v.float().cpu().contiguous() for k, v in out.items()}


def save_lora(
    model: nn.Module,
    path: str | os.PathLike,
    full: Callable[[torch.Tensor], torch.Tensor] | None = None,
    write: bool = True,
) -> str:
    """Write the model's adapters to directory `path` in peft's format -> the directory. A parallelized model:
    every rank calls it with `full` (reads a sharded factor whole) and one rank with `write` True writes."""
    if not has_lora(model):
        raise ConfigError("save_lora: the model has no LoRA adapters (apply_lora first)")
    path = os.fspath(path)
    settings = model.lora_settings
    n = model.config.num_hidden_layers
    adapted = _adapted(model)
    modules = sorted(hf_module_name(k, n) for k, m in adapted.items() if not isinstance(m, Experts))
    params = sorted(
        f"{hf_module_name(k, n)}.{p}"
        for k, m in adapted.items()
        if isinstance(m, Experts)
        for p in EXPERT_WEIGHTS
        if hasattr(m, f"{p}_lora_A")
    )
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": settings.get("base"),
        "r": settings["rank"],
        "lora_alpha": settings["alpha"],
        "lora_dropout": settings["dropout"],
        "target_modules": modules or None,
        "target_parameters": params or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
        "inference_mode": True,
    }
    identity = _identity(model)
    state = adapter_state(model, full)
    if not write:
        return path
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, WEIGHTS_FILE + ".tmp")
    save_file(state, tmp, metadata={"format": "pt", "glm53_model": json.dumps(identity)})
    os.replace(tmp, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE + ".tmp"), "w") as f:
        json.dump(config, f, indent=2)
    os.replace(os.path.join(path, CONFIG_FILE + ".tmp"), os.path.join(path, CONFIG_FILE))
    return path


def _identity(model: nn.Module) -> dict:
    c = model.config
    return {k: getattr(c, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size", "n_routed_experts")}


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read the adapter config ({e})") from e
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{file}: peft_type {config.get('peft_type')!r}, glm53 reads 'LORA' adapters")
    for key, fine in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False)):
        if config.get(key, fine) != fine:
            raise CheckpointError(f"{file}: {key}={config[key]!r} is not supported (glm53 reads plain LoRA)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise CheckpointError(f"{file}: {key} is not supported (one rank and alpha for every module)")
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"{file}: bias={config['bias']!r} is not supported (bias 'none' only)")
    return config


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: no {WEIGHTS_FILE}")
    with safe_open(file, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _group_keys(state: dict[str, torch.Tensor], file: str) -> dict[str, dict[str, torch.Tensor]]:
    """{module key prefix (peft name, without lora_X.weight): {"A": tensor, "B": tensor}}."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    for key, tensor in state.items():
        m = re.match(r"^(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
        if not m or not key.startswith(PEFT_PREFIX):
            bad.append(key)
            continue
        groups.setdefault(m[1][len(PEFT_PREFIX) :], {})[m[2]] = tensor
    bad += [f"{k}.lora_{'B' if 'A' in g else 'A'}.weight (missing)" for k, g in groups.items() if len(g) != 2]
    if bad:
        raise CheckpointError(f"{file}: keys that are not LoRA factors of a module:\n  " + "\n  ".join(sorted(bad)))
    return groups


def load_lora(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Load the adapters in directory `path` (peft's format, written by glm53 or peft) -> the adapted module names.

    A model without adapters gets them (apply_lora with the file's rank, alpha, dropout and modules, base frozen);
    a model with adapters must have the same ones. Raises CheckpointError naming the file and key for a module
    this model lacks, a rank or shape that does not fit, or an unsupported peft option."""
    path = os.fspath(path)
    config = _read_config(path)
    file = os.path.join(path, WEIGHTS_FILE)
    groups = _group_keys(_read_weights(path), file)
    n = model.config.num_hidden_layers
    names = dict(model.named_modules())
    vision = next((k + "." for k in names if k == "visual" or k.endswith(".visual")), "model.visual.")
    placed = _place(groups, names, n, vision, file)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if has_lora(model):
        _check_same(model, placed, rank, file)
    else:
        try:
            targets = sorted({m if p is None else f"{m}.{p}" for m, p in placed})
            apply_lora(model, rank, alpha, config.get("lora_dropout", 0.0), targets=targets)
        except ConfigError as e:
            raise CheckpointError(f"{file}: {e}") from e
    with torch.no_grad():
        for (module_name, param), (A, B) in placed.items():
            _copy(names[module_name], param, A, B, f"{file}: {module_name}" + (f".{param}" if param else ""))
    return sorted({m for m, _ in placed})


def _place(groups, names, n, vision, file) -> dict[tuple[str, str | None], tuple[torch.Tensor, torch.Tensor]]:
    """peft key prefix -> (glm53 module, fused parameter or None) and its (A, B) in glm53's layout."""
    placed, unknown = {}, []
    for prefix, g in groups.items():
        depth = prefix.count(".base_layer")
        hf = prefix.replace(".base_layer", "")
        name = glm53_module_name(hf, n, vision)
        module = names.get(name)
        if isinstance(module, Experts):
            present = len([p for p in groups if p.replace(".base_layer", "") == hf])
            param = EXPERT_WEIGHTS[present - 1 - depth] if present == 2 else _lone_expert_param(module, g)
            E = getattr(module, param).shape[0]
            A, B = g["A"], g["B"]
            if A.shape[0] % E or B.shape[1] % E:
                raise CheckpointError(
                    f"{file}: {prefix}: factors {tuple(A.shape)}, {tuple(B.shape)} do not split over {E} experts"
                )
            r = A.shape[0] // E
            placed[(name, param)] = (A.reshape(E, r, -1), B.reshape(B.shape[0], r, E).permute(2, 0, 1))
        elif isinstance(module, nn.Linear) and depth == 0:
            placed[(name, None)] = (g["A"], g["B"])
        else:
            unknown.append(f"{PEFT_PREFIX}{prefix} (glm53 module {name!r})")
    if unknown:
        raise CheckpointError(
            f"{file}: adapters for modules this model does not have (another model?):\n  "
            + "\n  ".join(sorted(unknown))
        )
    return placed


def _lone_expert_param(module: Experts, g: dict) -> str:
    """Which fused parameter a single experts wrapper adapts: the one whose in-width fits A."""
    fits = [p for p in EXPERT_WEIGHTS if getattr(module, p).shape[-1] == g["A"].shape[-1]]
    return fits[0] if len(fits) == 1 else EXPERT_WEIGHTS[0]


def _check_same(model: nn.Module, placed: dict, rank, file: str) -> None:
    if rank != model.lora_settings["rank"]:
        raise CheckpointError(
            f"{file}: adapter rank r={rank!r}, but the model's adapters have rank {model.lora_settings['rank']}"
        )
    have = set(_adapted(model))
    extra = sorted({m for m, _ in placed} - have)
    if extra:
        raise CheckpointError(f"{file}: adapters for modules the model's adapters do not cover: {extra}")


def _copy(module: nn.Module, param: str | None, A: torch.Tensor, B: torch.Tensor, where: str) -> None:
    if param is None:
        targets = (module.lora_A.weight, module.lora_B.weight)
    else:
        if not hasattr(module, f"{param}_lora_A"):
            raise CheckpointError(f"{where}: the model has no adapter there")
        targets = (getattr(module, f"{param}_lora_A"), getattr(module, f"{param}_lora_B"))
    for label, src, dst in zip("AB", (A, B), targets):
        if tuple(src.shape) != tuple(dst.shape):
            raise CheckpointError(
                f"{where}: lora_{label} has shape {tuple(src.shape)}, the model expects "
                f"{tuple(dst.shape)} (another model or rank?)"
            )
        if not bool(torch.isfinite(src).all()):
            raise CheckpointError(f"{where}: lora_{label} holds NaN or infinite values")
        dst.copy_(src)


__all__ = [
    "save_lora",
    "load_lora",
    "adapter_state",
    "hf_module_name",
    "glm53_module_name",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
]
