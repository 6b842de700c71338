"""Sampling: reproducible with a generator, and every sampled token lies in the top-k / top-p set.

Edges of the sampling filters: top-k at vocab - 1 and with ties at the k-th logit, top-p exactly at a cumulative
boundary and at 1, and the sampled frequencies (temperature, generator).

Legend: B batch, vocab the vocabulary size.
Equal logits give exactly representable probabilities (1/4 each: cumulative 0.25, 0.5, 0.75), so "reaches p"
is tested at p itself, not near it.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import allowed_logits, next_tokens
from tests.helpers.generation import left_padded, tiny_model


def allowed_set(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> set[int]:
    """The allowed tokens of one row, written independently: sort, keep the top k, then the shortest prefix whose
    probability reaches top_p."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if top_k is not None:
        order = order[:top_k]
    if top_p is not None:
        kept_probs = (logits.double()[order] / temperature).softmax(-1).tolist()
        total, cut = 0.0, 0
        while cut < len(order) and total < top_p:
            total += kept_probs[cut]
            cut += 1
        order = order[:cut]
    return set(order)


@pytest.mark.parametrize("top_k,top_p,temperature", [(5, None, 1.0), (None, 0.6, 0.7), (12, 0.8, 1.3)])
def test_samples_stay_in_the_allowed_set(top_k, top_p, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=gen) * 3
    allowed = [allowed_set(row, temperature, top_k, top_p) for row in logits]
    kept = allowed_logits(logits, temperature, top_k, top_p).isfinite()
    assert [set(torch.nonzero(r).flatten().tolist()) for r in kept] == allowed
    for _ in range(200):
        picks = next_tokens(logits, True, temperature, top_k, top_p, gen)
        assert all(int(t) in a for t, a in zip(picks, allowed))


def test_generate_sampling_reproducible_and_filtered():
    model = tiny_model()
    ids, mask = left_padded(model.config.vocab_size, [7, 4])
    run = lambda seed, **kw: model.generate(
        ids,
        mask,
        max_new_tokens=6,
        do_sample=True,  # noqa: E731
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )
    a, b, c = run(0, top_p=0.9), run(0, top_p=0.9), run(1, top_p=0.9)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    greedy = model.generate(ids, mask, max_new_tokens=6)
    assert torch.equal(run(2, top_k=1), greedy)  # top-k 1 leaves only the argmax
    assert torch.equal(run(3, top_p=1e-6, temperature=2.0), greedy)  # ... as does a tiny top-p


# ------------------------------------------------------------------------------------------- the filters at their edges
def kept(logits: torch.Tensor, **kw) -> list[int]:
    """How many tokens each row keeps."""
    return allowed_logits(logits, **kw).isfinite().sum(-1).tolist()


def test_top_k_keeps_exactly_k_and_every_tie_at_the_kth_logit():
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0, 2.0], [4.0, 2.0, 2.0, 9.0, 1.0]])
    assert kept(logits, top_k=4) == [4, 4]  # vocab - 1: the smallest goes
    assert allowed_logits(logits, top_k=4)[0, 0] == float("-inf")
    # row 1: the 2nd and 3rd largest tie at 2.0: top_k=2 keeps 9, 4 only; top_k=3 keeps both 2.0s (as transformers)
    assert allowed_logits(logits, top_k=3)[1].isfinite().tolist() == [True, True, True, True, False]
    assert kept(logits, top_k=1) == [1, 1]
    assert kept(logits, top_k=5) == [5, 5] == kept(logits, top_k=50)


@pytest.mark.parametrize("top_p,n", [(0.25, 1), (0.25 + 1e-4, 2), (0.5, 2), (0.5 + 1e-6, 3), (0.75, 3), (0.8, 4)])
def test_top_p_stops_when_the_mass_reaches_p(top_p, n):
    """Four equal tokens: the smallest set whose mass reaches p (p exactly at 0.25 / 0.5 / 0.75 stops there)."""
    assert kept(torch.zeros(2, 4), top_p=top_p) == [n, n]


def test_top_p_one_keeps_even_negligible_tokens():
    """top_p = 1 filters nothing, even tokens whose probability underflows the fp32 cumulative sum."""
    logits = torch.tensor([[0.0] + [-100.0] * 7])
    assert kept(logits, top_p=1.0) == [8]
    assert kept(logits, top_p=0.999) == [1]


def test_top_p_after_top_k_renormalises():
    """top-p runs on the top-k survivors' renormalised mass (transformers' order): of 5, 4, 0, 0, 0, 0 with
    top_k 2, the two kept have 0.73 / 0.27 of the mass, so top_p 0.72 keeps one and 0.74 both."""
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0]])
    assert kept(logits, top_k=2, top_p=0.72) == [1]
    assert kept(logits, top_k=2, top_p=0.74) == [2]
    assert kept(logits, top_p=0.74) == [2]  # without top_k: 5 and 4 hold ~0.71 + 0.26 of the mass


def test_temperature_scales_before_top_p():
    """top-p sees softmax(logits / T): at T = 4 the lead of 2 shrinks, so more tokens are needed to reach p."""
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0]])  # T = 1: probabilities 0.71, 0.10, 0.10, 0.10
    assert kept(logits, top_p=0.7) == [1]
    assert kept(logits, temperature=4.0, top_p=0.7) == [3]  # T = 4: 0.35, 0.22, 0.22, 0.22
    torch.testing.assert_close(allowed_logits(logits, temperature=4.0), logits / 4)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampled_frequencies_follow_the_tempered_distribution(temperature):
    """Draws from one generator match softmax(logits / T) (4000 draws: 3 sigma is under 0.025) and repeat with the
    same seed."""
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5]).log_softmax(-1).expand(4000, 4)
    want = (logits[0] / temperature).softmax(-1)
    draw = lambda seed: next_tokens(
        logits,
        True,
        temperature,
        None,
        None,  # noqa: E731
        torch.Generator().manual_seed(seed),
    )
    picks = draw(0)
    freq = torch.bincount(picks, minlength=4).float() / picks.numel()
    torch.testing.assert_close(freq, want, atol=0.025, rtol=0)
    assert torch.equal(picks, draw(0)) and not torch.equal(picks, draw(1))


def test_greedy_ignores_the_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 5.0]])
    assert next_tokens(logits, False, 0.1, 1, 0.01, None).tolist() == [1, 2]
