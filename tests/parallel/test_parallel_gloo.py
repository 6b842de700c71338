"""The whole model on gloo: FSDP2 (dp=2), TP (tp=2), FSDP2+TP (2x2, with activation checkpointing) and a bf16
mixed-precision run, each compared with one process on the same checkpoint and global batch.

One worker pool per world size is spawned for the whole module (parallel_harness.py); every rank gets the same
checkpoint and batch from this process and runs its data-parallel share of the batch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.helpers.parallel_jobs import meta_init, parallel_step, reference_step

REL_TOL = 1e-4  # fp32: relative to the largest magnitude of each reference tensor
BF16_REL = 5e-2  # bf16 parameters in compute: relative L2 error over all gradients / loss
BATCH, SEQ = 4, 16


def config_dict(**training) -> dict:
    """The tiny preset with KDA, MLA (full indexer), KDA, MLA (shared top-k) and MoE: every boundary kind.
    Its default router_aux_loss_coef puts the balance loss in `.loss`; `training` turns on more loss terms."""
    config = Glm53Config.tiny(
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        indexer_types=["full", "full", "full", "shared"],
        **training,
    )
    d = config.to_dict()
    return {k: v for k, v in d.items() if k in Glm53Config.__dataclass_fields__ and k != "extra"}


@pytest.fixture(scope="module")
def case():
    config = config_dict()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in Glm53ForCausalLM(Glm53Config(**config)).state_dict().items()}
    ids = torch.randint(1, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    # dp=2 slices the batch like the data-parallel runs; no token is ignored, so this is the global mean too
    return dict(config=config, state=state, ids=ids, reference=reference_step(config, state, ids, dp=2))


# Every training loss on: one MTP layer (its own MLA + indexer + MoE), indexer KL, balance loss and z-loss.
TRAINING = dict(num_nextn_predict_layers=1, indexer_loss_weight=1.0, router_aux_loss_coef=0.01, router_z_loss_coef=1e-3)


@pytest.fixture(scope="module")
def training_case():
    config = config_dict(**TRAINING)
    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config(**config))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for router in model.routers():  # distinct router biases, so a wrong bias update shows
            router.e_score_correction_bias.normal_(std=0.01, generator=g)
        for name, p in model.named_parameters():  # index scores far from the target: a KL of ~0.2, not ~1e-5,
            if ".indexer." in name and p.dim() == 2:  # so fp32 cancellation stays far below the tolerance
                p.normal_(std=0.3, generator=g)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    return dict(config=config, state=state, ids=ids, reference=reference_step(config, state, ids, dp=2))


# A gradient is compared relative to its own largest entry, but never relative to less than GRAD_FLOOR x the largest
# gradient entry of the whole model: a tiny gradient made of cancelling terms (an mHC `scale`, ~1e-6 when the
# largest entry is ~0.7) carries fp32 rounding of its terms' size, ~1e-4 of itself, in ANY two fp32 runs that add
# in a different order (single-process fp32 vs fp64 differs as much). A wrong shard or a missing reduction is
# still an O(1) error of the tensor itself, far above the floor.
GRAD_FLOOR = 1e-4


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-12) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(floor)).item()


def check_parity(results: list[dict], reference: dict) -> None:
    for rank, res in enumerate(results):
        assert rel_err(res["loss"], reference["loss"]) <= REL_TOL, (rank, res["loss"], reference["loss"])
        assert set(res["parts"]) == set(reference["parts"]), (res["parts"], reference["parts"])
        for name, value in res["parts"].items():
            assert rel_err(value, reference["parts"][name]) <= REL_TOL, (rank, name, value, reference["parts"][name])
        # aux-loss-free balancing: the loads of the whole global batch, so exactly one process's biases
        assert set(res["biases"]) == set(reference["biases"])
        for name, bias in res["biases"].items():
            assert torch.equal(bias, reference["biases"][name]), f"rank {rank}: {name} differs from one process"
        assert set(res["grads"]) == set(reference["grads"])
        floor = GRAD_FLOOR * max(g.abs().max().item() for g in reference["grads"].values())
        bad = {n: rel_err(g, reference["grads"][n], floor) for n, g in res["grads"].items()}
        bad = {n: e for n, e in bad.items() if e > REL_TOL}
        assert not bad, f"rank {rank}: gradients differ from one process: {bad}"
        assert rel_err(res["norm"], reference["norm"]) <= REL_TOL
        bad = {n: rel_err(p, reference["params"][n]) for n, p in res["params"].items()}
        assert max(bad.values()) <= REL_TOL, f"rank {rank}: parameters after the step differ: {bad}"


def check_replicas_identical(results: list[dict]) -> None:
    """Every rank holds bit-identical full parameters, and ranks that hold a replica of the same piece (they
    differ only in mesh coordinates where the parameter is Replicate) hold identical local tensors."""
    first = results[0]
    for res in results[1:]:
        for name, p in res["params"].items():
            assert torch.equal(p, first["params"][name]), f"{name} differs between ranks after the step"
        for name, b in res["biases"].items():
            assert torch.equal(b, first["biases"][name]), f"{name} differs between ranks after the bias update"
    checked = 0
    for name, (replicate, _) in first["locals"].items():
        if not any(replicate):
            continue
        groups: dict[tuple, list[torch.Tensor]] = {}
        for res in results:
            key = tuple(c for c, r in zip(res["coord"], replicate) if not r)
            groups.setdefault(key, []).append(res["locals"][name][1])
        for replicas in groups.values():
            assert all(torch.equal(t, replicas[0]) for t in replicas), f"replicas of {name} differ after the step"
        checked += 1
    return checked


def test_fsdp_dp2_matches_one_process(pool2, case):
    results = pool2.run(parallel_step, config=case["config"], state=case["state"], ids=case["ids"], dp=2, tp=1)
    check_parity(results, case["reference"])
    check_replicas_identical(results)


def test_tp2_matches_one_process(pool2, case):
    results = pool2.run(parallel_step, config=case["config"], state=case["state"], ids=case["ids"], dp=1, tp=2)
    check_parity(results, case["reference"])
    assert check_replicas_identical(results) > 0


def test_fsdp_tp_2x2_with_checkpointing_matches_one_process(pool4, case):
    results = pool4.run(
        parallel_step, config=case["config"], state=case["state"], ids=case["ids"], dp=2, tp=2, checkpointing=True
    )
    check_parity(results, case["reference"])
    assert check_replicas_identical(results) > 0


def test_bf16_mixed_precision_2x2_is_finite_and_close(pool4, case):
    results = pool4.run(
        parallel_step, config=case["config"], state=case["state"], ids=case["ids"], dp=2, tp=2, bf16=True
    )
    reference = case["reference"]
    for res in results:
        # the parameters the model needs in fp32 stay fp32 inside forward; the rest computes in bf16
        assert res["dtypes"] == {
            "attn_hc.fn": torch.float32,
            "A_log": torch.float32,
            "router": torch.float32,
            "router bias": torch.float32,
            "q_proj": torch.bfloat16,
        }
        assert torch.isfinite(res["loss"]) and all(torch.isfinite(g).all() for g in res["grads"].values())
        assert abs(res["loss"] - reference["loss"]) / reference["loss"] <= BF16_REL
        diff = torch.cat([(res["grads"][n] - g).flatten() for n, g in reference["grads"].items()])
        norm = torch.cat([g.flatten() for g in reference["grads"].values()])
        assert (diff.norm() / norm.norm()).item() <= BF16_REL
    check_replicas_identical(results)


# index_topk 8 with k-pools of 4 (the tiny preset): a query sees at most 8 + 3 keys, so sequences of 12 or more
# tokens are in the sparse regime. The explicit example always runs: sparse, with padding on both dp halves.
@pytest.mark.parametrize("layout", ["dp2", "tp2", "2x2"])
@settings(
    max_examples=3,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@example(seq=21, seed=11, pads=[0, 5, 2, 9])
@given(
    seq=st.sampled_from([6, 11, 15, 21]),
    seed=st.integers(0, 2**16),
    pads=st.lists(st.integers(0, 9), min_size=BATCH, max_size=BATCH),
)
def test_generated_batches_with_padding_match_one_process(pool2, pool4, case, layout, seq, seed, pads):
    """Generated in this process, sent unchanged to every rank: lengths, left padding (row 1 always padded) and
    tokens, in the dense and the sparse indexer regime."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, case["config"]["vocab_size"], (BATCH, seq), generator=g)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    pads[1] = max(pads[1], 1)
    for row, pad in enumerate(pads):
        mask[row, : min(pad, seq - 2)] = 0
    pad_id = case["config"]["pad_token_id"]
    ids = ids.masked_fill(mask == 0, pad_id)
    dp, tp = {"dp2": (2, 1), "tp2": (1, 2), "2x2": (2, 2)}[layout]
    pool = pool4 if dp * tp == 4 else pool2
    results = pool.run(parallel_step, config=case["config"], state=case["state"], ids=ids, mask=mask, dp=dp, tp=tp)
    check_parity(results, reference_step(case["config"], case["state"], ids, mask, dp=dp))
    check_replicas_identical(results)
    for res in results:  # padding_idx: the pad row is never trained, also vocab-parallel (tp) and sharded (dp)
        assert res["grads"]["model.embed_tokens.weight"][pad_id].abs().max() == 0


@pytest.mark.parametrize("layout", ["dp2", "2x2"])
def test_meta_init_under_fsdp(pool2, pool4, case, layout):
    """Meta build -> parallelize -> to_empty -> glm53.parallel.init_weights: every rank agrees, the pad row is
    zero and the rest is initialised."""
    dp, tp = {"dp2": (2, 1), "2x2": (2, 2)}[layout]
    results = (pool4 if dp * tp == 4 else pool2).run(meta_init, config=case["config"], dp=dp, tp=tp)
    for res in results[1:]:
        assert all(torch.equal(p, results[0][n]) for n, p in res.items())
    embedding = results[0]["model.embed_tokens.weight"]
    assert embedding[case["config"]["pad_token_id"]].abs().max() == 0
    assert embedding[1:].std() > 0
    assert torch.equal(results[0]["model.layers.0.attn_hc.scale"], torch.ones(3))


def test_training_features_2x2_match_one_process(pool4, training_case):
    """MTP, indexer KL, balance and z-loss on FSDP2+TP: every loss part, gradient (MTP layer included) and the
    router biases after update_router_bias equal one process on the global batch."""
    case = training_case
    assert {"mtp_loss", "aux_loss", "indexer_loss"} <= set(case["reference"]["parts"])
    assert any(n.startswith("mtp.layers.0.") for n in case["reference"]["grads"])
    results = pool4.run(parallel_step, config=case["config"], state=case["state"], ids=case["ids"], dp=2, tp=2)
    check_parity(results, case["reference"])
    assert check_replicas_identical(results) > 0


@pytest.mark.parametrize("layout", ["dp2", "tp2-checkpointing"])
def test_training_features_on_two_ranks_match_one_process(pool2, training_case, layout):
    case = training_case
    dp, tp = (2, 1) if layout == "dp2" else (1, 2)
    results = pool2.run(
        parallel_step, config=case["config"], state=case["state"], ids=case["ids"], dp=dp, tp=tp, checkpointing=tp > 1
    )
    check_parity(results, reference_step(case["config"], case["state"], case["ids"], dp=dp))
    check_replicas_identical(results)


def test_expert_loads_are_summed_over_dp(training_case):
    """The bias check in check_parity can fail: one dp rank's own loads move the biases differently."""
    case = training_case
    half = reference_step(case["config"], case["state"], case["ids"][: BATCH // 2], dp=1)["biases"]
    assert any(not torch.equal(b, case["reference"]["biases"][n]) for n, b in half.items())
