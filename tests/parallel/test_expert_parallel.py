"""Expert parallelism on gloo: ep2 (world 2), dp2 x ep2 (world 4), with activation checkpointing and MTP, and
uneven routing, each compared with one process on the same checkpoint and global batch.

One worker pool per world size for the module (parallel_harness.py). Every dp x ep rank reads its own slice of
the batch, so the reference is `reference_step(..., dp=dp * ep)`.

Expert parallelism at its edges (one process, no mesh): a remainder of exactly one expert is refused like any
other, every even split passes, and the mixed-mesh gradient clip never scales gradients up.

Legend: E routed experts, ep the expert-parallel ranks.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import check_ep_size, clip_grad_norm_
from tests.helpers.expert_jobs import ep_step
from tests.helpers.parallel_jobs import BIAS_RATE, reference_step
from tests.parallel.test_expert_placement import experts_module
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


# -------------------------------------------------------------------------------------- expert parallelism at its edges
@pytest.mark.parametrize("E,ep", [(9, 4), (5, 2), (7, 3)])
def test_one_expert_left_over_is_refused(E, ep):
    with pytest.raises(ValueError, match=f"n_routed_experts={E} is not divisible by {ep}"):
        check_ep_size(experts_module(E, 8, 4, 0), ep)


@pytest.mark.parametrize("E,ep", [(8, 4), (6, 2), (6, 6), (4, 1)])
def test_even_splits_pass(E, ep):
    check_ep_size(experts_module(E, 8, 4, 0), ep)


@pytest.mark.parametrize("scale", [0.25, 4.0], ids=["below", "above"])
def test_clip_grad_norm_leaves_small_gradients_alone_and_scales_large_ones(scale):
    """The mixed-mesh clip on plain gradients equals torch's: below max_norm nothing changes (never scaled up)."""
    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    theirs = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    grads = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    norm = torch.linalg.vector_norm(torch.cat([x.flatten() for x in grads]))
    for a, b, x in zip(ours, theirs, grads):
        a.grad, b.grad = x * scale / norm, x * scale / norm  # total norm = scale
    total = clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(total, torch.tensor(scale))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours]))
    torch.testing.assert_close(after, torch.tensor(min(scale, 1.0)), rtol=1e-5, atol=1e-6)
