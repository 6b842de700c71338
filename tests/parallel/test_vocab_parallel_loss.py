"""The vocab-parallel chunked head + loss (glm53/parallel/vocab_loss.py) on gloo equals one process.

Kernel level (fp64, tp2 and tp4): loss, hidden-state and weight gradients equal the plain full-logits form, with
ignored targets, targets on every shard and a chunk that does not divide the tokens. Model level (tp2): the main
head and both MTP depths over packed documents with global-batch denominators and forced small logits blocks,
without loss_parallel_context, equal one process's plain path in every loss part and every gradient; the loss runs
through the vocab-parallel function once per head. (The other TP parity tests in tests/parallel run the same path
with one logits block per forward.)

Edges of the vocab-parallel loss (glm53/parallel/vocab_loss.py) on gloo tp2.

Legend: M_EDGES tokens, D_EDGES model width, vocab the vocabulary.
fp32 logits of several hundred, whose exp overflows or underflows fp32 unless the ranks' log-sum-exps are
combined around their maximum; the default logits block sized by this rank's rows (not the whole vocabulary);
the input checks (placement, divisibility, shapes) and the model's lookup per placement.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels import use_backend
from glm53.kernels.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy_reference
from tests.helpers.vocab_loss_edge_jobs import blocks_job, errors_job
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


# ------------------------------------------------------------------------------------- vocab-parallel loss at its edges
M_EDGES, D_EDGES, VOCAB_EDGES = 37, 12, 64


def case(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M_EDGES, D_EDGES, generator=g)
    weight = torch.randn(VOCAB_EDGES, D_EDGES, generator=g) * scale
    weight[VOCAB_EDGES // 2 :] *= 2  # rank 1's rows dominate: its log-sum-exp is far above rank 0's
    targets = torch.randint(0, VOCAB_EDGES, (M_EDGES,), generator=g)
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
    for res in pool2.run(blocks_job, hidden=hidden, weight=weight, targets=targets, budget=3 * 4 * VOCAB_EDGES // 2):
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
