"""glm53.vision.VideoProcessor against the rules of transformers 5.23's Glm5NextVideoProcessor.

That class needs torchvision (whose wheel does not load here), so its torch/Python methods are compiled from its
source (tests/helpers/video_oracle.py) and compared directly: frame sampling, the budget (token counts), patchify.
Resizing, done by torchvision there, is checked against Pillow within a derived bound.
"""

from __future__ import annotations

import fractions

import numpy as np
import pytest
import torch
from PIL import Image

from glm53.errors import InputError
from glm53.vision.image_processing import normalize
from glm53.vision.media import MediaError
from glm53.vision.video_processing import (
    VideoProcessor,
    frame_files,
    normalize_fused,
    resize_video,
    sample_frames,
)
from tests.helpers.video_oracle import video_oracle

LOW, HIGH = 32, 224  # frame values: no clamping in any bicubic pass (tests/vision/test_image_processing.py)


def _frames(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(LOW, HIGH, (n, h, w, 3), generator=g, dtype=torch.uint8)


# -------------------------------------------------------------------------------------------------- sampling
CLIPS = [
    (100, 30.0, None),
    (100, 30.0, 100 / 30),
    (7, 24.0, None),
    (3, 1.0, None),
    (1, 24.0, None),
    (500, 2.0, None),
    (61, 29.97, 61 / 29.97),
    (10, 0.5, 20.0),
    (5000, 60.0, None),
    (9, 4.0, 9 / 4),
    (2, 30.0, None),
]


@pytest.mark.parametrize("total,fps,duration", CLIPS, ids=lambda v: str(v))
@pytest.mark.parametrize("sample_fps,max_frames", [(2, 2048), (1, 2048), (3.0, 16)], ids=["2fps", "1fps", "3fps-16"])
def test_sampling_equals_transformers(total, fps, duration, sample_fps, max_frames):
    from transformers.video_utils import VideoMetadata

    oracle = video_oracle(fps=sample_fps, max_frames=max_frames)
    meta = VideoMetadata(total_num_frames=total, fps=fps, duration=duration)
    ours = sample_frames(total, fps, sample_fps, max_frames, duration)
    assert ours == oracle.sample_frames(meta).tolist()
    assert len(ours) % 2 == 0 and len(ours) <= max(max_frames, 2) + 1


# ---------------------------------------------------------------------------------------------------- budget
@pytest.mark.parametrize("budget", [{}, dict(min_tokens=64, max_tokens=2000)], ids=["default", "64-2000"])
def test_token_counts_equal_get_num_of_video_patches(budget):
    oracle = video_oracle(**{f"{k[:3]}_image_tokens": v for k, v in budget.items()})
    ours = VideoProcessor(**budget)
    rng = np.random.default_rng(0)
    cases = [
        (2, 448, 448),
        (16, 1080, 1920),
        (64, 720, 1280),
        (2048, 360, 640),
        (2, 10, 10),
        (4, 30, 2000),
        *((int(2 * f), int(h), int(w)) for f, h, w in rng.integers(1, 800, (30, 3))),
    ]
    for frames, h, w in cases:
        canvas = ours.canvas(frames, h, w)
        patches = (frames // 2) * (canvas[0] // 14) * (canvas[1] // 14)
        assert patches == oracle.get_num_of_video_patches(frames, h, w), (frames, h, w)
        assert canvas == tuple(oracle.smart_resize(frames, h, w, 2, 28, ours.min_tokens, ours.max_tokens))


# ------------------------------------------------------------------------------------------------- pipeline
def test_no_resize_equals_transformers_patchify():
    """A clip within budget: padded, normalised as the fused torch path, patchified exactly as transformers."""
    video = _frames(6, 90, 120)
    out = VideoProcessor()([video], fps=4.0)  # 6 frames at 4 fps: duration round(5/4) + 1 = 2 s: 4 frames
    idx = sample_frames(6, 4.0)
    assert idx == [0, 1, 2, 4]  # 0, 2, 4 by the clock, then spread to 4 by linspace
    canvas = torch.zeros(4, 3, 112, 140, dtype=torch.uint8)
    canvas[:, :, :90, :120] = video[idx].permute(0, 3, 1, 2)
    ref, t, h, w = video_oracle().patchify(normalize_fused(canvas)[None], 14, 2, 2)
    assert out["video_grid_thw"].tolist() == [[t, h, w]] == [[2, 8, 10]]
    assert torch.equal(out["pixel_values_videos"], ref[0])
    assert out["timestamps"] == [[0 / 4, 2 / 4]]  # every second sampled frame's index / clip fps


def test_fused_normalisation_is_transformers():
    """(x - 255 mean) / (255 std) in fp32 with transformers' constants; within 2 ulp of the image path's
    (x / 255 - mean) / std (two roundings apart)."""
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    mean, std, _ = TorchvisionBackend._fuse_mean_std_and_rescale_factor(
        None,
        do_normalize=True,
        image_mean=tuple(OPENAI_CLIP_MEAN),
        image_std=tuple(OPENAI_CLIP_STD),
        do_rescale=True,
        rescale_factor=1 / 255,
        device="cpu",
    )
    x = torch.arange(256, dtype=torch.uint8).view(1, 1, 256).expand(3, 2, 256)
    ref = (x.float() - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    assert torch.equal(normalize_fused(x), ref)
    torch.testing.assert_close(normalize_fused(x), normalize(x), rtol=0, atol=2 * 2**-23 * 2.2)


@pytest.mark.parametrize("hw,size", [((60, 90), (120, 168)), ((500, 300), (230, 140)), ((40, 400), (30, 610))])
def test_resize_within_two_levels_of_pillow(hw, size):
    """torchvision's uint8 bicubic: one fp32 pass, rounded once. Pillow rounds after each of its two passes: its
    value is the exact one plus its first rounding (<= 0.5) through the second pass's weights (L1 <= 1.25) plus its
    final rounding, so the two differ by < 0.625 + 1: at most 2 levels (no clamping: values in [LOW, HIGH))."""
    frames = _frames(2, *hw, seed=3)
    ours = resize_video(frames.permute(0, 3, 1, 2), size).permute(0, 2, 3, 1)
    for i in range(2):
        ref = np.array(Image.fromarray(frames[i].numpy()).resize(size[::-1], resample=Image.BICUBIC))
        diff = ours[i].int() - torch.from_numpy(ref).int()
        assert diff.abs().max() <= 2
        # Rounded, not truncated: Pillow's extra rounding error is symmetric in sign, so the mean difference stays
        # near 0, while truncating would shift it by -0.5 level; half of that is the bound.
        assert diff.float().mean().abs() < 0.25


def test_resized_clip_grid_and_rows():
    """A clip above the budget is shrunk: grid from the budget rule, rows a resize of the frames then patchify."""
    proc = VideoProcessor(max_tokens=200)
    video = _frames(8, 300, 400, seed=4)
    out = proc([video], fps=2.0)
    idx = sample_frames(8, 2.0)
    canvas = proc.canvas(len(idx), 300, 400)
    assert out["video_grid_thw"].tolist() == [[len(idx) // 2, canvas[0] // 14, canvas[1] // 14]]
    assert len(idx) // 2 * canvas[0] * canvas[1] // 28**2 <= 200
    from glm53.vision.image_processing import content_size

    size = content_size(len(idx), 300, 400, canvas, 16)
    small = resize_video(video[idx].permute(0, 3, 1, 2), size)
    padded = torch.nn.functional.pad(small, (0, canvas[1] - size[1], 0, canvas[0] - size[0]))
    ref, *_ = video_oracle().patchify(normalize_fused(padded)[None], 14, 2, 2)
    assert torch.equal(out["pixel_values_videos"], ref[0])


# --------------------------------------------------------------------------------------------------- sources
def test_frames_folder_natural_order_and_fps(tmp_path):
    frames = _frames(5, 56, 56, seed=5)
    names = ["f_1.png", "f_2.png", "f_10.png", "f_3.png", "f_20.png"]  # natural order: 1, 2, 3, 10, 20
    order = [0, 1, 3, 2, 4]  # frames[k] written as the k-th name in natural order
    for k, name in zip(order, names):
        Image.fromarray(frames[k].numpy()).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a frame")
    assert [p.rsplit("/", 1)[1] for p in frame_files(str(tmp_path))] == [
        "f_1.png",
        "f_2.png",
        "f_3.png",
        "f_10.png",
        "f_20.png",
    ]
    proc = VideoProcessor()
    clip = proc.load(str(tmp_path), fps=2.0)
    assert clip.indices == sample_frames(5, 2.0, duration=2.5) and clip.fps == 2.0
    assert torch.equal(clip.frames, frames[clip.indices])
    assert VideoProcessor(sample_fps=24).load(str(tmp_path)).fps == 24.0  # the default when the record gives none
    with pytest.raises(MediaError, match=r"0.21 s clip \(5 frames at 24 fps\) is too short to sample at 2 fps"):
        proc.load(str(tmp_path))  # 5 frames at the default 24 fps: no frame at 2 fps


def test_video_file_through_pyav(tmp_path):
    """A lossless (FFV1) file: frames decoded exactly, fps and frame count from the stream."""
    import av

    frames, path = _frames(20, 64, 96, seed=6), str(tmp_path / "clip.mkv")
    with av.open(path, "w") as out:
        stream = out.add_stream("ffv1", rate=fractions.Fraction(10))
        stream.width, stream.height, stream.pix_fmt = 96, 64, "bgr0"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f.numpy(), format="rgb24")))
        out.mux(stream.encode())
    clip = VideoProcessor().load(path)
    assert clip.fps == 10.0
    assert clip.indices == sample_frames(20, 10.0, duration=2.0) == [0, 5, 10, 15]
    assert torch.equal(clip.frames, frames[clip.indices])


def test_bad_videos(tmp_path):
    proc = VideoProcessor()
    (tmp_path / "empty").mkdir()
    with pytest.raises(MediaError, match="empty: the frames folder holds no frames"):
        proc.load(str(tmp_path / "empty"))
    with pytest.raises(MediaError, match="nope.mp4: no such video file or frames folder"):
        proc.load(str(tmp_path / "nope.mp4"))
    (tmp_path / "bad.mp4").write_bytes(b"\x00" * 100)
    with pytest.raises(MediaError, match="bad.mp4: not a readable video"):
        proc.load(str(tmp_path / "bad.mp4"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    Image.fromarray(_frames(1, 30, 30)[0].numpy()).save(mixed / "0.png")
    Image.fromarray(_frames(1, 30, 40)[0].numpy()).save(mixed / "1.png")
    with pytest.raises(MediaError, match="mixed: the frames differ in size"):
        proc.load(str(mixed), fps=1.0)
    with pytest.raises(InputError, match=r"videos\[0\]: fps must be a positive number, got -1"):
        proc([_frames(2, 28, 28)], fps=-1)
    with pytest.raises(InputError, match=r"video: a tensor video must be uint8 \[F, H, W, 3\]"):
        proc.load(torch.zeros(2, 28, 28, 3))
    with pytest.raises(InputError, match="VideoProcessor.sample_fps must be a positive number"):
        VideoProcessor(sample_fps=0)
