"""The chunked head + cross-entropy equals the plain form (loss sum and both gradients), incl. ignored targets,
a chunk that does not divide the tokens, bf16 inputs, and a test that it never builds full fp32 logits."""

import pytest
import torch

from glm53.kernels.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy, linear_cross_entropy_reference

CASES = {"M37-V50-chunk8": (37, 50, 8), "M16-V33-chunk16": (16, 33, 16), "M5-V7-chunk64": (5, 7, 64)}


@pytest.mark.parametrize("M,vocab,chunk", CASES.values(), ids=CASES.keys())
def test_matches_reference_fp64(M, vocab, chunk):
    g = torch.Generator().manual_seed(M)
    hidden = torch.randn(M, 12, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 12, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (M,), generator=g)
    targets[::3] = IGNORE_INDEX
    results = []
    for fn in (linear_cross_entropy_reference, lambda h, w, t: linear_cross_entropy(h, w, t, chunk)):
        loss = fn(hidden, weight, targets)
        results.append((loss, *torch.autograd.grad(loss * 0.7, [hidden, weight])))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-10, atol=1e-12)


def test_all_ignored_gives_zero_and_zero_gradients():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((6,), IGNORE_INDEX), chunk=4)
    loss.backward()
    assert loss.item() == 0 and not hidden.grad.any() and not weight.grad.any()


def test_bf16_error_bounded_by_rounding_of_fp32():
    g = torch.Generator().manual_seed(0)
    hidden32 = torch.randn(64, 32, generator=g)
    weight32 = torch.randn(300, 32, generator=g) * 0.2
    targets = torch.randint(0, 300, (64,), generator=g)
    exact = linear_cross_entropy_reference(hidden32.double(), weight32.double(), targets)
    ours = linear_cross_entropy(hidden32.bfloat16(), weight32.bfloat16(), targets, chunk=16)
    plain = linear_cross_entropy_reference(hidden32.bfloat16(), weight32.bfloat16(), targets)
    assert ours.dtype == torch.float32
    assert abs(ours.double() - exact) <= 2 * abs(plain.double() - exact) + 1e-3 * abs(exact)


def test_never_holds_full_logits(monkeypatch):
    """Every logits block the op builds has at most `chunk` rows."""
    import glm53.kernels.linear_cross_entropy as mod

    seen = []
    original = mod._chunk_logits

    def spy(h, w):
        out = original(h, w)
        seen.append(out.shape[0])
        return out

    monkeypatch.setattr(mod, "_chunk_logits", spy)
    hidden = torch.randn(50, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, torch.randn(40, 8), torch.randint(0, 40, (50,)), chunk=16)
    loss.backward()
    assert seen and max(seen) <= 16 and sum(seen) == 2 * 50  # forward and backward each see every row once
