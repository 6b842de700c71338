"""MLA with the k-pool indexer under context parallelism (gloo, cp 2 and 4): a full-indexer layer and a shared
layer on each rank's slice of the sequence equal the one-process layers on the whole sequence, row for row:
outputs, top-k (global key positions), the recorded indexer-loss tensors, the input gradients, and every
parameter gradient (summed over the ranks).

T = 36 with k-pools of 5 (T is no multiple of the pool), so that in row 0 a pool straddles every rank boundary
(9, 18, 27 at cp 4; 18 at cp 2: asserted); the layouts add left padding (a rank whose slice of a row is all
padding) and packed documents that cross rank boundaries, one starting exactly at a boundary and one made only of
padding. "dense": index_topk >= T (every visible complete pool selected); "sparse": 2 pools of 5 plus the tail.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config
from glm53.model.indexer import kept_pools
from glm53.model.key_sequence import segment_boundaries
from glm53.model.mla import MultiHeadLatentAttention
from tests.helpers.cp_mla_jobs import build_pair, cp_pair_job, run_pair

B, T, KPOOL = 2, 36, 5
TOPK = {"dense": 40, "sparse": 10}
REL_TOL = 1e-5  # the indexer scores are fp32 (kernels/indexer_scores.py); everything else runs in float64


def config_dict(regime: str) -> dict:
    config = Glm53Config.tiny(
        layer_types=["indexed_attention"] * 4,
        indexer_types=["full", "shared", "full", "full"],
        index_kpool=KPOOL,
        index_topk=TOPK[regime],
    )
    return {k: v for k, v in config.to_dict().items() if k in Glm53Config.__dataclass_fields__ and k != "extra"}


def random_state(config: dict) -> dict:
    """Parameters far from their init (random pool gates and ape, untied index scores), per layer."""
    g = torch.Generator().manual_seed(3)
    cfg = Glm53Config(**config)
    full, shared = MultiHeadLatentAttention(cfg, 0).double(), MultiHeadLatentAttention(cfg, 1).double()
    with torch.no_grad():
        for layer in (full, shared):
            for p in layer.parameters():
                p.copy_(
                    torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.1 if p.dim() == 1 else 0.3)
                    + (1.0 if p.dim() == 1 else 0.0)
                )
    return {"full": full.state_dict(), "shared": shared.state_dict()}


def layout(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """valid [B, T] and global document ids [B, T] (None: one document per row)."""
    valid = torch.ones(B, T, dtype=torch.bool)
    if name == "plain":
        return valid, None
    if name == "leftpad":
        valid[1, :11] = False  # at cp 4 rank 0's slice of row 1 is all padding
        return valid, None
    docs = [[7, 13, 16], [9, 2, 25]]  # row 1: a document starts at the rank boundary 9; [9, 11) is all padding
    valid[0, 0] = False
    valid[1, 9:11] = False
    segment_ids = torch.cat(
        [torch.repeat_interleave(torch.arange(len(d)) + 10 * r, torch.tensor(d))[None] for r, d in enumerate(docs)]
    )
    return valid, segment_ids


def make_inputs(config: dict, name: str) -> dict:
    g = torch.Generator().manual_seed(5)
    D = config["hidden_size"]
    valid, segment_ids = layout(name)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(
        x1=rand(B, T, D),
        x2=rand(B, T, D),
        g1=rand(B, T, D),
        g2=rand(B, T, D),
        h=rand(B, T, T),
        valid=valid,
        segment_ids=segment_ids,
    )


_STATES: dict[str, dict] = {}


def state_for(regime: str) -> tuple[dict, dict]:
    config = config_dict(regime)
    if regime not in _STATES:
        _STATES[regime] = random_state(config)
    return config, _STATES[regime]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def assert_straddles(valid: torch.Tensor, segment_ids: torch.Tensor | None, cp: int) -> None:
    """Some complete pool holds both sides of every rank boundary."""
    cu = None if segment_ids is None else segment_boundaries(segment_ids)
    positions, complete = kept_pools(valid, KPOOL, cu)
    for boundary in range(T // cp, T, T // cp):
        lo, hi = positions.min(-1).values, positions.max(-1).values
        assert ((lo < boundary) & (hi >= boundary) & complete).any(), f"no pool straddles {boundary}"


def compare(ranks: list[dict], expected: dict) -> None:
    """Every rank's rows concatenated equal the one-process rows; parameter gradients summed over the ranks."""
    for key in ("topk1", "topk2", "candidate", "selected"):
        if key in expected:
            assert torch.equal(torch.cat([r[key] for r in ranks], dim=1), expected[key]), key
    for key in ("out1", "out2", "index_scores", "pool_mass1", "pool_mass2", "x1_grad", "x2_grad"):
        if key in expected:
            assert rel_err(torch.cat([r[key] for r in ranks], dim=1), expected[key]) < REL_TOL, key
    assert set(ranks[0]["grads"]) == set(expected["grads"])
    for key, grad in expected["grads"].items():
        assert rel_err(sum(r["grads"][key] for r in ranks), grad) < REL_TOL, key


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "per-head"])
@pytest.mark.parametrize("name", ["plain", "leftpad", "packed"])
@pytest.mark.parametrize("regime", ["dense", "sparse"])
@pytest.mark.parametrize("cp", [2, 4], ids=["cp2", "cp4"])
def test_cp_mla_matches_one_process(request, cp, regime, name, absorb):
    config, state = state_for(regime)
    inputs = make_inputs(config, name)
    if name != "leftpad":
        assert_straddles(inputs["valid"], inputs["segment_ids"], cp)
    expected = run_pair(*build_pair(config, state, absorb), inputs)
    pool = request.getfixturevalue(f"pool{cp}")
    ranks = pool.run(cp_pair_job, config=config, state=state, inputs=inputs, absorb=absorb)
    # the regime is what it says: every candidate pool selected (dense) or some left out (sparse)
    assert (expected["candidate"] & ~expected["selected"]).any() == (regime == "sparse")
    assert "index_scores" in ranks[0]
    compare(ranks, expected)


@pytest.mark.parametrize(
    ("cp", "regime", "name"), [(2, "dense", "plain"), (4, "sparse", "packed"), (4, "dense", "leftpad")]
)
def test_cp_recomputing_indexer_kl_matches_one_process(request, cp, regime, name):
    """The recomputing indexer KL (O(T) record, losses/indexer_kl.py) under cp: each rank's query slice against the
    gathered pools at its key offset; the ranks' KL terms sum to the one-process term (fixed row count), and the
    outputs, input gradients and every parameter gradient (the indexer's through the gathered pool keys) match."""
    config, state = state_for(regime)
    inputs = make_inputs(config, name)
    expected = run_pair(*build_pair(config, state, True, recompute=True), inputs, kl_mode=regime)
    ranks = request.getfixturevalue(f"pool{cp}").run(
        cp_pair_job, config=config, state=state, inputs=inputs, absorb=True, kl_mode=regime
    )
    assert expected["kl"] > 0.05  # a KL far from zero
    assert rel_err(sum(r["kl"] for r in ranks), expected["kl"]) < REL_TOL
    assert any(n.startswith("full.indexer.") for n in expected["grads"])
    compare(ranks, expected)


@pytest.mark.parametrize("name", ["leftpad", "packed"])
def test_cp_mla_without_recording_matches_one_process(pool4, name):
    """The no-grad indexer path (no indexer loss): outputs, top-k and gradients."""
    config, state = state_for("sparse")
    inputs = make_inputs(config, name)
    expected = run_pair(*build_pair(config, state, True), inputs, record=False)
    ranks = pool4.run(cp_pair_job, config=config, state=state, inputs=inputs, absorb=True, record=False)
    assert "index_scores" not in ranks[0] and not any(".indexer." in key for key in expected["grads"])
    compare(ranks, expected)


def test_cp_mla_with_activation_checkpointing_matches_one_process(pool2):
    """Both layers recomputed in backward (their all-gathers run again there, in the same order on every rank)."""
    config, state = state_for("sparse")
    inputs = make_inputs(config, "packed")
    expected = run_pair(*build_pair(config, state, True), inputs)
    ranks = pool2.run(cp_pair_job, config=config, state=state, inputs=inputs, absorb=True, checkpointing=True)
    compare(ranks, expected)
