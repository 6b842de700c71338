"""VisionTower == transformers' Glm5NextVisionModel (eager): pooler_output, last_hidden_state and every
parameter's gradient, on one image, mixed sizes, a video with 3 temporal slices and an image + a video; bf16."""

from __future__ import annotations

import re

import pytest
import torch
from transformers.vision_utils import get_vision_position_ids

from glm53.errors import InputError
from glm53.kernels import use_backend
from glm53.vision.rotary import inverse_frequencies, patch_positions
from tests.helpers.vision import TOWER, hf_tower, our_tower, pixels

# fp32 (eps 1.2e-7): every output passes ~2 blocks x (qkv 16 + attention <= 36 keys + MLP 24) + the merger's
# 64 + 20-term sums, each adding ~n eps relative: ~300 eps ~ 4e-5 of the output scale bounds the difference
# (the two differ in summation order only: linear vs Conv3d/Conv2d, SDPA vs eager attention).
FP32_REL = 4e-5
GRAD_REL = 1e-4  # relative L2 per gradient tensor: the forward bound, doubled through the backward pass
GRIDS = {
    "one-image": [(1, 4, 6)],
    "mixed-sizes": [(1, 4, 6), (1, 2, 2), (1, 6, 4), (1, 8, 2)],
    "video-3-slices": [(3, 4, 4)],
    "image-and-video": [(1, 2, 4), (2, 4, 2)],
}


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def towers():
    hf = hf_tower(seed=0)
    return hf, our_tower(hf)


@pytest.mark.parametrize("grid", list(GRIDS), ids=list(GRIDS))
def test_outputs_match_transformers(towers, grid):
    hf, ours = towers
    x, g = pixels(GRIDS[grid])
    with torch.no_grad():
        ref = hf(x, grid_thw=g)
        got = ours(x, g)
    assert got.pooler_output.shape == ref.pooler_output.shape == (x.shape[0] // 4, TOWER["out_hidden_size"])
    assert max_rel(got.pooler_output, ref.pooler_output) < FP32_REL
    assert max_rel(got.last_hidden_state, ref.last_hidden_state) < FP32_REL


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_every_parameter_gradient_matches_transformers(towers, backend):
    hf, ours = towers
    x, g = pixels(GRIDS["image-and-video"] + [(1, 6, 4)], seed=3)
    cot = torch.randn(x.shape[0] // 4, TOWER["out_hidden_size"], generator=torch.Generator().manual_seed(5))
    hf.zero_grad()
    ours.zero_grad()
    (hf(x, grid_thw=g).pooler_output * cot).sum().backward()
    with use_backend(backend, ["segment_attention"]):
        (ours(x, g).pooler_output * cot).sum().backward()
    theirs = dict(hf.named_parameters())
    names = [n for n, _ in ours.named_parameters()]
    assert sorted(names) == sorted(theirs)
    for name, p in ours.named_parameters():
        ref = theirs[name].grad
        assert ref.abs().max() > 0, name
        err = ((p.grad - ref).norm() / ref.norm()).item()
        assert err < GRAD_REL, f"{name}: {err:.2e}"


def test_clamps_bite_and_norms_are_not_trivial(towers):
    """The tests above run with swiglu_limit 1.5: gate and up exceed it in every SwiGLU (blocks and merger)."""
    _, ours = towers
    seen = {}

    def hook(name):
        return lambda mod, inp, out: seen.__setitem__(name, (out.abs() > TOWER["swiglu_limit"]).float().mean().item())

    handles = [m.gate_proj.register_forward_hook(hook(n)) for n, m in ours.named_modules() if hasattr(m, "gate_proj")]
    handles += [
        m.up_proj.register_forward_hook(hook(n + ".up")) for n, m in ours.named_modules() if hasattr(m, "up_proj")
    ]
    x, g = pixels(GRIDS["mixed-sizes"])
    with torch.no_grad():
        ours(x, g)
    for h in handles:
        h.remove()
    assert len(seen) == 6 and all(0.02 < f < 0.98 for f in seen.values()), seen
    for name, p in ours.named_parameters():
        if p.dim() == 1:
            assert (p - p.mean()).abs().max() > 0.1 and p.abs().max() > 0.1, name


def test_bf16_tower_within_bf16_rounding_of_transformers_bf16(towers):
    hf, _ = towers
    hf16 = hf_tower(seed=0).to(torch.bfloat16)
    ours16 = our_tower(hf, torch.bfloat16)
    assert list(ours16.buffers()) == []  # nothing a dtype cast can round: the rope frequencies are computed
    x, g = pixels(GRIDS["mixed-sizes"])
    with torch.no_grad():
        ref32 = hf(x, grid_thw=g).pooler_output
        ref = hf16(x, grid_thw=g).pooler_output
        got = ours16(x, g).pooler_output
    assert got.dtype == torch.bfloat16
    # both are bf16 computations of the same fp32 function: each within a few dozen bf16 steps (2^-8) of fp32
    # through ~10 rounded matmul/norm stages; measured ~1e-2 of the output scale
    assert max_rel(got.float(), ref32) < 0.06 and max_rel(ref.float(), ref32) < 0.06
    assert max_rel(got.float(), ref.float()) < 0.06


def test_rope_frequencies_stay_fp32_exact_after_bf16_cast():
    want = 1.0 / (10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4))
    got = inverse_frequencies(8, 10000.0)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("grid", list(GRIDS), ids=list(GRIDS))
def test_patch_positions_equal_transformers(grid):
    g = torch.tensor(GRIDS[grid])
    assert torch.equal(patch_positions(g, 2), get_vision_position_ids(g, 2))


BAD = {
    "row-width": (lambda x, g: (x[:, :20], g), "must be [patches, C*T*P*P = 24]"),
    "rows-vs-grid": (lambda x, g: (x[:-4], g), "pixel_values has 20 rows but image_grid_thw describes 24 patches"),
    "zero-in-grid": (lambda x, g: (x, torch.tensor([[1, 0, 6]])), "image_grid_thw[0] = (1, 0, 6): t, h and w"),
    "merge-size": (
        lambda x, g: (x[:18], torch.tensor([[1, 3, 6]])),
        "h and w must be divisible by spatial_merge_size 2",
    ),
    "float-grid": (lambda x, g: (x, g.float()), "integer torch.Tensor"),
    "grid-shape": (lambda x, g: (x, g[0]), "must be [items >= 1, 3]"),
    "int-pixels": (lambda x, g: (x.long(), g), "floating torch.Tensor"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_inputs_name_the_problem(towers, case):
    _, ours = towers
    x, g = pixels([(1, 4, 6)])
    make, message = BAD[case]
    with pytest.raises((InputError, TypeError), match=re.escape(message)):
        ours(*make(x, g))
