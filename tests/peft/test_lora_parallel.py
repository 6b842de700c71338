"""LoRA training on gloo: dp2 (FSDP2 with frozen and trainable parameters in one unit) and dp2 x ep2 (expert
adapters sharded with their experts) equal one process: loss, adapter gradients, adapters after a step."""

from __future__ import annotations

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.helpers.lora_jobs import lora_model, lora_reference, lora_step
from tests.parallel.test_parallel_gloo import GRAD_FLOOR, REL_TOL, config_dict, rel_err

BATCH, SEQ = 4, 12


def make_case(seed: int = 0, fp8: bool = False, bf16: bool = False) -> dict:
    config = config_dict()
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(Glm53Config(**config))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    adapted = lora_model(config, state, {}, fp8)
    gen = torch.Generator().manual_seed(seed + 3)
    lora_state = {n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in adapted.named_parameters() if "lora_" in n}
    ids = torch.randint(1, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    return dict(config=config, state=state, lora_state=lora_state, ids=ids, fp8=fp8, bf16=bf16)


def check(results, reference):
    for rank, res in enumerate(results):
        assert not res["frozen_grads"], (rank, res["frozen_grads"][:3])  # the frozen base got no gradient
        assert rel_err(res["loss"], reference["loss"]) <= REL_TOL
        assert set(res["grads"]) == set(reference["grads"]) and len(res["grads"]) > 50
        floor = GRAD_FLOOR * max(g.abs().max().item() for g in reference["grads"].values())
        bad = {n: e for n, g in res["grads"].items() if (e := rel_err(g, reference["grads"][n], floor)) > REL_TOL}
        assert not bad, f"rank {rank}: adapter gradients differ from one process: {bad}"
        assert rel_err(res["norm"], reference["norm"]) <= REL_TOL
        bad = {n: e for n, p in res["params"].items() if (e := rel_err(p, reference["params"][n])) > REL_TOL}
        assert not bad, f"rank {rank}: adapters after the step differ: {bad}"


def test_lora_dp2_matches_one_process(pool2):
    case = make_case()
    results = pool2.run(lora_step, **case, dp=2)
    check(results, lora_reference(**case, world=2))


def test_lora_dp2_ep2_matches_one_process(pool4):
    case = make_case(seed=1)
    results = pool4.run(lora_step, **case, dp=2, ep=2)
    check(results, lora_reference(**case, world=4))
    E = case["config"]["n_routed_experts"]
    for res in results:  # the expert adapters hold this rank's E / ep experts (FSDP splits another dim over dp)
        experts = {n: shape for n, (shape, _) in res["placements"].items() if "experts.gate_up_proj_lora" in n}
        assert experts and all(shape[0] == E // 2 for shape in experts.values())


# The adapter placements follow the base layer's (glm53/parallel/lora_parallel.py): colwise base -> B Shard(0),
# A replicated; rowwise base -> A Shard(1), B replicated; the experts' inner width split like their weights.
TP_LAYOUT = {
    "model.layers.0.self_attn.q_proj.lora_A.weight": "Replicate()",  # KDA colwise
    "model.layers.0.self_attn.q_proj.lora_B.weight": "Shard(dim=0)",
    "model.layers.0.self_attn.o_proj.lora_A.weight": "Shard(dim=1)",  # rowwise
    "model.layers.0.self_attn.o_proj.lora_B.weight": "Replicate()",
    "model.layers.0.self_attn.f_a_proj.lora_A.weight": "Replicate()",  # replicated base
    "model.layers.0.self_attn.f_a_proj.lora_B.weight": "Replicate()",
    "model.layers.1.self_attn.kv_b_proj.lora_A.weight": "Replicate()",  # MLA, read head-locally when absorbed
    "model.layers.1.self_attn.kv_b_proj.lora_B.weight": "Shard(dim=0)",
    "model.layers.1.mlp.experts.gate_up_proj_lora_A": "Replicate()",
    "model.layers.1.mlp.experts.gate_up_proj_lora_B": "_StridedShard(dim=1, sf=2)",
    "model.layers.1.mlp.experts.down_proj_lora_A": "Shard(dim=2)",
    "model.layers.1.mlp.experts.down_proj_lora_B": "Replicate()",
}


def test_lora_tp2_matches_one_process(pool2):
    case = make_case(seed=2)
    results = pool2.run(lora_step, **case, dp=1, tp=2)
    check(results, lora_reference(**case, world=1))
    for res in results:
        got = {n: res["placements"][n][1]["tp"] for n in TP_LAYOUT}
        assert got == TP_LAYOUT


def test_lora_dp2_tp2_matches_one_process(pool4):
    case = make_case(seed=3)
    results = pool4.run(lora_step, **case, dp=2, tp=2)
    check(results, lora_reference(**case, world=2))
    for res in results:  # FSDP adds Shard(0) over dp; the tp placements are tp2's
        assert {n: res["placements"][n][1]["tp"] for n in TP_LAYOUT} == TP_LAYOUT
        assert all("dim=0" in res["placements"][n][1]["dp"] for n in TP_LAYOUT)


def test_lora_ep2_tp2_matches_one_process(pool4):
    """Experts Shard(0) over ep and split on their inner width over tp; the tp-replicated expert factors' gradients
    are Partial over tp (lora_parallel.py), the linears' factors placed as under tp2."""
    case = make_case(seed=5)
    results = pool4.run(lora_step, **case, dp=1, ep=2, tp=2)
    check(results, lora_reference(**case, world=2))
    E = case["config"]["n_routed_experts"]
    for res in results:
        assert {n: res["placements"][n][1]["tp"] for n in TP_LAYOUT} == TP_LAYOUT
        experts = {n: v for n, v in res["placements"].items() if ".mlp.experts." in n}
        assert experts and all(p["ep"] == "Shard(dim=0)" and shape[0] == E // 2 for shape, p in experts.values())


def test_lora_on_fp8_base_dp2_ep2_matches_one_process(pool4):
    """A frozen FP8 base under dp2 x ep2: the experts' FP8 weights and their block scales Shard(0) over ep."""
    case = make_case(seed=4, fp8=True)
    results = pool4.run(lora_step, **case, dp=2, ep=2)
    check(results, lora_reference(**case, world=4))
    E = case["config"]["n_routed_experts"]
    for res in results:  # every text linear and expert weight stayed FP8; each rank holds its experts' scales
        assert len(res["fp8_params"]) > 40 and sum(".mlp.experts." in n for n in res["fp8_params"]) == 6
        assert len(res["expert_scales"]) == 6 and all(s[0] == E // 2 for s in res["expert_scales"].values())
        # FSDP gathers the frozen FP8 values as FP8: this rank sends exactly its (padded) shards' bytes, FP8 at
        # 1 byte (a bf16 gather would send `fp8` bytes more)
        g = res["gathered"]
        assert g["fp8"] > 10_000 and g["sent"] == g["shard"], g


def test_lora_on_bf16_base_dp2_ep2_matches_one_process(pool4):
    """A frozen base held in bf16 under dp2 x ep2: FSDP units mixing bf16 frozen weights with fp32 norms, router
    and adapters; the experts' bf16 weights Shard(0) over ep. The reference holds the same bf16 values."""
    case = make_case(seed=6, bf16=True)
    results = pool4.run(lora_step, **case, dp=2, ep=2)
    check(results, lora_reference(**case, world=4))
    E = case["config"]["n_routed_experts"]
    for res in results:  # every frozen text linear and expert weight is a bf16 shard; each rank its E / ep experts
        shards = res["bf16_shards"]
        assert len(shards) > 40 and not any("lora_" in n or "norm" in n or "gate.weight" in n for n in shards)
        experts = [shape for n, shape in shards.items() if n.endswith(".mlp.experts.gate_up_proj")]
        assert len(experts) == 3 and all(s[0] == E // 2 for s in experts)
        # FSDP gathers the bf16 weights as bf16: this rank sends exactly its (padded) shards' bytes, bf16 at 2
        g = res["gathered"]
        assert g["bf16"] > 10_000 and g["sent"] == g["shard"], g
