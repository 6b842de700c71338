"""`torchrun -m glm53 train --dp/--tp` on CPU/gloo: it trains, saves a loadable official-layout checkpoint and
resumes exactly; with --tp 2 its losses equal one process's."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.__main__ import main
from glm53.training.state import TRAINER_STATE
from tests.training.test_train_cli import losses

TIMEOUT_S = 180
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
SMALL = ["train", "--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--log-every", "1", "--seed", "1"]


def torchrun(*args: str) -> str:
    """Run `python -m glm53 <args>` on two local ranks; -> rank 0's stdout (fails with both outputs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "glm53",
           *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_dp2_trains_saves_and_resumes(tmp_path):
    save = tmp_path / "run"
    out = torchrun(*SMALL, "--dp", "2", "--steps", "4", "--save", str(save), "--save-every", "2")
    assert "dp 2 x tp 1" in out
    straight = losses(out)
    assert sorted(straight) == [1, 2, 3, 4] and all(math.isfinite(v) for v in straight.values())
    assert straight[4] < straight[1], straight
    model = Glm53ForCausalLM.from_pretrained(save)  # full tensors, official layout, MTP included
    assert model.mtp is not None and model.mtp_checkpoint_keys == []
    fresh = Glm53ForCausalLM(model.config)
    assert not torch.equal(model.lm_head.weight, fresh.lm_head.weight)
    state = torch.load(save / "step-2" / TRAINER_STATE, weights_only=True)
    assert state["step"] == 2 and state["layout"] == [2, 1] and len(state["rank_rng"]) == 2

    resumed = losses(torchrun(*SMALL, "--dp", "2", "--steps", "4", "--resume", str(save / "step-2")))
    assert sorted(resumed) == [3, 4]
    for step in resumed:  # model, full optimizer state, router biases, every rank's data and RNG state
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), (step, resumed, straight)


def test_tp2_matches_one_process(tmp_path, capsys):
    save = tmp_path / "tp"
    parallel = losses(torchrun(*SMALL, "--dp", "1", "--tp", "2", "--steps", "2", "--save", str(save)))
    assert main([*SMALL, "--steps", "2"]) == 0
    single = losses(capsys.readouterr().out)
    assert sorted(parallel) == sorted(single) == [1, 2]
    for step in single:  # printed with 4 decimals
        assert parallel[step] == pytest.approx(single[step], abs=2e-4), (parallel, single)
    assert Glm53ForCausalLM.from_pretrained(save).mtp is not None


def test_dp2_fine_tuning_with_accumulation_matches_one_process(tmp_path, capsys):
    """--data under torchrun: each dp rank takes its rows of the same packed stream, and every step is normalised
    by the global batch's counts, so dp 2 x 2 micro-batches of 1 row equal one process's 4-row batch."""
    from tests.training.test_finetune import load_example

    paths = load_example().prepare(str(tmp_path))
    common = ["train", "--init", paths["base"], "--data", paths["train"], "--seq-len", "96", "--log-every", "1",
              "--seed", "2", "--steps", "3"]  # fmt: skip
    parallel = losses(torchrun(*common, "--dp", "2", "--batch-size", "1", "--grad-accum", "2"))
    assert main([*common, "--batch-size", "4"]) == 0
    single = losses(capsys.readouterr().out)
    assert sorted(parallel) == sorted(single) == [1, 2, 3]
    for step in single:  # printed with 4 decimals
        assert parallel[step] == pytest.approx(single[step], abs=2e-4), (parallel, single)
