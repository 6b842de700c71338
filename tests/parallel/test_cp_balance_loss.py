"""The per-document balance loss under context parallelism (glm53/losses/cp_balance.py) on 2 and 4 gloo ranks:
the ranks' shares sum to the one-process loss and each rank's logits get the one-process gradient, with documents
spanning several slices, starting exactly at a slice edge, of one token, and padding; no host read (no graph break
under torch._dynamo.explain).

Legend: B batch, T time (whole rows), E routed experts, k experts per token.
"""

from __future__ import annotations

import pytest
import torch

from glm53.losses import balance_loss
from glm53.model.packing import document_boundaries, segment_ids
from tests.helpers.cp_balance_jobs import sharded_balance_job

B, T, E, K = 2, 24, 8, 2
# row 0: a document over slices 0-2 at cp 4 (positions 2..16) and all of slice 1; row 1: starts at the slice edges
# 6 and 12 (cp 4) and 12 (cp 2), a one-token document, a last document with padding
LENGTHS = [[2, 15, 7], [6, 6, 1, 11]]


def case() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, E, generator=g, dtype=torch.float64).float()
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, 0] = False
    valid[1, 20:] = False
    cu = document_boundaries(B, T, pos.device, position_ids=pos)
    return dict(logits=logits, indices=logits.topk(K, dim=-1).indices, valid=valid, segment_ids=segment_ids(cu, B, T))


def reference(inputs: dict, num_sequences: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = inputs["logits"].reshape(-1, E).clone().requires_grad_()
    loss = balance_loss(
        x, inputs["indices"].reshape(-1, K), inputs["valid"], num_sequences, segment_ids=inputs["segment_ids"]
    )
    return loss.detach(), torch.autograd.grad(loss, x)[0].view(B, T, E)


@pytest.mark.parametrize("num_sequences", [None, 5.0], ids=["own-count", "given-count"])
@pytest.mark.parametrize("cp", [2, 4], ids=lambda n: f"cp{n}")
def test_sharded_document_balance_loss_equals_one_process(pool2, pool4, cp, num_sequences):
    inputs = case()
    den = None if num_sequences is None else torch.tensor(num_sequences)
    expected, expected_grad = reference(inputs, den)
    results = (pool2 if cp == 2 else pool4).run(sharded_balance_job, num_sequences=den, explain=cp == 2, **inputs)
    torch.testing.assert_close(sum(r["share"] for r in results), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.cat([r["grad"] for r in results], dim=1), expected_grad, rtol=1e-5, atol=1e-8)
    assert expected_grad.abs().amax() > 1e-4  # the loss moves every slice's logits
    for r in results:
        assert r.get("breaks", []) == []
