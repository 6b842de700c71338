"""`torchrun -m glm53 train --dp D --ep E` on CPU/gloo: it trains, saves (DCP) and resumes exactly (model,
optimizer state of the ep-sharded experts, router biases, every rank's data and RNG state)."""

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


@pytest.mark.parametrize("dp", [1, 2])
def test_ep2_trains_saves_and_resumes(tmp_path, dp):
    save, layout = tmp_path / "run", ["--dp", str(dp), "--ep", "2"]
    out = torchrun(2 * dp, *SMALL, *layout, "--steps", "3", "--save", str(save), "--save-every", "1")
    assert f"dp {dp} x tp 1 x ep 2" in out
    straight = losses(out)
    assert sorted(straight) == [1, 2, 3] and all(math.isfinite(v) for v in straight.values())
    assert (save / "step-1" / DCP_DIR / ".metadata").is_file()  # every rank wrote its shards (DCP)
    resumed = losses(torchrun(2 * dp, *SMALL, *layout, "--steps", "3", "--resume", str(save / "step-1")))
    assert sorted(resumed) == [2, 3]
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), (step, resumed, straight)
