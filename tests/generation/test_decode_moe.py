"""The decode step's MoE layer (decode._moe_step) against MoE.forward, for one token and for a few.

Legend: B batch (tokens), D model width. One token takes _moe_token (the k gate/up GEMVs side by side, the down
GEMVs accumulated by addmm); several take the per-expert loop with index_add. Both equal the module's forward
(the grouped expert kernel) up to fp32 rounding, on unit-gain random weights.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import decode as D
from tests.helpers.generation import tiny_model


@pytest.mark.parametrize("B", [1, 3])
def test_moe_step_equals_module(B):
    model = tiny_model(random_weights=True)
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert moes, "the tiny config needs a MoE layer"
    gen = torch.Generator().manual_seed(B)
    with torch.inference_mode():
        for moe in moes:
            for _ in range(4):
                x = torch.randn(B, model.config.hidden_size, generator=gen)
                want = moe(x[:, None, :])[:, 0]
                got = D._moe_step(D._moe(moe), x)
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
