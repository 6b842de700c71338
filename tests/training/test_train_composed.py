"""`torchrun -m glm53 train` on composed layouts (CPU/gloo): tp2 x ep2 and cp2 x ep2 give the losses of dp2 (the
same two data ranks, so the same batches), cp2 x tp2 those of one process (one data rank); a world size that is
not dp x cp x ep x tp is a usage error naming the numbers. The CLI runs on the shared gloo pools' ranks
(tests/helpers/cli_jobs.py)."""

from __future__ import annotations

import pytest

from glm53.__main__ import main
from tests.helpers.cli_jobs import torchrun_in
from tests.training.test_train_cli import losses
from tests.training.test_train_distributed import SMALL

STEPS = ["--steps", "2"]
REL = 1e-3  # losses printed with 4 decimals (~1e-4 relative at loss ~6), fp32 reduction orders below that


@pytest.fixture(scope="module")
def dp2_losses(pool2):
    return losses(torchrun_in(pool2, *SMALL, *STEPS, "--dp", "2"))


@pytest.mark.parametrize("layout", [["--tp", "2", "--ep", "2"], ["--cp", "2", "--ep", "2"]], ids=["tp2xep2", "cp2xep2"])
def test_composed_layout_matches_dp2(dp2_losses, layout, pool4):
    out = torchrun_in(pool4, *SMALL, *STEPS, *layout)
    got = losses(out)
    assert sorted(got) == [1, 2], out
    for step, value in got.items():
        assert value == pytest.approx(dp2_losses[step], rel=REL), (layout, got, dp2_losses)


def test_cp2_tp2_matches_one_process(capsys, pool4):
    assert main(SMALL + STEPS) == 0
    one = losses(capsys.readouterr().out)
    out = torchrun_in(pool4, *SMALL, *STEPS, "--cp", "2", "--tp", "2")
    assert "dp 1 x tp 2 x cp 2" in out
    got = losses(out)
    assert sorted(got) == [1, 2]
    for step, value in got.items():
        assert value == pytest.approx(one[step], rel=REL), (got, one)


def test_world_size_must_be_the_product_of_the_dimensions(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit, match=r"--dp 2 x --cp 3 x --ep 1 x --tp 1 = 6 processes, but WORLD_SIZE is 4"):
        main(SMALL + STEPS + ["--dp", "2", "--cp", "3"])
