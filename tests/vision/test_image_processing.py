"""glm53.vision.ImageProcessor against transformers 5.23's Glm5NextImageProcessorPil (the oracle).

Bit for bit where no resize happens; where the budget forces a bicubic resize, within RESIZE_ATOL (derived below).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from glm53.errors import InputError
from glm53.vision import ImageProcessor
from glm53.vision.image_processing import CLIP_STD, BudgetError, canvas_size, patchify
from glm53.vision.media import MediaError

# Tolerance where a resize happens. Pillow resizes 8-bit images in two passes with weights in 22-bit fixed point,
# rounding and clamping to uint8 after each; ours runs the same bicubic passes (a = -0.5) in fp32, width then height,
# rounding and clamping after each. Which pass Pillow runs first depends on its build (Pillow's C source: width first;
# some builds pick by size), and the passes commute only without clamping, so the test images keep their values in
# [LOW, HIGH): a pass moves a value outside its inputs' range by at most the sum of its negative weights times that
# range, <= 0.125 x 192 = 24 (bicubic a = -0.5 at offset 1/2: 2 x 0.0625), so nothing clamps. Each implementation
# then equals the exact two-pass value X plus its first pass's rounding (<= 0.5 level) carried through the second
# pass's weights (L1 norm <= 1.25: 2 x 0.5625 + 2 x 0.0625), plus its own final rounding, so
# |ours - Pillow| < 2 x 0.625 + 1 (+ fixed-point eps): at most 2 levels. One level is 1 / 255 / std after
# normalisation; fp32 normalisation adds < 1e-6. Clamping itself is checked on one-pass resizes (test_clamped_passes).
LOW, HIGH = 32, 224
RESIZE_ATOL = 2 / 255 / min(CLIP_STD) + 1e-6


def _oracle(**kwargs):
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )

    return Glm5NextImageProcessorPil(**kwargs)


def _hf(images, **kwargs):
    out = _oracle(**kwargs)(images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _random(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": None, "LA": 2}[mode]
    shape = (h, w) if channels is None else (h, w, channels)
    a = rng.integers(LOW, HIGH, shape, dtype=np.uint8)
    if channels in (2, 4):  # alpha >= 128 over colours < 160: composited onto white, values stay below HIGH
        a[..., :-1] = rng.integers(LOW, 160, a[..., :-1].shape)
        a[..., -1] = rng.integers(128, 256, a[..., -1].shape)
    return Image.fromarray(a, mode=mode)


def _ours(images, **kwargs):
    out = ImageProcessor(**kwargs)(images)
    return out["pixel_values"], out["image_grid_thw"]


# ------------------------------------------------------------------------------------------------- no resize
@pytest.mark.parametrize(
    "hw", [(448, 448), (112, 140), (100, 150), (1080, 1920), (3000, 2000), (29, 555)], ids=lambda hw: f"{hw[0]}x{hw[1]}"
)
def test_no_resize_bit_equal(hw):
    """Within budget: pixels kept, padded bottom/right with black to multiples of 28, bit-equal to transformers."""
    h, w = hw
    ours = ImageProcessor()
    canvas = ours.canvas(h, w)
    assert canvas == (-(-h // 28) * 28, -(-w // 28) * 28)  # only padding: the budget does not scale these
    image = _random(h, w, seed=h)
    pv, grid = _ours([image])
    ref_pv, ref_grid = _hf([image])
    assert grid.tolist() == ref_grid.tolist() == [[1, canvas[0] // 14, canvas[1] // 14]]
    assert pv.dtype == ref_pv.dtype == torch.float32 and pv.shape == (grid.prod().item(), 1176)
    assert torch.equal(pv, ref_pv)


def test_several_images_and_input_kinds(tmp_path):
    """A list of a PIL image, a uint8 tensor and PNG/JPEG/WebP files: rows concatenated in order, grids per image."""
    a, b = _random(120, 150, 1), _random(150, 120, 2)
    t = torch.from_numpy(np.array(b))
    paths = []
    for ext in ("png", "jpg", "webp"):
        paths.append(str(tmp_path / f"c.{ext}"))
        _random(140, 112, 3).save(paths[-1])
    pv, grid = _ours([a, t, *paths])
    ref_pv, ref_grid = _hf([a, b, *paths])
    assert torch.equal(grid, ref_grid) and grid.shape == (5, 3)
    assert torch.equal(pv, ref_pv)


def test_exif_orientation_applied(tmp_path):
    """A JPEG with EXIF orientation 6 (rotate 90) is read upright, as transformers' load_image does."""
    image = _random(40, 100, 4)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = str(tmp_path / "rot.jpg")
    image.save(path, exif=exif)
    pv, grid = _ours([path])
    ref_pv, ref_grid = _hf([path])
    assert grid.tolist() == ref_grid.tolist() == [[1, 14, 6]]  # 100 x 40 upright, scaled up to the minimum
    torch.testing.assert_close(pv, ref_pv, rtol=0, atol=RESIZE_ATOL)


def test_patch_row_layout():
    """Row r of a 2x4 merge-block grid: block-major, patches of a block row-major, each row (C, T, P, P)."""
    P, frames = 14, torch.arange(2 * 3 * 56 * 112, dtype=torch.float32).view(2, 3, 56, 112)
    rows, grid = patchify(frames)
    assert grid == (1, 4, 8)
    # row 5: block (0, 1) (blocks of 2x2 patches, 4 per row of blocks), patch (0, 1) inside it -> patch (0, 3)
    expect = frames[:, :, 0:P, 3 * P : 4 * P].permute(1, 0, 2, 3).reshape(-1)
    assert torch.equal(rows[5], expect)
    # row 18: block (1, 0), patch (1, 0) -> patch (3, 0)
    assert torch.equal(rows[18], frames[:, :, 3 * P : 4 * P, 0:P].permute(1, 0, 2, 3).reshape(-1))


# ----------------------------------------------------------------------------------------------------- resize
RESIZED = [
    ((10, 10), {}),
    ((7, 300), {}),
    ((56, 84), {}),
    ((3000, 3000), {}),
    ((600, 400), dict(max_tokens=64)),
    ((50, 5000), dict(max_tokens=64)),
    ((5000, 61), dict(max_tokens=100)),
    ((300, 300), dict(min_tokens=500)),
]


@pytest.mark.parametrize(
    "hw,budget",
    RESIZED,
    ids=lambda v: (
        "x".join(map(str, v)) if isinstance(v, tuple) else "-".join(f"{k}{n}" for k, n in v.items()) or "default"
    ),
)
def test_resize_within_tolerance(hw, budget):
    """Below the minimum, above the maximum, odd aspect ratios: same grid, pixels within RESIZE_ATOL."""
    h, w = hw
    image = _random(h, w, seed=w)
    hf_budget = {f"{k[:3]}_image_tokens": v for k, v in budget.items()}
    pv, grid = _ours([image], **budget)
    ref_pv, ref_grid = _hf([image], **hf_budget)
    assert torch.equal(grid, ref_grid)
    assert ImageProcessor(**budget).num_tokens(h, w) * 4 == grid.prod().item()
    torch.testing.assert_close(pv, ref_pv, rtol=0, atol=RESIZE_ATOL)


def _mode_image(mode: str, h: int, w: int) -> Image.Image:
    base = _random(h, w, 5, mode="RGBA" if mode in ("RGBA", "P-transparent") else "RGB")
    if mode == "P-transparent":
        image = base.convert("RGB").quantize(16)
        image.info["transparency"] = 3
        return image
    if mode == "P":
        return base.quantize(16)
    return _random(h, w, 5, mode="LA") if mode == "LA" else base.convert(mode)


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P", "P-transparent", "1", "CMYK"])
def test_modes_converted_like_transformers(mode):
    """Grayscale, alpha (composited onto white), palette (with and without transparency), bilevel, CMYK: bit-equal
    within budget."""
    image = _mode_image(mode, 112, 140)
    pv, grid = _ours([image])
    ref_pv, ref_grid = _hf([image])
    assert torch.equal(grid, ref_grid) and torch.equal(pv, ref_pv)


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P-transparent"])
def test_modes_resized(mode):
    """The same conversions on an image below the minimum budget (resized): within RESIZE_ATOL."""
    image = _mode_image(mode, 45, 70)
    pv, grid = _ours([image])
    ref_pv, ref_grid = _hf([image])
    assert torch.equal(grid, ref_grid)
    torch.testing.assert_close(pv, ref_pv, rtol=0, atol=RESIZE_ATOL)


@pytest.mark.parametrize("size", [(300, 41), (60, 700), (1000, 113), (31, 7000)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_clamped_passes(size):
    """One-pass resizes (only the width or only the height changes) of a hard-edged 0/255 image, where bicubic
    overshoots and both implementations clamp: within one level (a single rounding of values eps apart)."""
    from glm53.vision.image_processing import resize_bicubic

    rng = np.random.default_rng(8)
    a = np.kron(rng.integers(0, 2, (19, 38, 3), dtype=np.uint8) * 255, np.ones((8, 8, 1), np.uint8))[:150, :300]
    for target in ((150, size[1]), (size[0], 300)):
        ref = torch.from_numpy(np.array(Image.fromarray(a).resize(target[::-1], resample=Image.BICUBIC)))
        ours = resize_bicubic(torch.from_numpy(a).permute(2, 0, 1), target).permute(1, 2, 0)
        assert (ours.int() - ref.int()).abs().max() <= 1
        assert ours.min() == 0 and ours.max() == 255  # the overshoot was clamped, not wrapped
        # Exact wherever the unrounded value is not within 0.01 of a .5 boundary: Pillow's 22-bit fixed-point
        # weights move a value by at most taps x 255 x 2^-22 (< 2e-3 for these <= 30-tap filters).
        raw = torch.nn.functional.interpolate(
            torch.from_numpy(a).permute(2, 0, 1)[None].float(), size=target, mode="bicubic", antialias=True
        )[0].permute(1, 2, 0)
        far = ((raw - raw.floor() - 0.5).abs() > 0.01) | (raw < 0) | (raw > 255)
        assert torch.equal(ours[far], ref[far])


# ------------------------------------------------------------------------------------------------ token count
@pytest.mark.parametrize(
    "budget",
    [{}, dict(min_tokens=4, max_tokens=100), dict(min_tokens=64, max_tokens=64)],
    ids=["default", "4-100", "64-64"],
)
def test_token_counts_equal_get_number_of_image_patches(budget):
    hf = _oracle(**{f"{k[:3]}_image_tokens": v for k, v in budget.items()})
    ours = ImageProcessor(**budget)
    sizes = [
        (1, 1),
        (1, 27),
        (28, 28),
        (29, 29),
        (224, 224),
        (448, 448),
        (480, 640),
        (1080, 1920),
        (2160, 3840),
        (17, 911),
        (911, 17),
        (3000, 3000),
        (5000, 100),
        (123, 4567),
    ]
    sizes += [(int(h), int(w)) for h, w in np.random.default_rng(0).integers(1, 4000, (40, 2))]
    for h, w in sizes:
        assert ours.num_tokens(h, w) * 4 == hf.get_number_of_image_patches(h, w), (h, w)


def test_known_counts():
    """VISION_NOTES: 448x448 -> 256 tokens; 1080x1920 -> 2691."""
    assert ImageProcessor().num_tokens(448, 448) == 256
    assert ImageProcessor().num_tokens(1080, 1920) == 2691


# ------------------------------------------------------------------------------------------------- bad input
def test_bad_inputs(tmp_path):
    ours = ImageProcessor()
    with pytest.raises(InputError, match=r"images\[1\]: a tensor image must be uint8 \[H, W, 3\]"):
        ours([torch.zeros(4, 4, 3, dtype=torch.uint8), torch.zeros(4, 4, 3)])
    with pytest.raises(InputError, match=r"images\[0\]: a tensor image must be uint8 .* \(3, 4, 4\)"):
        ours([torch.zeros(3, 4, 4, dtype=torch.uint8)])
    with pytest.raises(InputError, match=r"images\[0\]: expected a PIL image.*got int"):
        ours([3])
    with pytest.raises(InputError, match="non-empty list"):
        ours([])
    with pytest.raises(MediaError, match="nope.png: no such image file"):
        ours([str(tmp_path / "nope.png")])
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(MediaError, match="bad.png: not a readable image"):
        ours([str(bad)])
    buf = io.BytesIO()
    _random(200, 200, 7).save(buf, format="PNG")
    cut = tmp_path / "cut.png"
    cut.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(MediaError, match="cut.png: not a readable image"):
        ours([str(cut)])


def test_budget_errors():
    """An aspect ratio no height can fit (transformers squashes it into one 28x28 block) and bad options."""
    with pytest.raises(BudgetError, match="1x300000 .*cannot fit 8000 tokens"):
        ImageProcessor().num_tokens(1, 300000)
    assert canvas_size(2, 1, 20000, 16, 8000) == (28, 20020)  # still fits: not an error
    with pytest.raises(InputError, match="min_tokens 10 is above max_tokens 5"):
        ImageProcessor(min_tokens=10, max_tokens=5)
    with pytest.raises(InputError, match="max_tokens must be a positive int, got 0"):
        ImageProcessor(max_tokens=0)
