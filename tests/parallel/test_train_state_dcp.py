"""Training state saved with DCP on one layout resumes on another: saved on dp4 (and on dp2 x tp2, dp2 x ep2),
resumed on dp2 x tp2, dp2 x ep2, tp4, dp4 and in one process, the next step's loss and the one after (AdamW
moments, lr) equal continuing on the original layout; composed layouts too: saved on dp2 x ep2, resumed on
tp2 x cp2 and in one process, and saved on tp2 x ep2, resumed on dp2 x cp2. Layouts are (dp, tp, ep) or
(dp, tp, ep, cp); (0, 0, 1) is one process.

The DCP training state in one process (no process group): a resume restores the weights, the AdamW moments and
the caller's extras, returns a default for an extra the checkpoint lacks, and refuses a checkpoint of another
model by naming the keys it lacks; glm53 train's torchrun resume (as one rank) restores the step, the --data
cursor and both RNG states, on gloo every rank its own.

Legend: a training state is `model.<fqn>`, `optim.<fqn>.<exp_avg|exp_avg_sq|step>`, `optim.param_groups`,
`extra.<name>` (glm53/parallel/train_state.py).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel.train_state import read_training_state, write_training_state
from glm53.training.state import resume_distributed, save_distributed, trainer_state
from tests.helpers.ckpt_jobs import dcp_reshard, resume_and_continue, save_then_continue, write_test_checkpoint
from tests.helpers.train_state_edges_jobs import rng_round_trip

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


# ------------------------------------------------------------------------------------------ training state at its edges
def _stepped(config: Glm53Config, seed: int, lr: float = 1e-2, steps: int = 1):
    """(model, AdamW) after `steps` steps on random ids."""
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if steps == 0:
        return model, optimizer
    ids = torch.randint(1, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("state") / "train_state")
    model, optimizer = _stepped(Glm53Config.tiny(), seed=0)
    write_training_state(directory, model, optimizer, {"step": 7, "rng": torch.arange(5, dtype=torch.uint8)})
    return dict(directory=directory, model=model, optimizer=optimizer)


@pytest.mark.parametrize("steps", [0, 1], ids=["fresh", "stepped"])
def test_resume_restores_weights_moments_lr_and_extras(saved, steps):
    """Into a fresh optimizer (no state yet) or one with other moments; with 3x the saved lr."""
    model, optimizer = _stepped(Glm53Config.tiny(), seed=1, lr=3e-2, steps=steps)
    extra = read_training_state(
        saved["directory"], model, optimizer, {"step": 0, "rng": torch.zeros(5, dtype=torch.uint8), "absent": "default"}
    )
    assert extra["step"] == 7 and extra["absent"] == "default"
    assert torch.equal(extra["rng"], torch.arange(5, dtype=torch.uint8))
    for (name, p), q in zip(model.named_parameters(), saved["model"].parameters()):
        assert torch.equal(p, q), name
    with_state = 0
    for p, q in zip(model.parameters(), saved["model"].parameters()):
        mine, theirs = optimizer.state[p], saved["optimizer"].state[q]  # {} for parameters that had no gradient
        assert set(mine) == set(theirs)
        for key, value in theirs.items():
            assert torch.equal(mine[key], value), key
        with_state += bool(theirs)
    assert with_state > 0
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2]


def test_a_checkpoint_of_another_model_is_refused_naming_its_missing_keys(saved):
    model = Glm53ForCausalLM(Glm53Config.tiny(num_nextn_predict_layers=1))  # has MTP tensors the save lacks
    with pytest.raises(KeyError, match=r"lacks training-state keys \['model\.mtp\.layers\.0\."):
        read_training_state(saved["directory"], model, None)


@pytest.mark.parametrize("damage", ["truncated shard", "corrupt metadata", "edited config"])
def test_a_damaged_or_mismatched_state_is_a_checkpoint_error_naming_the_cause(saved, tmp_path, damage):
    """A truncated .distcp shard (a full disk, a killed copy) raised DCP's multi-page CheckpointException around an
    EOFError, a corrupt .metadata an UnpicklingError, and a state read into a model whose config was edited a size
    mismatch: each is now a CheckpointError naming the directory, what it means and each failing rank's cause."""
    import shutil

    from glm53.errors import CheckpointError

    directory = shutil.copytree(saved["directory"], tmp_path / "state")
    config = Glm53Config.tiny(hidden_size=48) if damage == "edited config" else Glm53Config.tiny()
    model = Glm53ForCausalLM(config)
    if damage == "truncated shard":
        shard = next(directory.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        expected = r"state cannot be read, a shard file is truncated or corrupt \(rank 0: EOFError"
    elif damage == "corrupt metadata":
        (directory / ".metadata").write_bytes(b"not a pickle")
        expected = r"\.metadata cannot be read \(UnpicklingError: .*\): the training state is truncated or corrupt"
    else:
        expected = r"saved from a model of another shape \(was config.json edited since\?\) \(rank 0: ValueError: Size"
    with pytest.raises(CheckpointError, match=rf"^{directory}.*{expected}"):
        read_training_state(str(directory), model, torch.optim.AdamW(model.parameters()))


def test_a_directory_without_metadata_is_not_a_training_state(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no DCP training state"):
        read_training_state(str(tmp_path), Glm53ForCausalLM(Glm53Config.tiny()), None)


def test_distributed_resume_restores_step_data_cursor_and_both_rng_states(tmp_path):
    """glm53 train's torchrun save and resume, as rank 0 of a one-rank run: the step, the --data cursor, the data
    generator and the global torch RNG come back as saved (nothing in a step may draw from an unrestored RNG)."""
    model, optimizer = _stepped(Glm53Config.tiny(), seed=2)
    par = SimpleNamespace(rank=lambda: 0)
    generator = torch.Generator().manual_seed(11)
    torch.rand(3, generator=generator)  # a state that is not a fresh seed's
    torch.manual_seed(12)
    state = trainer_state(5, optimizer, generator, par, (1, 1), data={"file": "a.jsonl", "offset": 42})
    saved_torch, saved_data = torch.get_rng_state(), generator.get_state()
    save_distributed(model, str(tmp_path / "run"), {**state, "dp_rank": 0}, par, export=True)

    torch.manual_seed(99)
    other = torch.Generator().manual_seed(98)
    fresh, fresh_optimizer = _stepped(Glm53Config.tiny(), seed=3, steps=0)
    step, data = resume_distributed(str(tmp_path / "run"), fresh, fresh_optimizer, None, (1, 1), 0, other)
    assert step == 5 and data == {"file": "a.jsonl", "offset": 42}
    assert torch.equal(other.get_state(), saved_data)
    assert torch.equal(torch.get_rng_state(), saved_torch)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_every_rank_resumes_its_own_rng_states(pool2, tmp_path):
    assert pool2.run(rng_round_trip, path=str(tmp_path / "run")) == [{"data": True, "torch": True, "step": 3}] * 2
