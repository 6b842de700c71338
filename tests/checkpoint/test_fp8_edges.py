"""FP8 block scaling at its edges: bad `weight_block_size` values are ConfigErrors naming the field, all-zero blocks
quantise to exact zeros with scale 1, and a scale of the wrong shape is refused (not cropped or broadcast)."""

from __future__ import annotations

import pytest
import torch

from glm53.checkpoint import fp8
from glm53.errors import ConfigError


@pytest.mark.parametrize("block", [[0, 8], [4, -1], [True, 8], [4.0, 8], [128], [4, 8, 2], "4x8", 128], ids=repr)
def test_bad_block_size_is_a_config_error(block):
    with pytest.raises(ConfigError, match=r"quantization_config\.weight_block_size must be two positive ints"):
        fp8.weight_block_size({"weight_block_size": block})


def test_block_size_defaults_and_non_dict_config():
    assert fp8.weight_block_size({}) == fp8.weight_block_size({"weight_block_size": None}) == (128, 128)
    assert fp8.weight_block_size({"weight_block_size": (3, 5)}) == (3, 5)
    with pytest.raises(ConfigError, match=r"quantization_config must be a dict, got \[4, 8\]"):
        fp8.weight_block_size([4, 8])


def test_zero_blocks_quantise_to_exact_zeros():
    """A block that is all zero (pruned rows, padding) has no amax: scale 1, q 0, dequantised 0 (not 0/0)."""
    w = torch.zeros(6, 10)
    w[4:, 8:] = torch.tensor([[1.5, -3.0], [0.25, 7.0]])  # only the last (partial) block is non-zero
    q, scale = fp8.quantize(w, (4, 8))
    assert torch.equal(scale, torch.tensor([[1.0, 1.0], [1.0, 7.0 / fp8.FP8_MAX]]))
    out = fp8.dequantize(q, scale, (4, 8))
    assert torch.equal(out[:4], torch.zeros(4, 10)) and torch.equal(out[4:, :8], torch.zeros(2, 8))
    assert out[5, 9].item() == 7.0 and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("scale_shape", [(3, 2), (2, 3), (1, 2), (2, 1), (4,)], ids=str)
@pytest.mark.parametrize("fn", [fp8.dequantize, fp8.dequantize_reference], ids=["fast", "reference"])
def test_dequantize_refuses_a_scale_of_the_wrong_shape(fn, scale_shape):
    """Weight [8, 16] with blocks 4 x 8 needs a [2, 2] scale; a larger one must not be cropped silently."""
    q = torch.ones(8, 16).to(fp8.FP8_DTYPE)
    with pytest.raises(ValueError, match=r"'weight_scale_inv' has shape .*expected \(2, 2\) for weight \(8, 16\)"):
        fn(q, torch.ones(scale_shape), (4, 8))


def test_fp8_tensors_must_be_2d():
    with pytest.raises(ValueError, match=r"FP8 tensor 'k' must be 2-D for block scaling, got shape \(2, 4, 8\)"):
        fp8.check_scale("k", (2, 4, 8), (1, 1), (4, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_both_dequantisations_return_the_requested_dtype(dtype):
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(9, 17, generator=gen) * 40).to(fp8.FP8_DTYPE)
    scale = torch.rand(3, 3, generator=gen) + 0.5
    fast, ref = fp8.dequantize(q, scale, (4, 8), dtype), fp8.dequantize_reference(q, scale, (4, 8), dtype)
    assert fast.dtype == ref.dtype == dtype and torch.equal(fast, ref)
    assert fast[8, 16].item() == (q[8, 16].float() * scale[2, 2]).to(dtype).item()
