"""Training state saved with DCP on one layout resumes on another: saved on dp4 (and on dp2 x tp2, dp2 x ep2),
resumed on dp2 x tp2, dp2 x ep2, tp4, dp4 and in one process, the next step's loss and the one after (AdamW
moments, lr) equal continuing on the original layout; composed layouts too: saved on dp2 x ep2, resumed on
tp2 x cp2 and in one process, and saved on tp2 x ep2, resumed on dp2 x cp2. Layouts are (dp, tp, ep) or
(dp, tp, ep, cp); (0, 0, 1) is one process."""

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


CASES = [
    ((4, 1, 1), [(2, 2, 1), (0, 0, 1), (2, 1, 2)]),
    ((2, 2, 1), [(1, 4, 1)]),
    ((2, 1, 2), [(4, 1, 1), (0, 0, 1)]),
    ((2, 1, 2, 1), [(1, 2, 1, 2), (0, 0, 1)]),
    ((1, 2, 2, 1), [(2, 1, 1, 2)]),
]


@pytest.mark.parametrize("saved,resumed", CASES, ids=["dp4", "2x2", "dp2xep2", "dp2xep2-tp2xcp2", "tp2xep2-dp2xcp2"])
def test_resume_on_another_layout(pool4, setup, saved, resumed):
    save = str(setup["root"] / ("state-" + "x".join(map(str, saved))))
    straight = pool4.run(
        save_then_continue,
        init=setup["init"],
        save=save,
        batches=setup["batches"],
        **dict(zip(("dp", "tp", "ep", "cp"), saved)),
    )[0]
    assert not [f for f in os.listdir(setup["root"]) if f.startswith(".")]  # no temporary directory left
    assert sorted(os.listdir(save))[0] == ".metadata" and len(os.listdir(save)) == 5  # one file per rank
    for layout in resumed:
        if layout[0] == 0:
            again = resume_and_continue(init=setup["init"], save=save, batches=setup["batches"], dp=0, tp=0)
        else:
            again = pool4.run(
                resume_and_continue,
                init=setup["init"],
                save=save,
                batches=setup["batches"],
                **dict(zip(("dp", "tp", "ep", "cp"), layout)),
            )[0]
        assert again[2] == 1
        assert again[0] == pytest.approx(straight[1], rel=REL), (layout, again, straight)
        assert again[1] == pytest.approx(straight[2], rel=REL), (layout, again, straight)


@pytest.mark.parametrize("saved,loaded", [("rows", "strided"), ("strided", "2d"), ("2d", "rows")])
def test_packed_expert_tensor_reshards_between_placements(pool4, tmp_path, saved, loaded):
    """A packed [E, 2I, D] tensor whose local rows are one run (Shard(1), FSDP under EP) or two (TP's
    _StridedShard): DCP gets one chunk per run, so each placement loads from any other exactly."""
    value = torch.randn(4, 16, 3, generator=torch.Generator().manual_seed(0))
    assert pool4.run(dcp_reshard, directory=str(tmp_path / "w"), value=value, saved=saved, loaded=loaded) == [True] * 4
