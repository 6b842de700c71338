"""What decides the GPU-only fast paths, checked without a GPU: the grouped-GEMM gate (bf16 on SM 9.0 / 10.0, else
the padded path), the cudagraph_unsafe tags of the host-reading custom ops (kernels/opaque.py), and the opt-in
TF32 / bf16 setting of the fp32 islands (precision.py).
"""

from __future__ import annotations

import pytest
import torch

import glm53.model  # noqa: F401  (registers the model's custom ops)
from glm53.kernels.moe import grouped_mm_supported


@pytest.mark.parametrize(
    "device,dtype,cap,expected",
    [
        ("cuda", torch.bfloat16, (9, 0), True),
        ("cuda", torch.bfloat16, (10, 0), True),
        ("cuda", torch.bfloat16, (8, 0), False),
        ("cuda", torch.bfloat16, (12, 0), False),
        ("cuda", torch.float32, (9, 0), False),
        ("cuda", torch.float16, (9, 0), False),
        ("cpu", torch.float32, None, True),
        ("cpu", torch.bfloat16, None, True),
        ("cpu", torch.float64, None, False),
        ("mps", torch.bfloat16, None, False),
    ],
)
def test_grouped_mm_gate(device, dtype, cap, expected):
    assert grouped_mm_supported(device, dtype, cap) is expected


HOST_READING_OPS = {
    "causal_conv1d_packed",
    "causal_conv1d_packed_backward",
    "indexer_kl_blocks",
    "indexer_kl_blocks_backward",
    "indexer_scores_packed",
    "indexer_scores_packed_backward",
    "indexer_topk_pools",
    "kda_chunk",
    "kda_chunk_backward",
    "select_pools",
    "select_pools_blocked",
    "sparse_attention",
    "sparse_attention_backward",
    "sparse_mqa_attention",
    "sparse_mqa_attention_backward",
}
CAPTURABLE_OPS = {
    "conv_taps_as_rows",
    "grouped_mm",
    "grouped_mm_weight_grad",
    "indexer_scores",
    "indexer_scores_backward",
    "sparse_attention_static",  # kernels/sparse_static.py: planned from shapes, what generation steps run
    "sparse_attention_static_backward",
    "sparse_mqa_attention_static",
    "sparse_mqa_attention_static_backward",
}


@pytest.mark.parametrize("name", sorted(HOST_READING_OPS | CAPTURABLE_OPS))
def test_host_reading_ops_are_cudagraph_unsafe(name):
    tagged = torch.Tag.cudagraph_unsafe in getattr(torch.ops.glm53, name).default.tags
    assert tagged == (name in HOST_READING_OPS)


def test_every_custom_op_is_classified():
    """A new glm53 custom op must be placed in one of the two sets above (and so have its tag checked)."""
    import glm53.losses  # noqa: F401  (registers the indexer KL ops)

    ops = torch.ops.glm53
    registered = {name for name in dir(ops) if not name.startswith("_") and hasattr(getattr(ops, name), "default")}
    assert registered == HOST_READING_OPS | CAPTURABLE_OPS


def test_fp32_matmul_mode_is_opt_in_and_scoped():
    from glm53 import precision

    assert precision.fp32_matmul_mode() == "ieee"  # the default: exact fp32 GEMMs
    with precision.using_fp32_matmul_mode("tf32"):
        assert torch.get_float32_matmul_precision() == "high"
        with precision.using_fp32_matmul_mode("bf16"):
            assert torch.get_float32_matmul_precision() == "medium"
        assert precision.fp32_matmul_mode() == "tf32"
    assert torch.get_float32_matmul_precision() == "highest"
    with pytest.raises(ValueError, match=r"must be one of \['bf16', 'ieee', 'tf32'\], got 'fp16'"):
        precision.set_fp32_matmul_mode("fp16")
