"""The vision side of GLM-5.3-Flash: the tower (`model.visual` on disk), its config, and the VL model.

    config.py       Glm53VisionConfig (vision_config), MultimodalTokenIds, with_vision / vision_parts
    rotary.py       patch positions, 2-D axial rope (fp32, no buffer)
    patch_embed.py  Conv3d patch embedding (run as one linear map)
    attention.py    vision attention (qkv, q/k norms, rope; segments via kernels/vision_attention.py)
    block.py        vision block and the clamped SwiGLU with biases
    merger.py       downsample (Conv2d m x m) and the merger (the projector)
    tower.py        VisionTower: the whole tower, input checks
"""

from .config import Glm53VisionConfig, MultimodalTokenIds, has_vision, vision_parts, with_vision, without_vision
from .tower import VisionOutput, VisionTower

__all__ = ["Glm53VisionConfig", "MultimodalTokenIds", "VisionOutput", "VisionTower", "has_vision", "vision_parts",
           "with_vision", "without_vision"]  # fmt: skip
