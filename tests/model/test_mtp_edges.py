"""MTP on sequences shorter than its depth: depth d > T reads only padding (every position's token d ahead is
past the end), contributes no target, and must not change the shapes of the shifted inputs, labels and masks
(the forward's and the trainer's loss denominators', training/loss_counts.py).

Legend: B batch, T time, d depth (1-based).
"""

from __future__ import annotations

import torch

from glm53 import Glm53Config, Glm53ForCausalLM


def test_depth_beyond_the_sequence_adds_nothing_and_runs_backward():
    torch.manual_seed(0)
    config = Glm53Config.tiny(num_nextn_predict_layers=1, mtp_depth=4, router_aux_loss_coef=0.0)
    model = Glm53ForCausalLM(config)
    ids = torch.randint(1, 320, (2, 3))  # depth 1 has one target per row (position 0 predicts token 2)
    model.mtp.depth = 1
    shallow = model(ids, labels=ids).mtp_loss
    model.mtp.depth = 4  # depths 2..4 have none; depth 4 > T
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.mtp_loss * 4, shallow, rtol=1e-5, atol=1e-6)  # the mean over depths
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    two = model(ids[:, :2], labels=ids[:, :2])  # no depth has a target
    assert two.mtp_loss == 0 and torch.isfinite(two.loss)
    counts = model.loss_counts(ids)  # views: the main head, then depths 1..4
    assert counts.targets.tolist() == [4, 2, 0, 0, 0]
    assert counts.tokens.tolist() == [6, 4, 2, 0, 0]  # valid tokens whose token d ahead exists
