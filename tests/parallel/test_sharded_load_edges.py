"""The sharded loader's slice reads at block edges (one process): an FP8 slice reads its own bytes plus exactly the
scale blocks it touches, also when it ends on a block edge, and its values equal the full dequantisation.

Legend: bo x bi the FP8 block (4 x 8 here); a slice [r0:r1, c0:c1] touches scale blocks r0 // bo .. ceil(r1 / bo)
and c0 // bi .. ceil(c1 / bi).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from glm53.checkpoint import fp8
from glm53.parallel.load import SliceReader

BLOCK = (4, 8)


@pytest.fixture(scope="module")
def fp8_file(tmp_path_factory):
    w = torch.randn(13, 29, generator=torch.Generator().manual_seed(3))
    q, s = fp8.quantize(w, BLOCK)  # scale blocks [4, 4]
    path = os.path.join(tmp_path_factory.mktemp("slices"), "w.safetensors")
    save_file({"w": q, "w" + fp8.SCALE_SUFFIX: s}, path)
    return dict(files={"w": path, "w" + fp8.SCALE_SUFFIX: path}, full=fp8.dequantize(q, s, BLOCK))


@pytest.mark.parametrize("rows,cols,blocks", [((0, 8), (0, 16), 4), ((4, 8), (8, 16), 1), ((3, 5), (7, 9), 4),
                                              ((12, 13), (24, 29), 1), ((0, 13), (0, 29), 16)])  # fmt: skip
def test_fp8_slice_reads_its_bytes_and_the_blocks_it_touches(fp8_file, rows, cols, blocks):
    reader = SliceReader(fp8_file["files"], BLOCK)
    index = (slice(*rows), slice(*cols))
    values = reader.values("w", index)
    assert torch.equal(values, fp8_file["full"][index])
    n = (rows[1] - rows[0]) * (cols[1] - cols[0])
    assert reader.bytes_read == n + 4 * blocks  # e4m3 values, one fp32 scale per touched block
