"""Parameter groups of the vision side by name, for freezing (glm53.freeze) and per-group learning rates.

    vision_tower  patch_embed, blocks, post_layernorm   (the encoder)
    projector     downsample, merger                     (into the text width)
LLaMA-Factory and xtuner freeze these for VL fine-tuning by default (../shared/VISION_NOTES.md).
"""

from __future__ import annotations

import torch.nn as nn

VISION_MODULE = "visual"
FREEZE_GROUPS: dict[str, tuple[str, ...]] = {
    "vision_tower": ("patch_embed", "blocks", "post_layernorm"),
    "projector": ("downsample", "merger"),
}


def group_parameter_names(model: nn.Module, group: str) -> list[str]:
    """Full parameter names (as `model.named_parameters()` gives them) of `group`, in model order."""
    if group not in FREEZE_GROUPS:
        raise ValueError(f"unknown parameter group {group!r}; the vision groups are {sorted(FREEZE_GROUPS)}")
    if not hasattr(model, VISION_MODULE):
        raise ValueError(
            f"group {group!r} needs a model with a vision tower (Glm53ForConditionalGeneration), got "
            f"{type(model).__name__}"
        )
    prefixes = tuple(f"{VISION_MODULE}.{child}." for child in FREEZE_GROUPS[group])
    return [name for name, _ in model.named_parameters() if name.startswith(prefixes)]


__all__ = ["FREEZE_GROUPS", "group_parameter_names"]
