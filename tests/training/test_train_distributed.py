"""`torchrun -m glm53 train --dp/--tp` on CPU/gloo: it trains, saves a loadable official-layout checkpoint plus
its DCP training state and resumes exactly, also in one process from a --tp 2 run; with --tp 2 its losses equal
one process's; --init fills a meta-built model from a checkpoint with --bf16 and --no-export.

The first dp2 run is a real torchrun launch (its environment, the CLI starting and destroying the process group);
the others run the same CLI on the shared gloo pool's ranks (tests/helpers/cli_jobs.py), which saves each run its
ranks' start-up and imports."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.__main__ import main
from glm53.parallel.run_checkpoint import DCP_DIR
from glm53.parallel.train_state import saved_keys
from glm53.training.state import TRAINER_STATE
from tests.helpers.cli_jobs import torchrun_in
from tests.training.test_train_cli import losses

TIMEOUT_S = 180
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
SMALL = ["train", "--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--log-every", "1", "--seed", "1"]


def torchrun(*args: str) -> str:
    """Run `python -m glm53 <args>` on two local ranks; -> rank 0's stdout (fails with both outputs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "glm53", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory) -> tuple[object, dict[int, float]]:
    """One dp2 run of 6 steps at lr 1e-2, saved at the end (official layout + DCP) and every 3 steps: -> (the save
    directory, its losses). The resume test continues it; the --init test starts from it (a torchrun costs ~25 s
    on two cores, so the two tests share this one)."""
    save = tmp_path_factory.mktemp("dp2") / "run"
    out = torchrun(*SMALL, "--dp", "2", "--steps", "6", "--lr", "1e-2", "--save", str(save), "--save-every", "3")
    assert "dp 2 x tp 1" in out
    return save, losses(out)


def test_dp2_trains_saves_and_resumes(dp2_run, pool2):
    save, straight = dp2_run
    assert sorted(straight) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in straight.values())
    assert straight[6] < straight[1], straight
    model = Glm53ForCausalLM.from_pretrained(save)  # full tensors, official layout, MTP included
    assert model.mtp is not None and model.mtp_checkpoint_keys == []
    fresh = Glm53ForCausalLM(model.config)
    assert not torch.equal(model.lm_head.weight, fresh.lm_head.weight)
    keys = saved_keys(str(save / "step-3" / DCP_DIR))  # DCP: one file per rank, no full-state gather
    assert {"extra.step", "extra.data_rng.dp0", "extra.data_rng.dp1", "extra.torch_rng.rank1"} <= keys
    assert sorted(os.listdir(save / "step-3" / DCP_DIR)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (save / TRAINER_STATE).exists()

    resumed = losses(
        torchrun_in(pool2, *SMALL, "--dp", "2", "--steps", "6", "--lr", "1e-2", "--resume", str(save / "step-3"))
    )
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:  # model, full optimizer state, router biases, every rank's data and RNG state
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), (step, resumed, straight)


def test_tp2_matches_one_process_and_resumes_in_one(tmp_path, capsys, pool2):
    save = tmp_path / "tp"
    parallel = losses(
        torchrun_in(pool2, *SMALL, "--dp", "1", "--tp", "2", "--steps", "3", "--save", str(save), "--save-every", "1")
    )
    assert main([*SMALL, "--steps", "3"]) == 0
    single = losses(capsys.readouterr().out)
    assert sorted(parallel) == sorted(single) == [1, 2, 3]
    for step in single:  # printed with 4 decimals
        assert parallel[step] == pytest.approx(single[step], abs=2e-4), (parallel, single)
    assert Glm53ForCausalLM.from_pretrained(save).mtp is not None
    # The DCP state saved on tp2 resharded into one process: model, AdamW moments, step, data and RNG states.
    assert main([*SMALL, "--steps", "3", "--resume", str(save / "step-1")]) == 0
    resumed = losses(capsys.readouterr().out)
    assert sorted(resumed) == [2, 3]
    for step in resumed:
        assert resumed[step] == pytest.approx(parallel[step], abs=2e-4), (resumed, parallel)


def test_init_fills_meta_model_bf16_no_export(dp2_run, tmp_path, pool2):
    init, trained = dp2_run
    out = tmp_path / "from-init"
    text = torchrun_in(
        pool2,
        *SMALL,
        "--dp",
        "2",
        "--steps",
        "1",
        "--lr",
        "1e-2",
        "--init",
        str(init),
        "--bf16",
        "--save",
        str(out),
        "--no-export",
    )
    started = losses(text)
    # Starts from the trained weights (a fresh tiny model starts near 6.35), within bf16 of the trained loss.
    assert started[1] < trained[1] - 0.2 and started[1] == pytest.approx(trained[6], abs=0.15), (started, trained)
    files = sorted(os.listdir(out))
    assert "config.json" in files and DCP_DIR in files and not any(f.endswith(".safetensors") for f in files)
    assert "DCP train_state/" in text


def test_torchrun_flags_refused_in_one_process():
    # (--bf16 and --device cuda run in one process too: tests/training/test_runs.py)
    with pytest.raises(SystemExit, match="--no-export is a torchrun option"):
        main([*SMALL, "--no-export"])


def test_dp2_fine_tuning_with_accumulation_matches_one_process(tmp_path, capsys, pool2):
    """--data under torchrun: each dp rank takes its rows of the same packed stream, and every step is normalised
    by the global batch's counts, so dp 2 x 2 micro-batches of 1 row equal one process's 4-row batch."""
    from tests.training.test_finetune import load_example

    paths = load_example().prepare(str(tmp_path))
    common = [
        "train",
        "--init",
        paths["base"],
        "--data",
        paths["train"],
        "--seq-len",
        "96",
        "--log-every",
        "1",
        "--seed",
        "2",
        "--steps",
        "3",
    ]
    save = tmp_path / "run"
    dp2 = ["--dp", "2", "--batch-size", "1", "--grad-accum", "2"]
    parallel = losses(torchrun_in(pool2, *common, *dp2, "--save", str(save), "--save-every", "2"))
    # the DCP run carries the --data cursor: resuming at step 2 continues with the same rows
    without_init = [a for a in common if a not in ("--init", paths["base"])]
    resumed = losses(torchrun_in(pool2, *without_init, *dp2, "--resume", str(save / "step-2")))
    assert sorted(resumed) == [3] and resumed[3] == pytest.approx(parallel[3], abs=2e-4), (resumed, parallel)
    assert main([*common, "--batch-size", "4"]) == 0
    single = losses(capsys.readouterr().out)
    assert sorted(parallel) == sorted(single) == [1, 2, 3]
    for step in single:  # printed with 4 decimals
        assert parallel[step] == pytest.approx(single[step], abs=2e-4), (parallel, single)
