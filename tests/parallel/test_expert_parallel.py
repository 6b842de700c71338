"""Expert parallelism on gloo: ep2 (world 2), dp2 x ep2 (world 4), with activation checkpointing and MTP, and
uneven routing, each compared with one process on the same checkpoint and global batch.

One worker pool per world size for the module (parallel_harness.py). Every dp x ep rank reads its own slice of
the batch, so the reference is `reference_step(..., dp=dp * ep)`.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.helpers.expert_jobs import ep_step
from tests.helpers.parallel_jobs import BIAS_RATE, reference_step
from tests.parallel.test_parallel_gloo import BF16_REL, TRAINING, check_parity, config_dict

BATCH, SEQ = 4, 12


def make_case(seed: int = 0, bias: dict[int, float] | None = None, **training) -> dict:
    """Config, checkpoint and batch; `bias` {expert: value} sets every router's correction bias there (pushing
    tokens towards those experts)."""
    config = config_dict(**training)
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(Glm53Config(**config))
    with torch.no_grad():
        for router in model.routers():
            router.e_score_correction_bias.normal_(std=0.01, generator=torch.Generator().manual_seed(seed + 5))
            for expert, value in (bias or {}).items():
                router.e_score_correction_bias[expert] = value
        for name, p in model.named_parameters():  # an indexer KL of ~0.2, not ~1e-6 (see test_parallel_gloo)
            if ".indexer." in name and p.dim() == 2:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(seed + 7))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    return dict(config=config, state=state, ids=ids)


def run_and_check(pool, case, dp, ep, **kwargs):
    results = pool.run(ep_step, config=case["config"], state=case["state"], ids=case["ids"], dp=dp, ep=ep, **kwargs)
    check_parity(results, reference_step(case["config"], case["state"], case["ids"], dp=dp * ep))
    return results


def test_ep2_matches_one_process(pool2):
    results = run_and_check(pool2, make_case(), dp=1, ep=2)
    for res in results:  # experts Shard(0) over ep, and (dp = 1) whole on each dp rank: [E/2, 2I, D]
        placements, shape = res["placements"]["model.layers.1.mlp.experts.gate_up_proj"]
        assert shape[0] == case_experts() // 2


def case_experts() -> int:
    return Glm53Config(**config_dict()).n_routed_experts


def test_dp2_ep2_matches_one_process(pool4):
    results = run_and_check(pool4, make_case(seed=1), dp=2, ep=2)
    placements, shape = results[0]["placements"]["model.layers.1.mlp.experts.gate_up_proj"]
    E, I2, D = Glm53Config(**config_dict()).n_routed_experts, 2 * 16, 32
    assert shape == (E // 2, I2 // 2, D), (placements, shape)  # ep on dim 0, FSDP over dp on dim 1


@pytest.mark.parametrize("layout", ["ep2", "dp2xep2"])
def test_ep_with_checkpointing_and_mtp_matches_one_process(pool2, pool4, layout):
    """Every training loss (MTP with its own MoE, indexer KL, balance and z-loss) under activation checkpointing:
    the recomputed forwards redo the all-to-alls; loads are counted once."""
    case = make_case(seed=2, **TRAINING)
    dp, pool = (1, pool2) if layout == "ep2" else (2, pool4)
    reference = reference_step(case["config"], case["state"], case["ids"], dp=dp * 2)
    assert {"mtp_loss", "aux_loss", "indexer_loss"} <= set(reference["parts"])
    results = pool.run(
        ep_step, config=case["config"], state=case["state"], ids=case["ids"], dp=dp, ep=2, checkpointing=True
    )
    check_parity(results, reference)


def test_one_dimensional_ep_mesh_matches_one_process(pool2):
    run_and_check(pool2, make_case(seed=3), dp=1, ep=2, one_dim=True)


@pytest.mark.parametrize("target", ["rank1", "one_expert_each"])
def test_uneven_routing_matches_one_process(pool2, pool4, target):
    """All tokens to one rank's experts (the other receives nothing, and some experts get no token), or every
    token to the same two experts on different ranks."""
    E = case_experts()
    bias = {"rank1": {e: 5.0 for e in range(E // 2, E)}, "one_expert_each": {0: 5.0, E - 1: 5.0}}[target]
    case = make_case(seed=4, bias=bias)
    dp = 2 if target == "one_expert_each" else 1
    results = run_and_check(pool4 if dp == 2 else pool2, case, dp=dp, ep=2)
    # The routing really was that uneven: an expert with no token gets exactly +rate (sign(mean - 0) = 1).
    idle = [e for e in range(E) if e not in bias]
    for name, after in results[0]["biases"].items():
        before = case["state"][name]
        if target == "rank1":  # the biased experts take k = 2 of every token's slots: rank 0's experts get none
            moved = after[idle[: E // 2]] - before[idle[: E // 2]]
            torch.testing.assert_close(moved, torch.full((E // 2,), BIAS_RATE), rtol=0, atol=1e-6)
        assert (after[list(bias)] < before[list(bias)]).all(), name  # the overloaded experts are pushed down


def test_bf16_mixed_precision_dp2_ep2_is_close(pool4):
    """bf16 parameters in compute (experts and tokens cross the all-to-alls in bf16), fp32 reductions."""
    case = make_case(seed=5)
    reference = reference_step(case["config"], case["state"], case["ids"], dp=4)
    results = pool4.run(ep_step, config=case["config"], state=case["state"], ids=case["ids"], dp=2, ep=2, bf16=True)
    for res in results:
        assert torch.isfinite(res["loss"]) and all(torch.isfinite(g).all() for g in res["grads"].values())
        assert abs(res["loss"] - reference["loss"]) / reference["loss"] <= BF16_REL
        diff = torch.cat([(res["grads"][n] - g).flatten() for n, g in reference["grads"].items()])
        norm = torch.cat([g.flatten() for g in reference["grads"].values()])
        assert (diff.norm() / norm.norm()).item() <= BF16_REL
