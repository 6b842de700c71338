"""`torchrun -m glm53 train --ep 2` on CPU/gloo: it trains, saves (DCP) and resumes exactly (model, optimizer state
of the ep-sharded experts, router biases, every rank's data and RNG state). Through the CLI on two ranks only: a
4-rank torchrun costs ~100 s on two cores; dp2 x ep2 is saved and resumed (also on other layouts) through the same
save_distributed / resume_distributed in tests/parallel/test_train_state_dcp.py, and 4-rank layouts with ep run
through the CLI in tests/training/test_train_composed.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from glm53.parallel.run_checkpoint import DCP_DIR
from tests.training.test_train_cli import losses
from tests.training.test_train_distributed import SMALL, TIMEOUT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def torchrun(nproc: int, *args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "glm53",
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_ep2_trains_saves_and_resumes(tmp_path):
    save, layout = tmp_path / "run", ["--ep", "2"]
    out = torchrun(2, *SMALL, *layout, "--steps", "3", "--save", str(save), "--save-every", "1")
    assert "dp 1 x tp 1 x ep 2" in out
    straight = losses(out)
    assert sorted(straight) == [1, 2, 3] and all(math.isfinite(v) for v in straight.values())
    assert (save / "step-1" / DCP_DIR / ".metadata").is_file()  # every rank wrote its shards (DCP)
    resumed = losses(torchrun(2, *SMALL, *layout, "--steps", "3", "--resume", str(save / "step-1")))
    assert sorted(resumed) == [2, 3]
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), (step, resumed, straight)
