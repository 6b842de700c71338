"""Edges of the vocab-parallel loss (glm53/parallel/vocab_loss.py) on gloo tp2.

Legend: M tokens, D model width, vocab the vocabulary.
fp32 logits of several hundred, whose exp overflows or underflows fp32 unless the ranks' log-sum-exps are
combined around their maximum; the default logits block sized by this rank's rows (not the whole vocabulary);
the input checks (placement, divisibility, shapes) and the model's lookup per placement.
"""

from __future__ import annotations

import torch

from glm53.kernels.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy_reference
from tests.helpers.vocab_loss_edge_jobs import blocks_job, errors_job
from tests.helpers.vocab_loss_jobs import kernel_job

M, D, VOCAB = 37, 12, 64


def case(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, D, generator=g)
    weight = torch.randn(VOCAB, D, generator=g) * scale
    weight[VOCAB // 2 :] *= 2  # rank 1's rows dominate: its log-sum-exp is far above rank 0's
    targets = torch.randint(0, VOCAB, (M,), generator=g)
    targets[::6] = IGNORE_INDEX
    return hidden, weight, targets


def reference(hidden, weight, targets, scale: float):
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss = linear_cross_entropy_reference(h, w, targets)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def test_fp32_logits_beyond_exp_range_match_fp64(pool2):
    hidden, weight, targets = case(0, scale=20.0)
    lse = torch.stack([torch.logsumexp(hidden.double() @ half.t(), -1) for half in weight.double().chunk(2)])
    # tokens whose every rank's exp(lse) overflows fp32, and tokens whose ranks' lse lie further apart than that
    assert (lse.min(0).values > 110).sum() > 10 and ((lse[1] - lse[0]) > 110).sum() > 10
    loss, d_hidden, d_weight = reference(hidden, weight, targets, 0.5)
    for res in pool2.run(kernel_job, hidden=hidden, weight=weight, targets=targets, chunk=8, scale=0.5):
        assert torch.isfinite(res["loss"]) and torch.isfinite(res["hidden"]).all()
        torch.testing.assert_close(res["loss"].double(), loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(res["hidden"].double(), d_hidden, rtol=1e-4, atol=1e-4 * d_hidden.abs().max())
        torch.testing.assert_close(res["weight"].double(), d_weight, rtol=1e-4, atol=1e-4 * d_weight.abs().max())


def test_default_block_is_sized_by_this_ranks_rows(pool2):
    """A budget of 3 tokens x 32 local rows: blocks of 3 tokens (12 of them and 1) in forward and in backward."""
    hidden, weight, targets = case(1)
    loss, d_hidden, d_weight = reference(hidden, weight, targets, 1.0)
    for res in pool2.run(blocks_job, hidden=hidden, weight=weight, targets=targets, budget=3 * 4 * VOCAB // 2):
        assert res["rows"] == ([3] * 12 + [1]) * 2
        torch.testing.assert_close(res["loss"].double(), loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(res["hidden"].double(), d_hidden, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res["weight"].double(), d_weight, rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise_naming_the_problem_and_the_lookup_takes_sharded_heads_only(pool2):
    hidden, weight, targets = case(2)
    for res in pool2.run(errors_job, hidden=hidden, weight=weight, targets=targets):
        errors = res["errors"]
        assert errors["replicated"][0] == "PlacementError" and "Shard(0)" in errors["replicated"][1]
        assert errors["replicated"][1].count("Replicate") == 1
        assert errors["uneven"] == (
            "PlacementError",
            "the vocab-parallel loss needs vocab rows (63) divisible by the mesh size (2)",
        )
        assert errors["targets"][0] == "ValueError" and "(37, 12) and (36,)" in errors["targets"][1]
        assert errors["hidden3d"][0] == "ValueError" and "(1, 37, 12) and (37,)" in errors["hidden3d"][1]
        assert res["lookup_is_none"] == {"plain": True, "replicated": True, "sharded": False}
