"""The chunked head + cross-entropy equals the plain form (loss sum and both gradients), incl. ignored targets,
a chunk that does not divide the tokens, bf16 inputs, and a test that it never builds full fp32 logits.

Edges of the chunked head + cross-entropy (glm53/kernels/linear_cross_entropy.py) the parity tests leave open.

Legend: M tokens, D model width, vocab the vocabulary.
The first and last vocabulary ids as targets, one token per chunk and one chunk for every token, a gradient for
only one of the inputs, the default chunk from the vocabulary size, logits far beyond exp's range, and shape
errors that name both shapes.
"""

from __future__ import annotations

import pytest
import torch

import glm53.kernels.linear_cross_entropy as lce
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


# --------------------------------------------------------------------------------------------------------- at its edges
M, D, VOCAB = 11, 6, 13


def inputs(seed: int = 0, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, D, dtype=dtype, generator=g)
    weight = torch.randn(VOCAB, D, dtype=dtype, generator=g)
    # the first and last ids (0 and vocab - 1), ignored targets between them
    targets = torch.tensor([0, VOCAB - 1, 3, IGNORE_INDEX, 0, 7, VOCAB - 1, IGNORE_INDEX, 12, 1, 0])
    return hidden, weight, targets


def by_hand(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum over kept tokens of logsumexp(logits) - logits[target], one token at a time in fp64."""
    total = torch.zeros((), dtype=torch.float64)
    for i, t in enumerate(targets.tolist()):
        if t != IGNORE_INDEX:
            logits = weight.double() @ hidden[i].double()
            total = total + torch.logsumexp(logits, 0) - logits[t]
    return total


@pytest.mark.parametrize("chunk", [1, 4, M, 100], ids=["chunk1", "chunk4", "chunkM", "chunk-over-M"])
def test_first_and_last_ids_value_and_gradients(chunk):
    hidden, weight, targets = inputs()
    want = by_hand(hidden, weight, targets)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = linear_cross_entropy(h, w, targets, chunk)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dh, dw = torch.autograd.grad(got * 1.3, [h, w])
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    rh, rw = torch.autograd.grad(by_hand(h2, w2, targets) * 1.3, [h2, w2])
    torch.testing.assert_close(dh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, rw, rtol=1e-10, atol=1e-12)
    assert not dh[targets == IGNORE_INDEX].any()  # an ignored token has no gradient


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_gradient_of_one_input_only(which):
    """Only one input requires grad (a frozen head, or frozen features): its gradient is still the reference's."""
    hidden, weight, targets = inputs(1)
    leaf = hidden if which == "hidden" else weight
    leaf.requires_grad_()
    want = torch.autograd.grad(linear_cross_entropy_reference(hidden, weight, targets), leaf)[0]
    got = torch.autograd.grad(linear_cross_entropy(hidden, weight, targets, 3), leaf)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_default_chunk_follows_the_vocabulary(monkeypatch):
    """Without a chunk the blocks hold LOGITS_BUDGET_BYTES of fp32 logits over the vocabulary: 3 tokens here."""
    monkeypatch.setattr(lce, "LOGITS_BUDGET_BYTES", 3 * 4 * VOCAB)
    assert lce.default_chunk(VOCAB) == 3 and lce.default_chunk(10**9) == 1
    rows = []
    original = lce._chunk_logits
    monkeypatch.setattr(lce, "_chunk_logits", lambda h, w: rows.append(h.shape[0]) or original(h, w))
    hidden, weight, targets = inputs(2)
    linear_cross_entropy(hidden, weight, targets)
    assert rows == [3, 3, 3, 2]


def test_fp32_logits_beyond_exp_range_stay_finite():
    """Logits of several hundred (exp overflows fp32): the loss and gradients are the fp64 values, finite."""
    hidden, weight, targets = inputs(3)
    hidden32, weight32 = (hidden * 20).float(), (weight * 20).float()
    assert (hidden32 @ weight32.t()).abs().max() > 200
    want = linear_cross_entropy_reference(hidden32.double(), weight32.double(), targets)
    h = hidden32.clone().requires_grad_()
    got = linear_cross_entropy(h, weight32, targets, 4)
    got.backward()
    assert torch.isfinite(h.grad).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-3)


def test_bf16_statistics_are_fp32():
    """bf16 inputs: the logits GEMM in bf16, the log-sum-exp in fp32 (bf16 statistics lose about 1e-2)."""
    hidden, weight, targets = inputs(4)
    h16, w16 = hidden.bfloat16(), weight.bfloat16()
    logits = (h16 @ w16.t()).double()  # what the bf16 GEMM gives, then exact statistics
    kept = targets != IGNORE_INDEX
    exact = (torch.logsumexp(logits[kept], -1) - logits[kept].gather(1, targets[kept, None]).squeeze(1)).sum()
    got = linear_cross_entropy(h16, w16, targets, 4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-5)


def test_shape_errors_name_both_shapes():
    hidden, weight, targets = inputs()
    with pytest.raises(ValueError, match=r"hidden \[M, D\] and targets \[M\], got \(1, 11, 6\) and \(11,\)"):
        linear_cross_entropy(hidden[None], weight, targets)
    with pytest.raises(ValueError, match=r"got \(11, 1, 6\) and \(11,\)"):  # [M, ...]: only the rank is wrong
        linear_cross_entropy(hidden[:, None], weight, targets)
    with pytest.raises(ValueError, match=r"got \(11, 6\) and \(10,\)"):
        linear_cross_entropy(hidden, weight, targets[:10])


def test_default_kernel_is_the_chunked_form(monkeypatch):
    """kernel("linear_cross_entropy") without a forced backend walks logits blocks (never the full-logits form)."""
    from glm53.kernels.dispatch import kernel

    rows = []
    original = lce._chunk_logits
    monkeypatch.setattr(lce, "_chunk_logits", lambda h, w: rows.append(h.shape[0]) or original(h, w))
    hidden, weight, targets = inputs(5)
    loss = kernel("linear_cross_entropy")(hidden, weight, targets)
    assert rows == [M]  # one block: the default chunk of this vocabulary holds every token
    torch.testing.assert_close(loss, by_hand(hidden, weight, targets), rtol=1e-12, atol=1e-12)


def test_a_negative_chunk_raises_instead_of_returning_uninitialised_statistics():
    hidden, weight, targets = inputs()
    with pytest.raises(ValueError, match="chunk must be a positive number of tokens, got -4"):
        linear_cross_entropy(hidden, weight, targets, -4)
