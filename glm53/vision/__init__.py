"""The vision side of GLM-5.3-Flash: the tower (`model.visual` on disk), its config, the VL model, and the
image/video processors (pixels -> the tower's patch rows and grids).

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
    media.py        decoding images (Pillow) and video files (PyAV): the optional extra `vl`
    image_processing.py / video_processing.py   ImageProcessor / VideoProcessor (transformers' rules, in torch)
"""

from .config import Glm53VisionConfig, MultimodalTokenIds, has_vision, vision_parts, with_vision, without_vision
from .groups import FREEZE_GROUPS, group_parameter_names
from .image_processing import ImageProcessor
from .tower import VisionOutput, VisionTower
from .video_processing import VideoProcessor

__all__ = [
    "FREEZE_GROUPS",
    "Glm53VisionConfig",
    "ImageProcessor",
    "MultimodalTokenIds",
    "VideoProcessor",
    "VisionOutput",
    "VisionTower",
    "group_parameter_names",
    "has_vision",
    "vision_parts",
    "with_vision",
    "without_vision",
]
