"""Training state saved with DCP on one layout resumes on another: saved on dp4 (and on dp2 x tp2), resumed on
dp2 x tp2, tp4 and in one process, the next step's loss and the one after (AdamW moments, lr) equal continuing on
the original layout."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.ckpt_jobs import dcp_reshard, resume_and_continue, save_then_continue, write_test_checkpoint

REL = 1e-4  # fp32, different reduction orders


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    init = str(root / "init")
    write_test_checkpoint(init, fp8_blocks=False)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(1, 320, (4, 16), generator=g) for _ in range(3)]
    return dict(root=root, init=init, batches=batches)


@pytest.mark.parametrize("saved,resumed", [((4, 1), [(2, 2), (0, 0)]), ((2, 2), [(1, 4)])], ids=["dp4", "2x2"])
def test_resume_on_another_layout(pool4, setup, saved, resumed):
    save = str(setup["root"] / f"state-{saved[0]}x{saved[1]}")
    straight = pool4.run(save_then_continue, init=setup["init"], save=save, batches=setup["batches"],
                         dp=saved[0], tp=saved[1])[0]  # fmt: skip
    assert not [f for f in os.listdir(setup["root"]) if f.startswith(".")]  # no temporary directory left
    assert sorted(os.listdir(save))[0] == ".metadata" and len(os.listdir(save)) == 5  # one file per rank
    for dp, tp in resumed:
        if dp == 0:
            again = resume_and_continue(init=setup["init"], save=save, batches=setup["batches"], dp=0, tp=0)
        else:
            again = pool4.run(resume_and_continue, init=setup["init"], save=save, batches=setup["batches"],
                              dp=dp, tp=tp)[0]  # fmt: skip
        assert again[2] == 1
        assert again[0] == pytest.approx(straight[1], rel=REL), (dp, tp, again, straight)
        assert again[1] == pytest.approx(straight[2], rel=REL), (dp, tp, again, straight)


@pytest.mark.parametrize("saved,loaded", [("rows", "strided"), ("strided", "2d"), ("2d", "rows")])
def test_packed_expert_tensor_reshards_between_placements(pool4, tmp_path, saved, loaded):
    """A packed [E, 2I, D] tensor whose local rows are one run (Shard(1), FSDP under EP) or two (TP's
    _StridedShard): DCP gets one chunk per run, so each placement loads from any other exactly."""
    value = torch.randn(4, 16, 3, generator=torch.Generator().manual_seed(0))
    assert pool4.run(dcp_reshard, directory=str(tmp_path / "w"), value=value, saved=saved, loaded=loaded) == [True] * 4
