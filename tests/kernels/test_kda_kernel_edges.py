"""KDA kernel entry points on inputs the parity grid does not use: q, k of small norm (where l2norm's epsilon
placement shows) and an empty sequence with a state to carry.

Legend: B batch, T time, H heads, K key width, V value width.
"""

from __future__ import annotations

import pytest
import torch
import transformers.models.glm5_next.modeling_glm5_next as hf

from glm53.kernels.kda import kda_chunk, kda_recurrent_reference, l2norm


def test_l2norm_matches_transformers_on_small_norms():
    """fla's form, eps inside the root: x / sqrt(|x|^2 + eps). At |x| ~ 1e-3 (a conv output near zero) eps is
    the size of |x|^2 and the placement changes the result by ~30%."""
    x = torch.randn(3, 5, 16, dtype=torch.float64) * torch.logspace(-5, 0, 5, dtype=torch.float64)[:, None]
    torch.testing.assert_close(l2norm(x, 1e-6), hf.l2norm(x, dim=-1, eps=1e-6), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", [kda_chunk, kda_recurrent_reference], ids=["fast", "reference"])
def test_empty_sequence_returns_the_initial_state(fn):
    B, H, K, V = 2, 3, 8, 4
    q = k = torch.zeros(B, 0, H, K)
    S0 = torch.randn(B, H, K, V)
    o, S = fn(
        q,
        k,
        torch.zeros(B, 0, H, V),
        torch.zeros(B, 0, H, K),
        torch.zeros(B, 0, H),
        initial_state=S0,
        output_final_state=True,
    )
    assert o.shape == (B, 0, H, V)
    torch.testing.assert_close(S, S0, rtol=0, atol=0)
