"""LoRA training on gloo: dp2 (FSDP2 with frozen and trainable parameters in one unit) and dp2 x ep2 (expert
adapters sharded with their experts) equal one process: loss, adapter gradients, adapters after a step."""

from __future__ import annotations

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.helpers.lora_jobs import lora_model, lora_reference, lora_step
from tests.parallel.test_parallel_gloo import GRAD_FLOOR, REL_TOL, config_dict, rel_err

BATCH, SEQ = 4, 12


def make_case(seed: int = 0) -> dict:
    config = config_dict()
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(Glm53Config(**config))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    adapted = lora_model(config, state, {})
    gen = torch.Generator().manual_seed(seed + 3)
    lora_state = {n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in adapted.named_parameters() if "lora_" in n}
    ids = torch.randint(1, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    return dict(config=config, state=state, lora_state=lora_state, ids=ids)


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
        assert res["placements"] and all(shape[0] == E // 2 for shape in res["placements"].values())
