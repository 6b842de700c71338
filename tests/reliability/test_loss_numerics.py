"""Losses without target tokens are 0 with zero gradients; the softplus gate and the KDA references in fp64."""

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels.kda import kda_chunk
from glm53.kernels.kda.chunk import kda_chunk_reference, kda_recurrent_reference
from glm53.model.kda import KimiDeltaAttention

PARTS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Glm53ForCausalLM(Glm53Config.tiny(num_nextn_predict_layers=1, indexer_loss_weight=1.0))
    return m.train()


def _grads(model):
    return [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("case", ["T1", "all-ignored", "all-padding"])
def test_no_target_tokens_give_zero_loss_and_zero_gradients(model, case):
    ids = torch.randint(1, 320, (2, 1 if case == "T1" else 9))
    labels = ids if case == "T1" else torch.full_like(ids, -100)
    mask = torch.zeros_like(ids) if case == "all-padding" else None
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=labels)
    params = [p for p in model.parameters() if p.requires_grad]
    for part in ("lm_loss", "mtp_loss"):  # the label-driven parts: exactly 0 with zero gradients
        value = getattr(out, part)
        assert value.item() == 0.0, part
        grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
        assert all(g is None or bool((g == 0).all()) for g in grads), part
    for part in PARTS:  # every part finite (balance/z/indexer depend on the inputs, not the labels)
        assert torch.isfinite(getattr(out, part)), part
    out.loss.backward()
    assert all(bool(torch.isfinite(g).all()) for g in _grads(model))
    if case == "all-padding":  # nothing to average anywhere: every part is 0
        assert all(getattr(out, p).item() == 0.0 for p in PARTS)
        assert all(bool((g == 0).all()) for g in _grads(model))


def test_softplus_gate_has_finite_gradients_at_extreme_inputs():
    torch.manual_seed(0)
    config = Glm53Config.tiny(linear_lower_bound=None)
    layer = KimiDeltaAttention(config)
    layer.init_weights()
    H, K = config.linear_num_heads, config.linear_head_dim
    with torch.no_grad():
        layer.f_b_proj.weight.zero_()
        layer.dt_bias.copy_(torch.tensor([1e4, -1e4]).repeat(H * K // 2))
    x = torch.randn(1, 3, 32, requires_grad=True)
    g = layer.forget_gate(x)
    rate = layer.A_log.float().exp()[:, None]
    assert torch.allclose(g[0, 0], -rate * torch.tensor([1e4, 0.0]).repeat(K // 2))  # softplus(1e4)=1e4, (-1e4)=0
    g.sum().backward()
    assert torch.isfinite(layer.dt_bias.grad).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.A_log.grad).all()


@pytest.mark.parametrize("reference", [kda_recurrent_reference, kda_chunk_reference], ids=["recurrent", "chunk"])
def test_kda_references_compute_in_fp64_for_fp64_inputs(reference):
    torch.manual_seed(0)
    B, T, H, K = 1, 37, 2, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, K, dtype=torch.float64)
    g = -torch.rand(B, T, H, K, dtype=torch.float64)
    beta = torch.rand(B, T, H, dtype=torch.float64)
    o, S = reference(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == S.dtype == torch.float64
    fast, S_fast = kda_chunk(q, k, v, g, beta, output_final_state=True)  # computes in fp64 for fp64 inputs
    assert (o - fast).abs().max() < 1e-12 and (S - S_fast).abs().max() < 1e-12
    o32, _ = reference(*(x.float() for x in (q, k, v, g, beta)))
    assert (o32.double() - o).abs().max() > 1e-10  # fp32 arithmetic would not agree this closely
