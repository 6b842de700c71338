"""Conversion between glm53's state dict and transformers' in-memory glm5_next state dict.

Legend: H KDA heads, K KDA head width, W conv width (glm53/model/__init__.py).
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from ..config import Glm53Config
from ..errors import CheckpointError
from ..precision import cast_model
from .layout import TEXT_PREFIX, VISION_MODULE, VISION_PREFIX

# transformers' in-memory names (conversion_mapping.py "glm5_next") differ from glm53's in two places.
_GATE_PARTS = r"(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)"
_HF_GATE = re.compile(r"^(layers\.\d+\.self_attn\.)" + _GATE_PARTS + "$")
_HF_GATE_BACK = re.compile(r"^(layers\.\d+\.self_attn\.)forget_gate\." + _GATE_PARTS + "$")
_CONV = re.compile(r"^(layers\.\d+\.self_attn\.)([qkv])_conv1d\.weight$")
_HF_CONV = re.compile(r"^(layers\.\d+\.self_attn\.)conv1d\.weight$")


def to_transformers_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """glm53 model -> the state dict of transformers' Glm5NextForConditionalGeneration (text part).

    Renames KDA's gate to `forget_gate.*` and concatenates q/k/v convs into `conv1d` [3*H*K, 1, W];
    experts stay fused. Tensors are shared with the model except the concatenated convs. `lm_head.weight`
    is included also when tied, as transformers' state_dict does.
    """
    out: dict[str, torch.Tensor] = {}
    convs: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            out[name] = tensor
            continue
        if name.startswith(VISION_MODULE):  # the tower's names are the on-disk ones under model.visual.
            out[VISION_PREFIX + name[len(VISION_MODULE) :]] = tensor
            continue
        local = name[len("model.") :]
        if m := _CONV.match(local):
            convs[m[1]][m[2]] = tensor
        elif m := _HF_GATE.match(local):
            out[f"{TEXT_PREFIX}{m[1]}forget_gate.{m[2]}"] = tensor
        else:
            out[TEXT_PREFIX + local] = tensor
    for prefix, parts in convs.items():
        out[f"{TEXT_PREFIX}{prefix}conv1d.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


def from_transformers_state_dict(state: dict[str, torch.Tensor], vision: bool = False) -> dict[str, torch.Tensor]:
    """transformers' Glm5NextForConditionalGeneration state dict -> glm53 state dict (vision keys dropped, or
    with `vision` kept as `visual.*`: Glm53ForConditionalGeneration's names).

    Splits `conv1d` into equal q/k/v thirds and moves `forget_gate.*` up to `self_attn`; other keys raise.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in state.items():
        if key == "lm_head.weight":
            out[key] = tensor
            continue
        if key.startswith(VISION_PREFIX):
            if vision:
                out[VISION_MODULE + key[len(VISION_PREFIX) :]] = tensor
            continue
        if not key.startswith(TEXT_PREFIX):
            unknown.append(key)
            continue
        local = key[len(TEXT_PREFIX) :]
        if m := _HF_CONV.match(local):
            for part, chunk in zip("qkv", tensor.chunk(3, dim=0)):
                out[f"model.{m[1]}{part}_conv1d.weight"] = chunk
        elif m := _HF_GATE_BACK.match(local):
            out[f"model.{m[1]}{m[2]}"] = tensor
        else:
            out["model." + local] = tensor
    if unknown:
        raise CheckpointError("keys outside the text model and vision tower:\n  " + "\n  ".join(sorted(unknown)))
    return out


def from_transformers(hf_model: torch.nn.Module, cls: type):
    """A `cls` (Glm53ForCausalLM) with a copy of a transformers Glm5NextForConditionalGeneration's text weights
    (and its vision tower when `cls` has one: Glm53ForConditionalGeneration)."""
    config = Glm53Config.from_dict(hf_model.config.to_dict())
    with torch.device("meta"):
        model = cls(config)
    # cast on meta, before any memory exists: to_empty's memory holds no values (an inf now and then), and a bf16
    # model never takes an fp32 copy's room; load_state_dict fills every tensor next
    cast_model(model, hf_model.lm_head.weight.dtype)
    model.to_empty(device=hf_model.lm_head.weight.device)
    vision = hasattr(model, "visual")
    model.load_state_dict(from_transformers_state_dict(hf_model.state_dict(), vision), strict=True)
    return model
