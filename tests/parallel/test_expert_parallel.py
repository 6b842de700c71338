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
from tests.helpers.parallel_harness import WorkerPool
from tests.helpers.parallel_jobs import reference_step
from tests.parallel.test_parallel_gloo import TRAINING, check_parity, config_dict

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
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    return dict(config=config, state=state, ids=ids)


@pytest.fixture(scope="module")
def pool2():
    pool = WorkerPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool4():
    pool = WorkerPool(4)
    yield pool
    pool.close()


def run_and_check(pool, case, dp, ep, **kwargs):
    results = pool.run(ep_step, config=case["config"], state=case["state"], ids=case["ids"], dp=dp, ep=ep, **kwargs)
    check_parity(results, reference_step(case["config"], case["state"], case["ids"], dp=dp * ep))
    return results


def test_ep2_matches_one_process(pool2):
    results = run_and_check(pool2, make_case(), dp=1, ep=2)
