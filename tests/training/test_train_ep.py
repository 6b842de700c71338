"""`torchrun -m glm53 train --ep 2` on CPU/gloo: it trains, saves (DCP) and resumes exactly (model, optimizer state
of the ep-sharded experts, router biases, every rank's data and RNG state). Through the CLI on two ranks only: a
4-rank torchrun costs ~100 s on two cores; dp2 x ep2 is saved and resumed (also on other layouts) through the same
save_distributed / resume_distributed in tests/parallel/test_train_state_dcp.py, and 4-rank layouts with ep run
through the CLI in tests/training/test_train_composed.py. The CLI runs on the shared gloo pool's ranks
(tests/helpers/cli_jobs.py)."""

from __future__ import annotations

import math

import pytest

from glm53.parallel.run_checkpoint import DCP_DIR
from tests.helpers.cli_jobs import torchrun_in
from tests.training.test_train_cli import losses
from tests.training.test_train_distributed import SMALL


def test_ep2_trains_saves_and_resumes(tmp_path, pool2):
    save, layout = tmp_path / "run", ["--ep", "2"]
    out = torchrun_in(pool2, *SMALL, *layout, "--steps", "3", "--save", str(save), "--save-every", "1")
    assert "dp 1 x tp 1 x ep 2" in out
    straight = losses(out)
    assert sorted(straight) == [1, 2, 3] and all(math.isfinite(v) for v in straight.values())
    assert (save / "step-1" / DCP_DIR / ".metadata").is_file()  # every rank wrote its shards (DCP)
    resumed = losses(torchrun_in(pool2, *SMALL, *layout, "--steps", "3", "--resume", str(save / "step-1")))
    assert sorted(resumed) == [2, 3]
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), (step, resumed, straight)
