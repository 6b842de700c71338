"""Real-value checks of the MoE block, the MLP init and the norms that the parity tests leave open.

Legend: M tokens, D model width, E routed experts, I expert width, d the normalised width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.config import Glm53Config
from glm53.model.context import ForwardContext, LayerStats
from glm53.model.mlp import MLP
from glm53.model.moe import MoE
from glm53.model.norm import LayerNorm


def test_shared_expert_width_scales_with_n_shared_experts():
    config = Glm53Config.tiny(n_shared_experts=3)
    moe = MoE(config)
    assert moe.shared_experts.gate_proj.weight.shape == (3 * config.moe_intermediate_size, config.hidden_size)
    assert moe.shared_experts.down_proj.weight.shape == (config.hidden_size, 3 * config.moe_intermediate_size)


def test_init_weights_resets_the_balancing_bias():
    moe = MoE(Glm53Config.tiny())
    moe.gate.e_score_correction_bias.fill_(0.5)
    moe.init_weights()
    assert torch.equal(moe.gate.e_score_correction_bias, torch.zeros(moe.gate.num_experts))


def test_mlp_init_std_is_the_initializer_range():
    config = Glm53Config.tiny(hidden_size=256, intermediate_size=512, initializer_range=0.05)
    torch.manual_seed(0)
    mlp = MLP(config)
    mlp.init_weights()
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        assert abs(float(lin.weight.detach().std()) - 0.05) < 0.002, lin


def test_moe_gradients_reach_the_router_through_the_stats_and_the_shared_expert_input():
    """The balance / z-losses read stats.router_logits: they must carry the router weight's gradient; the shared
    expert's output must carry the input's gradient (x feeds it directly, not only through the routed path)."""
    config = Glm53Config.tiny()
    torch.manual_seed(0)
    moe = MoE(config)
    moe.init_weights()
    x = torch.randn(2, 5, config.hidden_size, requires_grad=True)
    stats = LayerStats()
    ctx = ForwardContext(valid=torch.ones(2, 5, dtype=torch.bool), collect_stats=True, stats=stats)
    moe(x, ctx)
    (g,) = torch.autograd.grad(stats.router_logits.square().sum(), moe.gate.weight)
    expected_logits = F.linear(x.reshape(-1, config.hidden_size), moe.gate.weight)
    (ge,) = torch.autograd.grad(expected_logits.square().sum(), moe.gate.weight)
    torch.testing.assert_close(g, ge)
    # with the routed experts' down projection zeroed, the block's input gradient is the shared expert's alone
    with torch.no_grad():
        moe.experts.down_proj.zero_()
    x2 = x.detach().requires_grad_(True)
    (gall,) = torch.autograd.grad(moe(x2).sum(), x2)
    x3 = x.detach().requires_grad_(True)
    (gshared,) = torch.autograd.grad(moe.shared_experts(x3).sum(), x3)
    assert gshared.abs().max() > 0
    torch.testing.assert_close(gall, gshared)


def test_layer_norm_uses_its_eps():
    """A near-constant row: its variance is far below 1e-3, so the eps sets the output scale."""
    x = torch.full((3, 8), 2.0) + 1e-4 * torch.randn(3, 8)
    ln = LayerNorm(8, eps=1e-6)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (8,), eps=1e-6))
    assert "eps=1e-06" in repr(ln)


def test_rms_norm_repr_names_width_and_eps():
    from glm53.model.norm import RMSNorm

    text = repr(RMSNorm(6, 1e-5))  # what it names, not its exact layout
    assert text.startswith("RMSNorm(") and "6" in text and "1e-05" in text
