"""The KDA layer's forget-gate initialisation (fla's, which transformers' _init_weights follows): the ranges the
decay starts from, read back through the gate formulas rather than from the raw parameters.

Legend: B batch, T time, D model width, H heads, K head width.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from glm53 import Glm53Config
from glm53.model.kda import A_INIT_RANGE, DT_INIT_FLOOR, DT_INIT_RANGE, KimiDeltaAttention


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bound-5", "softplus"])
def test_forget_gate_initialisation_ranges(lower_bound):
    torch.manual_seed(0)
    layer = KimiDeltaAttention(Glm53Config.tiny(linear_lower_bound=lower_bound, linear_num_heads=64))
    layer.init_weights()
    dt = F.softplus(layer.dt_bias.detach())  # the per-channel step the bias encodes (inverse softplus)
    assert dt.min() >= min(DT_INIT_RANGE[0], DT_INIT_FLOOR) * (1 - 1e-5) and dt.max() <= DT_INIT_RANGE[1] * (1 + 1e-5)
    # log-uniform over the range: the mean of log(dt) is the mid-point of the log range
    assert abs(dt.log().mean() - sum(math.log(r) for r in DT_INIT_RANGE) / 2) < 0.3
    rate = layer.A_log.detach().exp()
    if lower_bound is None:
        assert rate.min() >= A_INIT_RANGE[0] and rate.max() <= A_INIT_RANGE[1]
        assert rate.max() > A_INIT_RANGE[1] / 2  # uniform over [1, 16], not over its logarithm
    else:
        assert torch.equal(rate, torch.ones_like(rate))
    x = torch.zeros(1, 1, layer.f_a_proj.in_features)  # no input: the gate is the bias's alone
    g = layer.forget_gate(x)[0, 0]  # [H, K]
    expected = (
        lower_bound * torch.sigmoid(rate[:, None] * layer.dt_bias.view_as(g))
        if lower_bound is not None
        else -rate[:, None] * dt.view_as(g)
    )
    torch.testing.assert_close(g, expected.detach())
