"""The video processor: frames -> `pixel_values_videos` [N, C·T·P·P], `video_grid_thw` [V, 3] and timestamps.

Legend: V videos, F sampled frames (even), C = 3 channels, H/W pixel height/width, P patch size, T temporal
patch size (2), m merge size, t = F/T temporal slices, h/w the grid in patches, N = Σ t·h·w.
The rules of transformers 5.23's `Glm5NextVideoProcessor` (`video_processing_glm5_next.py`, which needs
torchvision), in torch:
1. sampling (`sample_frames`): `fps` frames per second of the clip (default 2) from its frame rate, at most
   `max_frames` (2048); duplicate indices dropped; an odd count repeats its last frame.
2. the image rule (image_processing.canvas_size / content_size) with the spatio-temporal budget: the F frames
   together within [min_tokens, max_tokens] (16, 240000) tokens of T·28² pixels.
3. resize as torchvision does for uint8 video: one fp32 antialiased bicubic pass over both sides, clamped and
   rounded (no rounding between the passes, unlike Pillow's image path); padding bottom/right with black.
4. rescale and normalise fused as transformers' torch backend: (x - 255·mean) / (255·std) in fp32.
5. patchify with two consecutive sampled frames per row; grid (F/T, h, w).
Timestamps: one per temporal slice, the time (index / clip fps) of its first frame; the expansion writes them as
"{t:.1f} seconds" (processing.py).
Sources: a folder of extracted frames (image files in natural name order, `frame_2` before `frame_10`, with the
clip's fps from the record or `default_fps`), a video file through PyAV (extra `vl`; fps and frame count from
the stream), or frames given directly (uint8 [F, H, W, 3] or a list of images) with their fps.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from .image_processing import (
    CLIP_MEAN,
    CLIP_STD,
    MERGE_SIZE,
    MIN_IMAGE_TOKENS,
    PATCH_SIZE,
    RESCALE,
    TEMPORAL_PATCH_SIZE,
    canvas_size,
    content_size,
    patchify,
)
from .media import MediaError, as_rgb, load_image, require_av

MAX_VIDEO_TOKENS = 240000  # transformers' Glm5NextVideoProcessor.max_image_tokens (the whole clip)
SAMPLE_FPS = 2  # frames sampled per second of the clip (.fps)
MAX_FRAMES = 2048  # (.max_frames)
DEFAULT_FPS = 24.0  # a clip's frame rate when nothing gives it (transformers' fallback in Glm5NextProcessor)
FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def sample_frames(
    total: int,
    clip_fps: float,
    sample_fps: float = SAMPLE_FPS,
    max_frames: int = MAX_FRAMES,
    duration: float | None = None,
) -> list[int]:
    """Indices of the frames to keep from a clip of `total` frames at `clip_fps` (transformers'
    `Glm5NextVideoProcessor.sample_frames`, max_duration 0): an even count."""
    duration = duration or round((total - 1) / clip_fps) + 1
    max_seconds = int(duration)
    wanted = min(int(duration * sample_fps), max_frames)
    if total < wanted:
        indices = _linspace(0, total - 1, wanted)
    else:
        indices, second, step = [], 0.0, 1 / sample_fps
        for i in range(total):
            if i / clip_fps >= second:
                second += step
                indices.append(i)
                if second >= max_seconds:
                    break
    if len(indices) < wanted:
        start, end = (indices[0], indices[-1]) if indices else (0, max(total - 1, 0))
        indices = _linspace(start, end, wanted)
    elif len(indices) > wanted:
        indices = _linspace(0, total - 1, wanted)
    unique = list(dict.fromkeys(indices))
    if len(unique) % 2:
        unique.append(unique[-1])
    return unique


def _linspace(start: int, end: int, count: int) -> list[int]:
    """numpy.linspace(start, end, count, dtype=int): evenly spaced in float64, truncated towards zero."""
    if count == 1:
        return [int(start)]
    step = (end - start) / (count - 1)
    return [int(start + i * step) if i < count - 1 else int(end) for i in range(count)]


def resize_video(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 [F, C, H, W] -> uint8 [F, C, *size]: torchvision's uint8 bicubic (one fp32 antialiased pass,
    clamped to 0..255, rounded)."""
    x = F.interpolate(frames.to(torch.float32), size=size, mode="bicubic", antialias=True, align_corners=False)
    return x.clamp_(0, 255).round_().to(torch.uint8)


def normalize_fused(frames: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C, H, W] -> fp32 (x - mean/rescale) / (std/rescale), transformers' fused torch path."""
    mean = (torch.tensor(CLIP_MEAN) * (1.0 / RESCALE)).view(-1, 1, 1)
    std = (torch.tensor(CLIP_STD) * (1.0 / RESCALE)).view(-1, 1, 1)
    return (frames.to(torch.float32) - mean) / std


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def frame_files(folder: str) -> list[str]:
    """The image files of a frames folder in natural name order; a folder without any is a MediaError."""
    if not os.path.isdir(folder):
        raise MediaError(f"{folder}: no such frames folder")
    names = [n for n in os.listdir(folder) if n.lower().endswith(FRAME_EXTENSIONS)]
    if not names:
        raise MediaError(
            f"{folder}: the frames folder holds no frames (image files ending in {', '.join(FRAME_EXTENSIONS)})"
        )
    return [os.path.join(folder, n) for n in sorted(names, key=_natural_key)]


@dataclass
class Clip:
    """A decoded clip: the kept frames, uint8 [F, H, W, 3], their indices into the clip, and the clip's fps."""

    frames: torch.Tensor
    indices: list[int]
    fps: float
    source: str = "frames"

    @property
    def timestamps(self) -> list[float]:
        return [i / self.fps for i in self.indices]


@dataclass
class VideoProcessor:
    """`VideoProcessor()(videos, fps=None)` -> {"pixel_values_videos", "video_grid_thw", "timestamps"}.

    videos: a list of frames-folder paths, video-file paths, uint8 [F, H, W, 3] tensors or lists of images;
    fps: the clips' frame rates (one number for all, or one per video; files use their stream's rate).
    """

    min_tokens: int = MIN_IMAGE_TOKENS  # for the whole clip (transformers' min_image_tokens)
    max_tokens: int = MAX_VIDEO_TOKENS  # (max_image_tokens)
    sample_fps: float = SAMPLE_FPS
    max_frames: int = MAX_FRAMES
    default_fps: float = DEFAULT_FPS
    patch_size: int = PATCH_SIZE
    merge_size: int = MERGE_SIZE
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE

    def __post_init__(self) -> None:
        for name in ("min_tokens", "max_tokens", "max_frames", "patch_size", "merge_size", "temporal_patch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"VideoProcessor.{name} must be a positive int, got {value!r}")
        for name in ("sample_fps", "default_fps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InputError(f"VideoProcessor.{name} must be a positive number, got {value!r}")
        if self.min_tokens > self.max_tokens:
            raise InputError(f"VideoProcessor.min_tokens {self.min_tokens} is above max_tokens {self.max_tokens}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    # ------------------------------------------------------------------------------------------- decoding
    def load(self, video, fps: float | None = None, what: str = "video") -> Clip:
        """One video input -> its sampled frames (see the class docstring for the kinds)."""
        if fps is not None and (
            isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0
        ):
            raise InputError(f"{what}: fps must be a positive number, got {fps!r}")
        if isinstance(video, (str, os.PathLike)):
            path = os.fspath(video)
            if os.path.isdir(path):
                return self._from_folder(path, float(fps or self.default_fps))
            return self._from_file(path)
        if isinstance(video, torch.Tensor):
            if video.dtype != torch.uint8 or video.dim() != 4 or video.shape[-1] != 3 or 0 in video.shape:
                raise InputError(
                    f"{what}: a tensor video must be uint8 [F, H, W, 3], got {video.dtype} {tuple(video.shape)}"
                )
            frames = video
        elif isinstance(video, (list, tuple)) and video:
            frames = _stack([as_rgb(f, f"{what} frame {i}") for i, f in enumerate(video)], what)
        else:
            raise InputError(
                f"{what}: expected a frames folder, a video file, a uint8 [F, H, W, 3] tensor or a "
                f"non-empty list of frames, got {type(video).__name__}"
            )
        clip_fps = float(fps or self.default_fps)
        indices = self.sample(frames.shape[0], clip_fps, what=what)
        return Clip(frames[indices], indices, clip_fps)

    def sample(self, total: int, clip_fps: float, duration: float | None = None, what: str = "video") -> list[int]:
        """The frame indices kept from a clip; a clip too short to keep any (transformers returns none and fails
        later) is a MediaError naming it."""
        indices = sample_frames(total, clip_fps, self.sample_fps, self.max_frames, duration)
        if not indices:
            seconds = duration or round((total - 1) / clip_fps) + 1
            raise MediaError(
                f"{what}: a {seconds:.2f} s clip ({total} frames at {clip_fps:g} fps) is too short to "
                f"sample at {self.sample_fps:g} fps"
            )
        return indices

    def _from_folder(self, folder: str, clip_fps: float) -> Clip:
        files = frame_files(folder)
        indices = self.sample(len(files), clip_fps, len(files) / clip_fps, folder)
        frames = _stack([load_image(files[i]) for i in dict.fromkeys(indices)], folder)
        position = {i: k for k, i in enumerate(dict.fromkeys(indices))}
        return Clip(frames[[position[i] for i in indices]], indices, clip_fps, folder)

    def _from_file(self, path: str) -> Clip:
        av = require_av()
        if not os.path.isfile(path):
            raise MediaError(f"{path}: no such video file or frames folder")
        try:
            with av.open(path) as container:
                if not container.streams.video:
                    raise MediaError(f"{path}: the file has no video stream")
                stream = container.streams.video[0]
                clip_fps = float(stream.average_rate or 0)
                total = stream.frames
                frames = None
                if not total:  # a container without a frame count: decode to count
                    frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
                    total = len(frames)
                if not total or clip_fps <= 0:
                    raise MediaError(f"{path}: the video has no frames or no frame rate")
                indices = self.sample(total, clip_fps, total / clip_fps, path)
                if frames is None:
                    container.seek(0)
                    wanted, frames = set(indices), {}
                    for i, frame in enumerate(container.decode(stream)):
                        if i > indices[-1]:
                            break
                        if i in wanted:
                            frames[i] = frame.to_ndarray(format="rgb24")
                else:
                    frames = dict(enumerate(frames))
        except av.error.FFmpegError as e:
            raise MediaError(f"{path}: not a readable video ({type(e).__name__}: {e})") from None
        missing = [i for i in indices if i not in frames]
        if missing:
            raise MediaError(f"{path}: the stream announces {total} frames but frame {missing[0]} could not be decoded")
        return Clip(torch.stack([torch.from_numpy(frames[i]) for i in indices]), indices, clip_fps, path)

    # ------------------------------------------------------------------------------------------ processing
    def canvas(self, frames: int, height: int, width: int) -> tuple[int, int]:
        return canvas_size(
            frames, height, width, self.min_tokens, self.max_tokens, self.factor, self.temporal_patch_size
        )

    def layout(self, clip: Clip) -> tuple[tuple[int, int, int], list[float], tuple[int, int], tuple[int, int]]:
        """A clip's (grid (t, h, w), one timestamp per temporal slice, canvas, content size), without pixels."""
        n, height, width = clip.frames.shape[:3]
        canvas = self.canvas(n, height, width)
        size = content_size(n, height, width, canvas, self.min_tokens, self.factor, self.temporal_patch_size)
        t = -(-n // self.temporal_patch_size)
        stamps = clip.timestamps[:: self.temporal_patch_size][:t]
        stamps += [stamps[-1] if stamps else 0.0] * (t - len(stamps))
        return (t, canvas[0] // self.patch_size, canvas[1] // self.patch_size), stamps, canvas, size

    def process(self, clip: Clip) -> tuple[torch.Tensor, tuple[int, int, int], list[float]]:
        """A clip -> (rows [t·h·w, C·T·P·P], grid (t, h, w), one timestamp per temporal slice)."""
        grid, stamps, canvas, size = self.layout(clip)
        frames = clip.frames.permute(0, 3, 1, 2)  # [F, C, H, W]
        if pad := -frames.shape[0] % self.temporal_patch_size:  # patchify's rule (sampling gives an even count)
            frames = torch.cat([frames, frames[-1:].expand(pad, *frames.shape[1:])])
        if size != tuple(frames.shape[-2:]):
            frames = resize_video(frames, size)
        frames = F.pad(frames, (0, canvas[1] - size[1], 0, canvas[0] - size[0]))
        rows, _ = patchify(normalize_fused(frames), self.patch_size, self.merge_size, self.temporal_patch_size)
        return rows, grid, stamps

    def __call__(self, videos, fps=None) -> dict:
        if not isinstance(videos, (list, tuple)) or not videos:
            raise InputError(f"VideoProcessor: expected a non-empty list of videos, got {type(videos).__name__}")
        rates = list(fps) if isinstance(fps, (list, tuple)) else [fps] * len(videos)
        if len(rates) != len(videos):
            raise InputError(f"VideoProcessor: {len(rates)} fps values for {len(videos)} videos")
        rows, grids, stamps = [], [], []
        for i, (video, rate) in enumerate(zip(videos, rates)):
            r, grid, s = self.process(self.load(video, rate, f"videos[{i}]"))
            rows.append(r)
            grids.append(grid)
            stamps.append(s)
        return {
            "pixel_values_videos": torch.cat(rows),
            "video_grid_thw": torch.tensor(grids, dtype=torch.long),
            "timestamps": stamps,
        }


def _stack(frames: list[torch.Tensor], what: str) -> torch.Tensor:
    sizes = {tuple(f.shape) for f in frames}
    if len(sizes) > 1:
        raise MediaError(
            f"{what}: the frames differ in size ({', '.join(map(str, sorted(sizes)))}); a clip's frames "
            f"must all be one size"
        )
    return torch.stack(frames)


__all__ = [
    "MAX_VIDEO_TOKENS",
    "Clip",
    "VideoProcessor",
    "frame_files",
    "normalize_fused",
    "resize_video",
    "sample_frames",
]
