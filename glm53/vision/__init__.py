"""Vision: the image and video processors (pixels -> the tower's patch rows and grids); the tower itself is
reserved: checkpoints' `model.visual.*` keys are skipped on load and kept by the crop tool."""

from .image_processing import ImageProcessor
from .video_processing import VideoProcessor

__all__ = ["ImageProcessor", "VideoProcessor"]
