"""Decoding media into uint8 RGB pixels: image files through Pillow, video files through PyAV.

Legend: H height, W width, C = 3 colour channels (RGB), F frames; pixels are torch.uint8 [H, W, C].
Pillow and PyAV are the optional extra `vl` (`pip install -e '.[vl]'`); a missing one is an ImportError naming
the extra. Conversions follow transformers 5.23 so pixels match its processors:
- a file (transformers' `load_image`): EXIF orientation applied, then Pillow's plain `convert("RGB")`;
- a PIL image object (transformers' `convert_to_rgb`): an image with alpha (or a palette transparency) is
  composited onto white, any other mode converted to RGB.
"""

from __future__ import annotations

import os

import torch

from ..errors import InputError

VL_EXTRA = "pip install -e '.[vl]'"


class MediaError(InputError):
    """A media file that is missing, unreadable or not an image/video; the message names the file."""


def require_pillow():
    """The `PIL.Image` module, or an ImportError naming the `vl` extra."""
    try:
        from PIL import Image, ImageOps  # noqa: F401
    except ImportError as e:  # pragma: no cover - Pillow is installed in the test environment
        raise ImportError(f"reading images needs Pillow, part of glm53's optional extra: {VL_EXTRA}") from e
    return Image


def require_av():
    """The PyAV module, or an ImportError naming the `vl` extra."""
    try:
        import av
    except ImportError as e:  # pragma: no cover - PyAV is installed in the test environment
        raise ImportError(f"reading video files needs PyAV, part of glm53's optional extra: {VL_EXTRA}") from e
    return av


def pil_to_rgb(image) -> torch.Tensor:
    """A PIL image -> uint8 [H, W, 3]; alpha (or palette transparency) composited onto white."""
    Image = require_pillow()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    else:
        image = image.convert("RGB")
    return _from_pil(image)


def _from_pil(image) -> torch.Tensor:
    """An RGB PIL image -> uint8 [H, W, 3] (through its raw bytes: no numpy needed)."""
    width, height = image.size
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)


def load_image(path: str) -> torch.Tensor:
    """An image file (PNG, JPEG, WebP, ... anything Pillow reads) -> uint8 [H, W, 3], EXIF orientation applied."""
    Image = require_pillow()
    from PIL import ImageOps, UnidentifiedImageError

    if not os.path.isfile(path):
        raise MediaError(f"{path}: no such image file")
    try:
        with Image.open(path) as image:
            image.load()  # decode now: a truncated file fails here, named, not later inside a batch
            image = ImageOps.exif_transpose(image)
            return _from_pil(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:  # Pillow's errors for bad data
        raise MediaError(f"{path}: not a readable image ({type(e).__name__}: {e})") from None


def as_rgb(image, what: str) -> torch.Tensor:
    """One image input (a PIL image, a uint8 [H, W, 3] tensor or a file path) -> uint8 [H, W, 3]."""
    if isinstance(image, (str, os.PathLike)):
        return load_image(os.fspath(image))
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[-1] != 3 or 0 in image.shape:
            raise InputError(
                f"{what}: a tensor image must be uint8 [H, W, 3] (RGB, channels last), got "
                f"{image.dtype} {tuple(image.shape)}"
            )
        return image
    if type(image).__module__.startswith("PIL."):
        return pil_to_rgb(image)
    raise InputError(
        f"{what}: expected a PIL image, a uint8 [H, W, 3] tensor or a file path, got {type(image).__name__}"
    )


def load_video(path: str) -> tuple[list[torch.Tensor], float]:
    """A video file -> (every frame as uint8 [H, W, 3], the stream's average fps), decoded through PyAV."""
    av = require_av()
    if not os.path.isfile(path):
        raise MediaError(f"{path}: no such video file")
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise MediaError(f"{path}: the file has no video stream")
            stream = container.streams.video[0]
            frames = [_from_pil(f.to_image()) for f in container.decode(stream)]  # to_image: RGB24
            rate = stream.average_rate or stream.guessed_rate
    except (av.error.FFmpegError, ValueError) as e:
        raise MediaError(f"{path}: not a readable video ({type(e).__name__}: {e})") from None
    if not frames:
        raise MediaError(f"{path}: the video has no frames")
    if not rate or float(rate) <= 0:
        raise MediaError(f"{path}: the video stream has no frame rate")
    return frames, float(rate)


__all__ = [
    "VL_EXTRA",
    "MediaError",
    "as_rgb",
    "load_image",
    "load_video",
    "pil_to_rgb",
    "require_av",
    "require_pillow",
]
