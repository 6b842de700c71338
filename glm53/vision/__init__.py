"""The vision side of GLM-5.3-Flash: the tower (`model.visual` on disk), its config, and the VL model.

    config.py       Glm53VisionConfig (vision_config), MultimodalTokenIds, with_vision / vision_parts
    rotary.py       patch positions, 2-D axial rope (fp32, no buffer)
    patch_embed.py  Conv3d patch embedding (run as one linear map)
    attention.py    vision attention (qkv, q/k norms, rope; segments via kernels/vision_attention.py)
    block.py        vision block and the clamped SwiGLU with biases
    merger.py       downsample (Conv2d m x m) and the merger (the projector)
    tower.py        VisionTower: the whole tower, input checks
    splice.py       placeholder masks (the begin/end-of-video rule) and the feature splice
    model.py        Glm53ForConditionalGeneration (exported from glm53)
    groups.py       parameter groups by name ("vision_tower", "projector") for freezing
"""

from .config import Glm53VisionConfig, MultimodalTokenIds, has_vision, vision_parts, with_vision, without_vision
from .groups import FREEZE_GROUPS, group_parameter_names
from .tower import VisionOutput, VisionTower

__all__ = ["FREEZE_GROUPS", "Glm53VisionConfig", "MultimodalTokenIds", "VisionOutput", "VisionTower",
           "group_parameter_names", "has_vision", "vision_parts", "with_vision", "without_vision"]  # fmt: skip
