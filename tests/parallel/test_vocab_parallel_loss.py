"""The vocab-parallel chunked head + loss (glm53/parallel/vocab_loss.py) on gloo equals one process.

Kernel level (fp64, tp2 and tp4): loss, hidden-state and weight gradients equal the plain full-logits form, with
ignored targets, targets on every shard and a chunk that does not divide the tokens. Model level (tp2): the main
head and both MTP depths over packed documents with global-batch denominators and forced small logits blocks,
without loss_parallel_context, equal one process's plain path in every loss part and every gradient; the loss runs
through the vocab-parallel function once per head. (The other TP parity tests in tests/parallel run the same path
with one logits block per forward.)
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels import use_backend
from glm53.kernels.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy_reference
from tests.helpers.vocab_loss_jobs import kernel_job, model_job
from tests.parallel.test_parallel_gloo import GRAD_FLOOR, REL_TOL, rel_err

M, D, VOCAB, CHUNK = 37, 12, 64, 8
B, T, DEPTH = 2, 13, 2
MODEL_CHUNK = 5  # tokens per logits block on each tp2 rank (160 vocabulary rows each)


@pytest.mark.parametrize("tp", [2, 4])
def test_kernel_matches_one_process_fp64(pool2, pool4, tp):
    g = torch.Generator().manual_seed(tp)
    hidden = torch.randn(M, D, dtype=torch.float64, generator=g)
    weight = torch.randn(VOCAB, D, dtype=torch.float64, generator=g)
    targets = torch.randint(0, VOCAB, (M,), generator=g)
    targets[::5] = IGNORE_INDEX
    assert len(set((targets[targets >= 0] // (VOCAB // tp)).tolist())) == tp  # every shard holds some targets
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = linear_cross_entropy_reference(h, w, targets)
    (want * 0.7).backward()
    results = (pool2 if tp == 2 else pool4).run(
        kernel_job, hidden=hidden, weight=weight, targets=targets, chunk=CHUNK, scale=0.7
    )
    for res in results:
        torch.testing.assert_close(res["loss"], want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res["hidden"], h.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(res["weight"], w.grad, rtol=1e-10, atol=1e-12)


def test_model_tp2_packed_mtp_denominators_match_one_process(pool2):
    config = Glm53Config.tiny(num_nextn_predict_layers=1, mtp_depth=DEPTH)
    fields = {k: v for k, v in config.to_dict().items() if k in Glm53Config.__dataclass_fields__ and k != "extra"}
    torch.manual_seed(0)
    model = Glm53ForCausalLM(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, 3] = labels[1, 10] = IGNORE_INDEX
    position_ids = torch.tensor([list(range(6)) + list(range(7)), list(range(9)) + list(range(4))])
    counts = model.loss_counts(labels, position_ids=position_ids)
    inputs = dict(input_ids=ids, labels=labels, position_ids=position_ids, loss_denominators=counts + counts)
    with use_backend("reference", ["linear_cross_entropy"]):  # one process, plain full logits
        out = model(**inputs)
        out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    budget = MODEL_CHUNK * 4 * config.vocab_size // 2
    results = pool2.run(model_job, config=fields, state=state, inputs=inputs, tp=2, budget=budget)
    floor = GRAD_FLOOR * max(g.abs().max().item() for g in grads.values())
    for rank, res in enumerate(results):
        assert res["calls"] == [B * T] * (1 + DEPTH) and res["logits"] is None
        assert rel_err(res["loss"], out.loss.detach()) <= REL_TOL, (rank, res["loss"], out.loss)
        for name in ("lm_loss", "mtp_loss", "aux_loss"):
            assert rel_err(res["parts"][name], getattr(out, name).detach()) <= REL_TOL, (rank, name)
        assert set(res["grads"]) == set(grads)
        bad = {n: rel_err(g, grads[n], floor) for n, g in res["grads"].items()}
        assert max(bad.values()) <= REL_TOL, {n: e for n, e in bad.items() if e > REL_TOL}
