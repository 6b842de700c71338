"""The model's explicit settings refuse values that would silently do something else (issue #34's silent defaults):
`update_router_bias(rate=nan)` turned every router bias into NaN and a negative rate balanced the wrong way;
`set_numerics(mla_absorb="no")` is truthy and switched the absorbed form on. Each is refused naming the argument,
with nothing changed."""

from __future__ import annotations

import math

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM


def trained_once() -> Glm53ForCausalLM:
    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config.tiny()).train()
    ids = torch.randint(1, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()  # counts the expert loads update_router_bias reads
    return model


@pytest.mark.parametrize("rate", [math.nan, math.inf, -1e-3, "0.001", True])
def test_update_router_bias_refuses_a_rate_that_is_not_a_finite_number_at_least_zero(rate):
    model = trained_once()
    before = [r.e_score_correction_bias.clone() for r in model.routers()]
    with pytest.raises(ValueError, match=r"rate must be a finite number >= 0, got"):
        model.update_router_bias(rate=rate)
    assert all(torch.equal(r.e_score_correction_bias, b) for r, b in zip(model.routers(), before))
    model.update_router_bias(rate=0.0)  # zero is a valid rate: nothing moves, the counts are consumed
    assert all(torch.equal(r.e_score_correction_bias, b) for r, b in zip(model.routers(), before))
    assert all(r.counted_load is None for r in model.routers())


@pytest.mark.parametrize("name", ["mla_absorb", "hc_recompute", "indexer_kl_recompute"])
@pytest.mark.parametrize("value", ["no", 0, 1.0])
def test_set_numerics_takes_booleans_only(name, value):
    from glm53.model.mla import MultiHeadLatentAttention

    model = Glm53ForCausalLM(Glm53Config.tiny())
    before = [m.absorb for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    with pytest.raises(TypeError, match=rf"set_numerics: {name} must be True, False or None, got"):
        model.set_numerics(**{name: value})
    assert [m.absorb for m in model.modules() if isinstance(m, MultiHeadLatentAttention)] == before
    model.set_numerics(**{name: False})
