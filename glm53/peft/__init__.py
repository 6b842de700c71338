"""Parameter-efficient fine-tuning: LoRA adapters, frozen groups, a frozen FP8 or bf16 base, peft-format files.

`apply_lora` / `merge_lora` / `freeze` (lora.py, groups in targets.py), `save_lora` / `load_lora` (files.py, peft's
format), the held FP8 / bf16 base (fp8.py: per-matmul widening, fp8_storage.py: holding a base in FP8 or bf16,
`hold_bf16`, load.py: `load_base`; views.py: the weight views and the LoRA linear).
"""

from .files import load_lora, save_lora
from .fp8 import hold_for_policy
from .fp8_storage import fp8_bytes, held_parameters, hold_bf16, quantize_model
from .load import BASE_DTYPES, load_base
from .lora import (
    LoraLinear,
    apply_lora,
    freeze,
    has_lora,
    lora_parameters,
    merge_lora,
    trainable_parameters,
)
from .targets import DEFAULT_LORA_TARGETS, FREEZE_GROUPS, LORA_ALIASES, LORA_GROUPS

__all__ = [
    "apply_lora",
    "merge_lora",
    "freeze",
    "save_lora",
    "load_lora",
    "load_base",
    "quantize_model",
    "hold_bf16",
    "hold_for_policy",
    "held_parameters",
    "fp8_bytes",
    "has_lora",
    "lora_parameters",
    "trainable_parameters",
    "LoraLinear",
    "BASE_DTYPES",
    "DEFAULT_LORA_TARGETS",
    "FREEZE_GROUPS",
    "LORA_GROUPS",
    "LORA_ALIASES",
]
