"""Sampling: reproducible with a generator, and every sampled token lies in the top-k / top-p set."""

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
