"""All of dp, tp, ep and cp in one run (world 8, gloo): dp2 x tp2 x ep2 and tp2 x ep2 x cp2, each one training
step compared with one process (test_composed_mesh.py's job and checks). One spawned world of 8 for both layouts,
the tiny hybrid model with MTP and every loss term, short sequences: the suite's only world-8 test."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.mesh_jobs import composed_reference, composed_step
from tests.helpers.parallel_harness import WorkerPool
from tests.parallel.test_composed_mesh import make_case
from tests.parallel.test_parallel_gloo import check_parity

WORLD8_JOB_TIMEOUT_S = 600.0  # 8 ranks on the CI's 2 cores: one step can outlast the harness's default wait


@pytest.fixture(scope="module")
def pool8():
    pool = WorkerPool(8, job_timeout_s=WORLD8_JOB_TIMEOUT_S)
    yield pool
    pool.close()


def test_dp_tp_ep_and_tp_ep_cp_match_one_process(pool8):
    # dp2 x tp2 x ep2: four data ranks (dp x ep), one row each
    case = make_case(seed=11, rows=4, T=12)
    check_parity(pool8.run(composed_step, dp=2, tp=2, ep=2, checkpointing=True, **case), composed_reference(**case))
    # tp2 x ep2 x cp2: two data ranks (ep), 19 tokens over two cp slices (one pad), a document crossing them
    case = make_case(seed=12, rows=2, T=19)
    case["position_ids"] = torch.stack([torch.cat([torch.arange(7), torch.arange(12)]), torch.arange(19)])
    results = pool8.run(composed_step, tp=2, ep=2, cp=2, checkpointing=True, **case)
    check_parity(results, composed_reference(**case))
    assert results[0]["mesh"] == (("dp", "cp", "ep", "tp"), (1, 2, 2, 2))
