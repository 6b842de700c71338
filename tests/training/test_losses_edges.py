"""Edges of glm53/losses/parts.py the model-level tests leave open.

Legend: B batch, T time, P k-pools, E experts, k experts per token, M = B * T tokens, D model width.
Given denominators below 1 (a global count divided by the data-parallel degree), the chunked indexer KL on a
query whose candidate pools hold no attention mass (zero loss and zero gradient there), a shared indexer layer
before any full one, and the head losses' input checks.
"""

from __future__ import annotations

import pytest
import torch

from glm53.losses import (
    IGNORE_INDEX,
    balance_loss,
    causal_lm_head_loss,
    causal_lm_loss,
    chunked_pool_kl,
    head_target_loss,
    indexer_kl_terms,
    normalized_target,
    pool_kl,
    z_loss,
)
from glm53.model.context import LayerStats

B, T, E, K = 2, 5, 6, 2


def router_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B * T, E, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :2] = False
    return logits, logits.topk(K, dim=-1).indices, valid


@pytest.mark.parametrize("denominator", [0.25, 3.5])
def test_given_denominators_below_and_above_one_divide_exactly(denominator):
    """sum / denominator for any positive denominator (a fractional one under data parallelism), not its mean."""
    logits, indices, valid = router_case()
    den = torch.tensor(denominator)
    z_sum = z_loss(logits, valid) * valid.sum()  # the default mean times its count
    torch.testing.assert_close(z_loss(logits, valid, den), z_sum / denominator)
    balance_sum = balance_loss(logits, indices, valid) * B  # both sequences have a valid token
    torch.testing.assert_close(balance_loss(logits, indices, valid, den), balance_sum / denominator)
    hidden = torch.randn(B, T, 4, generator=torch.Generator().manual_seed(1))
    head = torch.nn.Linear(4, 9, bias=False)
    labels = torch.randint(0, 9, (B, T), generator=torch.Generator().manual_seed(2))
    ce_sum = causal_lm_head_loss(hidden, head, labels) * B * (T - 1)
    torch.testing.assert_close(causal_lm_head_loss(hidden, head, labels, den), ce_sum / denominator)


def kl_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    Bk, Tk, P = 2, 7, 5
    scores = torch.randn(Bk, Tk, P, generator=g, dtype=torch.float64)
    masses = [torch.rand(Bk, Tk, P, generator=g, dtype=torch.float64) for _ in range(2)]
    mask = torch.rand(Bk, Tk, P, generator=g) < 0.7
    mask[:, :, 0] = True  # every query has a candidate pool
    for m in masses:  # query (0, 4) sees candidate pools without any attention mass
        m[0, 4] = m[0, 4].masked_fill(mask[0, 4], 0.0)
    valid = torch.ones(Bk, Tk, dtype=torch.bool)
    return scores, masses, mask, valid


def test_chunked_kl_row_without_mass_has_zero_loss_and_zero_gradient():
    scores, masses, mask, valid = kl_case()
    target = torch.stack([normalized_target(m, mask) for m in masses]).mean(0)
    assert target[0, 4].sum() == 0 and mask[0, 4].sum() >= 2
    s_ref, s_got = scores.clone().requires_grad_(), scores.clone().requires_grad_()
    ref = pool_kl(s_ref, target, mask, valid)
    got = chunked_pool_kl(s_got, masses, mask, valid)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-8)
    (g_ref,) = torch.autograd.grad(ref, s_ref)
    (g_got,) = torch.autograd.grad(got, s_got)
    assert not g_ref[0, 4].any() and not g_got[0, 4].any()
    torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-8)


def test_shared_indexer_layer_before_any_full_one_raises():
    shared = LayerStats()
    shared.pool_mass = torch.rand(1, 3, 2)
    with pytest.raises(ValueError, match="shared indexer layer recorded attention mass before any full indexer"):
        indexer_kl_terms([shared], torch.ones(1, 3, dtype=torch.bool), "dense")


def test_head_losses_check_their_inputs():
    hidden, labels = torch.randn(B, T, 4), torch.randint(0, 9, (B, T))
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 5\) like input_ids, got \(2, 4\)"):
        causal_lm_head_loss(hidden, torch.nn.Linear(4, 9, bias=False), labels[:, :4])
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 5\) like input_ids, got \(5, 2\)"):
        causal_lm_loss(torch.randn(B, T, 9), labels.t())
    with pytest.raises(ValueError, match="lm_head.bias"):
        head_target_loss(hidden, torch.nn.Linear(4, 9), labels)
    assert IGNORE_INDEX == -100


def test_causal_lm_loss_is_the_mean_over_kept_next_tokens():
    """Written out: position t predicts labels[t + 1]; ignored labels and the last position count nowhere."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, 9, generator=g)
    labels = torch.randint(0, 9, (B, T), generator=g)
    labels[0, 2] = labels[1, 4] = IGNORE_INDEX
    terms = [
        torch.logsumexp(logits[b, t], 0) - logits[b, t, labels[b, t + 1]]
        for b in range(B)
        for t in range(T - 1)
        if labels[b, t + 1] != IGNORE_INDEX
    ]
    assert len(terms) == B * (T - 1) - 2
    torch.testing.assert_close(causal_lm_loss(logits, labels), torch.stack(terms).mean())


@pytest.mark.parametrize("bad", [-1, -5, 7, 1000])
def test_every_head_loss_rejects_a_label_outside_the_vocabulary(bad):
    """A target outside [0, vocab) that is not IGNORE_INDEX is an error naming the value and where it is, in all
    three public losses (the chunked kernel would drop it from the sum but count it; the vocab-parallel one add its
    log-sum-exp); IGNORE_INDEX and the vocabulary's edges pass."""
    from glm53.errors import InputError
    from glm53.losses import IGNORE_INDEX, causal_lm_head_loss, causal_lm_loss, head_target_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(4, 7, bias=False)
    hidden = torch.randn(2, 5, 4)
    labels = torch.tensor([[0, 6, IGNORE_INDEX, 3, 1], [2, 2, 5, IGNORE_INDEX, 6]])
    good = [
        causal_lm_loss(head(hidden), labels),
        causal_lm_head_loss(hidden, head, labels),
        head_target_loss(hidden, head, labels),
    ]
    assert all(torch.isfinite(x) and x > 0 for x in good)
    labels[1, 2] = bad
    match = rf"labels holds {bad}, outside \[0, vocab_size=7\) or -100 \(at index \(1, 2\)\)"
    with pytest.raises(InputError, match=match):
        causal_lm_loss(head(hidden), labels)
    with pytest.raises(InputError, match=match):
        causal_lm_head_loss(hidden, head, labels)
    with pytest.raises(InputError, match=match.replace("labels", "targets")):
        head_target_loss(hidden, head, labels)
    assert torch.isfinite(causal_lm_head_loss(hidden, head, labels.clamp(0, 6), check=False))
