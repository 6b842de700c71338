"""The training loop's contract, observed on glm53.training.trainer.Trainer itself: each step clips the gradient
to GRAD_CLIP, moves every router bias by exactly +-bias_rate (or 0) towards balance, and sets the learning rate
of the warm-up + cosine schedule.

Legend: B batch, T time, E experts.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import math

import pytest
import torch

from glm53.model.moe import Router
from glm53.training.cli import add_arguments
from glm53.training.trainer import GRAD_CLIP, MIN_LR_FRACTION, WARMUP_FRACTION, Trainer, lr_at

RATE = 0.01  # large enough that a missing or wrong-signed update is far from rounding


def make_trainer(steps: int = 20) -> Trainer:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--steps",
            str(steps),
            "--seed",
            "0",
            "--batch-size",
            "2",
            "--seq-len",
            "24",
            "--lr",
            "1e-2",
            "--bias-rate",
            str(RATE),
        ]
    )
    return Trainer(args)


def run_step(trainer: Trainer, step: int, ids: torch.Tensor) -> None:
    """One Trainer.step on `ids` [B, T] (labels = ids), whether the step takes the batch or its micro-batches."""
    if "micro" in inspect.signature(trainer.step).parameters:
        trainer.step(step, [dict(input_ids=ids, labels=ids)])
    else:
        trainer.step(step, ids)


def record_routing(model) -> list[tuple[Router, torch.Tensor]]:
    """Every router call of the next forwards, in order: (router, chosen experts [B*T, k])."""
    calls = []
    for router in model.routers():
        router.register_forward_hook(lambda mod, args, out, calls=calls: calls.append((mod, out[2].detach())))
    return calls


def test_step_clips_the_gradient_norm():
    trainer = make_trainer()
    ids = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    # the unclipped norm, from an independent forward/backward of a copy
    twin = copy.deepcopy(trainer.model)
    twin(ids, labels=ids).loss.backward()
    raw = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.parameters() if p.grad is not None]))
    assert raw > 1.2 * GRAD_CLIP, "the case must need clipping"
    run_step(trainer, 1, ids)
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    torch.testing.assert_close(clipped, torch.tensor(GRAD_CLIP), rtol=1e-5, atol=0)
    # the direction is kept: the stored gradient is the raw one scaled by GRAD_CLIP / raw
    twin_grads = [p.grad for p in twin.parameters() if p.grad is not None]
    torch.testing.assert_close(grads[0], twin_grads[0] * (GRAD_CLIP / raw), rtol=1e-4, atol=1e-8)


def test_router_biases_move_by_the_rate_towards_balance_and_lr_follows_the_schedule():
    trainer = make_trainer()
    routers = trainer.model.routers()
    assert len(routers) == 4  # three MoE layers and the MTP layer's
    mtp_router = trainer.model.mtp.layers[0].mlp.gate
    calls = record_routing(trainer.model)
    gen = torch.Generator().manual_seed(2)
    for step in (1, 2):
        before = [r.e_score_correction_bias.clone() for r in routers]
        calls.clear()
        run_step(trainer, step, torch.randint(1, 256, (2, 24), generator=gen))
        assert trainer.lr == pytest.approx(lr_at(step, 20, 1e-2))  # the lr the step used is the schedule's
        for router, old in zip(routers, before):
            load = torch.zeros(router.num_experts)
            for depth, (_, chosen) in enumerate((c for c in calls if c[0] is router), start=1):
                if router is mtp_router:  # MTP depth d: the last d positions have no token d ahead
                    chosen = chosen.view(2, 24, -1)[:, : 24 - depth]
                load += torch.bincount(chosen.flatten(), minlength=router.num_experts).float()
            expected = RATE * torch.sign(load.mean() - load)
            delta = router.e_score_correction_bias - old
            torch.testing.assert_close(delta, expected, rtol=0, atol=1e-7)
            assert (delta != 0).sum() >= router.num_experts // 2  # imbalanced routing: most experts move


def test_learning_rate_schedule_values():
    peak, total = 2.0, 101
    warmup = max(1, int(WARMUP_FRACTION * total))
    assert warmup == 5
    assert lr_at(1, total, peak) == pytest.approx(peak / warmup)
    assert lr_at(warmup, total, peak) == pytest.approx(peak)  # end of the linear warm-up
    decay = total - warmup

    def cosine(progress):
        return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))

    for fraction in (0.25, 0.5, 0.75):
        step = warmup + int(fraction * decay)
        assert lr_at(step, total, peak) == pytest.approx(cosine(fraction), rel=1e-12), fraction
    # cosine, not linear: a quarter of the way down it has lost less than a quarter of the range
    assert lr_at(warmup + decay // 4, total, peak) == pytest.approx(peak * (0.1 + 0.9 * 0.8535533905932737))
    assert lr_at(total, total, peak) == pytest.approx(MIN_LR_FRACTION * peak)  # the end of the cosine
    assert lr_at(total + 7, total, peak) == pytest.approx(MIN_LR_FRACTION * peak)  # and it stays there


def test_learning_rate_schedule_of_short_runs():
    """Fewer than 1 / WARMUP_FRACTION steps: one warm-up step, then the cosine over the rest."""
    peak = 1.0
    assert lr_at(1, 10, peak) == pytest.approx(peak)
    assert lr_at(2, 10, peak) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 9)))
    assert lr_at(1, 2, peak) == pytest.approx(peak) and lr_at(2, 2, peak) == pytest.approx(0.1)
    assert lr_at(1, 1, peak) == pytest.approx(peak)
