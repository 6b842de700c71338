"""AdamW with weight decay only where it belongs, and the learning-rate schedule from torch's schedulers.

No decay (NO_DECAY, the one list): norm weights and biases, every bias, the router gate, KDA's A_log and dt_bias,
the mHC parameters (`*_hc.*`) and the router's aux-loss-free bias (a buffer the optimizer never sees; listed so a
model that made it a parameter would still not decay it). Schedule (torch.optim.lr_scheduler): a linear warm-up
from lr / warmup at step 1 to lr at step `warmup`, then `cosine` (CosineAnnealingLR down to min-lr at step
`total_steps`, min-lr after), `linear` (LinearLR to min-lr at `total_steps`) or `constant` (lr). `total_steps`
is the schedule's length, independent of how many steps this invocation runs.
"""

from __future__ import annotations

import argparse

import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

WARMUP_FRACTION = 0.05  # default --warmup: this share of the schedule (at least one step)
MIN_LR_FRACTION = 0.1  # default --min-lr: this fraction of --lr
SCHEDULES = ("cosine", "linear", "constant")
NO_DECAY = (
    "norm.weight",
    "norm.bias",
    ".bias",
    "mlp.gate.weight",
    "A_log",
    "dt_bias",
    "_hc.",
    "e_score_correction_bias",
)


def decays(name: str) -> bool:
    """Whether parameter `name` (a model.named_parameters() name) gets weight decay."""
    return not any(part in name for part in NO_DECAY)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups (decay, no decay) over the trainable parameters, in model order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if decays(n)], "weight_decay": weight_decay, "name": "decay"},
        {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0, "name": "no_decay"},
    ]


def total_steps(args: argparse.Namespace) -> int:
    return args.total_steps if getattr(args, "total_steps", None) else args.steps


def warmup_steps(args: argparse.Namespace) -> int:
    if getattr(args, "warmup", None) is not None:
        return args.warmup
    return max(1, int(WARMUP_FRACTION * total_steps(args)))


def min_lr(args: argparse.Namespace) -> float:
    value = getattr(args, "min_lr", None)
    return MIN_LR_FRACTION * args.lr if value is None else value


def build_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    betas = tuple(getattr(args, "betas", None) or (0.9, 0.95))
    decay = getattr(args, "weight_decay", 0.01)
    return torch.optim.AdamW(param_groups(model, decay), lr=args.lr, betas=betas, weight_decay=decay)


def build_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> LRScheduler:
    """The schedule of the module docstring; the lr of 1-based step s is the one after s - 1 scheduler.step()s."""
    total, warmup, kind = total_steps(args), warmup_steps(args), getattr(args, "schedule", "cosine")
    if warmup > total:
        raise ValueError(f"--warmup {warmup} is longer than the schedule (--total-steps {total})")
    floor = min(1.0, min_lr(args) / args.lr)
    decay_steps = max(1, total - max(warmup, 1))
    if kind == "cosine":
        main = _FlooredCosine(optimizer, decay_steps, floor)
    elif kind == "linear":
        main = LinearLR(optimizer, start_factor=1.0, end_factor=floor, total_iters=decay_steps)
    else:
        main = ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup <= 1:
        return main
    ramp = LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup - 1)
    return SequentialLR(optimizer, [ramp, main], milestones=[warmup - 1])


class _FlooredCosine(CosineAnnealingLR):
    """torch's cosine annealing (closed form) from lr to floor * lr over T_max steps, then floor * lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, T_max: int, floor: float) -> None:
        self.floor = floor
        super().__init__(optimizer, T_max=T_max, eta_min=0.0)

    def get_lr(self) -> list[float]:
        return self._get_closed_form_lr()

    def _get_closed_form_lr(self) -> list[float]:
        import math

        t = min(self.last_epoch, self.T_max)
        shape = self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * t / self.T_max))
        return [base * shape for base in self.base_lrs]


def lr_at(
    step: int, total: int, peak: float, warmup: int | None = None, floor: float = MIN_LR_FRACTION, kind: str = "cosine"
) -> float:
    """The default schedule's lr of 1-based `step`, written out (the reference the scheduler is tested against)."""
    import math

    warmup = max(1, int(WARMUP_FRACTION * total)) if warmup is None else warmup
    if warmup > 1 and step <= warmup:
        return peak * (1 / warmup + (1 - 1 / warmup) * (step - 1) / (warmup - 1))
    if kind == "constant":
        return peak
    progress = min(1.0, (step - max(warmup, 1)) / max(1, total - max(warmup, 1)))
    if kind == "linear":
        return peak * (1 + (floor - 1) * progress)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


__all__ = [
    "NO_DECAY",
    "SCHEDULES",
    "build_optimizer",
    "build_scheduler",
    "decays",
    "lr_at",
    "min_lr",
    "param_groups",
    "total_steps",
    "warmup_steps",
]
