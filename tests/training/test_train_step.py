"""`Trainer.step` on padded and packed micro-batches, in one process: every loss part is normalised by the counts of the
whole step (attention_mask and position_ids included), the returned parts are the micro-batches' sums, the gradient,
its norm, the expert loads and the clipping switch are those of forwards run by hand on a copy of the model.

The distributed branches (a `par` runtime: global counts over dp then ep, the VL media count over the ranks) run
here with a stand-in runtime whose reductions scale the counts as if other ranks held more data; the real ones run in
tests/training/test_train_distributed.py on gloo ranks, which mutmut's forkserver workers cannot spawn (setup.cfg).

Legend: B batch, T time.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

from glm53.losses import IGNORE_INDEX
from glm53.training import distributed, vl_finetune
from glm53.training.cli import add_arguments
from glm53.training.metrics import expert_load_stats
from glm53.training.trainer import LOSS_PARTS, Trainer

B, T = 2, 16
# the same operations in the same order on a deep copy: only the order of gradient accumulation may differ
TOL = dict(rtol=1e-6, atol=1e-8)


def make_trainer(*extra: str) -> Trainer:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--steps", "10", "--seed", "0", "--batch-size", str(B), "--seq-len", str(T), "--lr", "1e-2", *extra]
    return Trainer(parser.parse_args(args))


def micro_batches() -> list[dict[str, torch.Tensor]]:
    """Two micro-batches whose counts differ: one left-padded with a prompt ignored by the labels, one packed
    (position_ids restart at each document: the balance loss and MTP targets are per document)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 256, (2, B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :6] = 0
    labels = ids[0].masked_fill(mask == 0, IGNORE_INDEX)
    labels[1, :9] = IGNORE_INDEX
    padded = dict(input_ids=ids[0].masked_fill(mask == 0, 0), attention_mask=mask, labels=labels)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ([3, 9, 4], [1, 15])])
    packed = dict(input_ids=ids[1], labels=ids[1], position_ids=position_ids)
    return [padded, packed]


def by_hand(model, micro, scale: int = 1) -> tuple[dict, list, dict]:
    """The step's forwards and backwards run directly on `model`, every part over the whole step's counts (times
    `scale`: the counts of a global batch `scale` times this one) -> (parts summed, gradients, expert loads)."""
    counts = [model.loss_counts(m["labels"], m.get("attention_mask"), m.get("position_ids")) for m in micro]
    den = counts[0]
    for c in counts[1:] + counts * (scale - 1):
        den = den + c
    parts = {}
    for m in micro:
        out = model(**m, loss_denominators=den)
        out.loss.backward()
        for name in LOSS_PARTS:
            if getattr(out, name) is not None:
                parts[name] = parts.get(name, 0) + getattr(out, name).detach()
    return parts, [p.grad for p in model.parameters()], expert_load_stats(model)


def check_step(trainer: Trainer, micro, scale: int = 1) -> tuple[dict, list]:
    """Trainer.step(1, micro) against `by_hand` on a copy of the model -> the copy's parts and raw gradients."""
    twin = copy.deepcopy(trainer.model)
    expected, grads, loads = by_hand(twin, micro, scale)
    parts = trainer.step(1, micro)
    assert set(parts) == set(expected) == set(LOSS_PARTS)  # lm, MTP, balance and indexer parts all on
    for name in parts:
        torch.testing.assert_close(parts[name], expected[name], **TOL, msg=name)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    torch.testing.assert_close(trainer.grad_norm, norm, rtol=1e-5, atol=0)
    assert trainer.expert_loads == pytest.approx(loads) and loads["expert_load_max"] > 0
    return expected, grads


def test_step_normalises_by_the_whole_steps_counts_and_sums_the_parts():
    trainer = make_trainer("--grad-clip", "0")  # 0: no clipping, so the stored gradients are the raw ones
    micro = micro_batches()
    plain = copy.deepcopy(trainer.model)
    expected, raw = check_step(trainer, micro)
    mine = [p.grad for p in trainer.model.parameters()]
    assert all(g is not None for g in mine)
    for got, want in zip(mine, raw):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # the per-micro-batch means would weigh the micro-batches differently: the case can tell them apart
    with torch.no_grad():
        alone = sum(plain(**m).loss for m in micro)
    assert (alone - expected["loss"]).abs() > 0.1


def test_step_with_the_default_clip_stores_the_clipped_gradient():
    trainer = make_trainer()  # --grad-clip 1.0
    micro = micro_batches()
    check_step(trainer, micro)
    assert trainer.grad_norm > 1.2, "the case must need clipping"
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()]))
    torch.testing.assert_close(total, torch.tensor(1.0), rtol=1e-5, atol=0)


class StandInRuntime:
    """The two reductions Trainer.step takes from glm53.parallel.runtime, as if every other rank of each dimension
    held the same counts (the counts double over dp and again over ep) and one more image micro-batch."""

    def __init__(self) -> None:
        self.calls = []

    def loss_denominators(self, counts, mesh, dim):
        self.calls.append(("loss_denominators", mesh, dim))
        return counts + counts

    def sum_over(self, value, mesh, dim):
        self.calls.append(("sum_over", mesh, dim))
        return value + 1


@pytest.mark.parametrize("layout", ["text", "vl", "cp2"])
def test_step_takes_the_global_counts_and_media_from_the_runtime(layout, monkeypatch):
    """With a runtime the step divides by the global batch's counts (reduced over dp, then ep), reduces the VL media
    count the same way for the tower's dummy gradients, and with --cp > 1 hands each micro-batch, its model and the
    global counts to the cp slicer (here one that keeps the whole sequence: one rank's slice is everything)."""
    trainer = make_trainer()
    trainer.par, trainer.mesh = StandInRuntime(), "the mesh"
    dropped, sliced = [], []
    monkeypatch.setattr(vl_finetune, "drop_dummy_tower_grads", lambda model, media: dropped.append((model, media)))
    if layout == "vl":
        trainer.vl_record = {"images": ["a.png"]}  # what a VL run holds; the step reads only that it is set
    if layout == "cp2":
        trainer.args.cp = 2

        def whole_sequence(model, loss_denominators=None, **inputs):
            sliced.append((model, loss_denominators))
            return dict(inputs, loss_denominators=loss_denominators)

        monkeypatch.setattr(distributed, "context_parallel_inputs", whole_sequence)
    check_step(trainer, micro_batches(), scale=4)  # doubled over dp, then over ep
    reductions = [("loss_denominators", "the mesh", "dp"), ("loss_denominators", "the mesh", "ep")]
    if layout == "vl":  # no image here: 0 micro-batches with media, plus one per dimension from the stand-in
        reductions += [("sum_over", "the mesh", "dp"), ("sum_over", "the mesh", "ep")]
        assert len(dropped) == 1 and dropped[0][0] is trainer.model and dropped[0][1].item() == 2.0
    else:
        assert dropped == []
    assert trainer.par.calls == reductions
    if layout == "cp2":  # both micro-batches, each with the model and the step's global counts
        assert [m is trainer.model for m, _ in sliced] == [True, True]
        assert sliced[0][1] is sliced[1][1] and sliced[0][1].sequences[0] == 4 * 7  # 2 rows + 5 documents, x 4
    else:
        assert sliced == []
