"""A training save (weights + trainer_state.pt) is one atomic unit: a kill at any write or rename leaves the
previous checkpoint byte-identical (or, after the final exchange, the complete new one), resume verifies that
weights and trainer state belong together, and the killed save's temporaries are removed by the next save."""

import os
import shutil

import pytest
import torch

import glm53.checkpoint.save as save_mod
import glm53.checkpoint.shards as shards_mod
from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import atomic
from glm53.errors import CheckpointError
from glm53.training.state import RUN_TAG, TRAINER_STATE, load_trainer_state, save_single, trainer_state
from tests.reliability.test_data_loss import snapshot


class Killed(BaseException):
    """Stands for kill -9: nothing after it runs (cleanup is disabled while it can fire)."""


def run_state(seed: int, step: int):
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(Glm53Config.tiny())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(1, 320, (1, 8)), labels=torch.randint(1, 320, (1, 8))).loss.backward()
    optimizer.step()
    return model, trainer_state(step, optimizer, torch.Generator().manual_seed(seed), None, (1, 1))


# (object, attribute) of every write, rename, link or sync a training save goes through.
POINTS = {
    "save_file": (shards_mod, "save_file"),
    "write_json": (save_mod, "write_json"),
    "torch.save": (torch, "save"),
    "rename": (os, "rename"),
    "fsync": (os, "fsync"),
    "link": (os, "link"),
    "chmod": (os, "chmod"),
    "exchange": (atomic, "_exchange"),
    "rmtree": (shutil, "rmtree"),
}


@pytest.fixture(scope="module")
def runs():
    return run_state(0, 5), run_state(1, 8)


def first_checkpoint(path, runs):
    (model, state), _ = runs
    save_single(model, str(path), state)
    (path / "README.md").write_text("mine")
    os.makedirs(path / "step-3")
    (path / "step-3" / "weights.bin").write_bytes(b"earlier checkpoint")
    return snapshot(path)


def count_calls(path, runs, monkeypatch) -> dict[str, int]:
    counts = dict.fromkeys(POINTS, 0)
    for name, (obj, attr) in POINTS.items():
        real = getattr(obj, attr)

        def counting(*args, _name=name, _real=real, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(obj, attr, counting)
    first_checkpoint(path, runs)
    counts = dict.fromkeys(POINTS, 0)
    (_, _), (model, state) = runs
    save_single(model, str(path), state)
    monkeypatch.undo()
    return counts


def kill_points(tmp_path_factory, runs):
    with pytest.MonkeyPatch.context() as mp:
        counts = count_calls(tmp_path_factory.mktemp("count") / "run", runs, mp)
    return [(name, n) for name, total in counts.items() for n in range(1, total + 1)]


@pytest.fixture(scope="module")
def points(tmp_path_factory, runs):
    found = kill_points(tmp_path_factory, runs)
    # Every kind of point is reached by a save that overwrites a directory with user files.
    assert {name for name, _ in found} == set(POINTS)
    return found


def test_a_kill_at_every_write_and_rename_point(tmp_path, runs, points, monkeypatch):
    (old_model, _), (new_model, new_state) = runs
    last_fsync = max(n for name, n in points if name == "fsync")
    for i, (name, nth) in enumerate(points):
        path = tmp_path / f"run{i}"
        before = first_checkpoint(path, runs)
        obj, attr = POINTS[name]
        real, calls = getattr(obj, attr), [0]

        def dying(*args, _real=real, _calls=calls, _nth=nth, **kwargs):
            _calls[0] += 1
            if _calls[0] == _nth:
                raise Killed(f"{name} #{_nth}")
            return _real(*args, **kwargs)

        with monkeypatch.context() as mp:
            if name != "rmtree":
                mp.setattr(shutil, "rmtree", lambda *a, **k: None)  # a killed process cleans nothing up
            mp.setattr(obj, attr, dying)
            with pytest.raises(Killed):
                save_single(new_model, str(path), new_state)
        state = load_trainer_state(str(path))  # weights and trainer state belong together
        loaded = Glm53ForCausalLM.from_pretrained(path)
        expected = old_model if state["step"] == 5 else new_model
        if state["step"] == 5:
            assert snapshot(path) == before, (name, nth)
        else:
            # only deleting the old directory and syncing the parent (the last fsync) come after the exchange
            assert name == "rmtree" or (name, nth) == ("fsync", last_fsync), (name, nth)
        assert torch.equal(loaded.lm_head.weight, expected.lm_head.weight), (name, nth)
        assert (path / "README.md").read_text() == "mine" and (path / "step-3" / "weights.bin").is_file()
        # the next save removes what the killed one left behind (its process is "gone")
        monkeypatch.setattr(atomic, "_process_gone", lambda pid: True)
        save_single(new_model, str(path), new_state)
        monkeypatch.undo()
        assert [n for n in os.listdir(tmp_path) if n.startswith(f".run{i}.")] == [], (name, nth)


def test_resume_refuses_weights_and_state_of_different_saves(tmp_path, runs):
    (old_model, old_state), (new_model, new_state) = runs
    save_single(old_model, str(tmp_path / "a"), old_state)
    save_single(new_model, str(tmp_path / "b"), new_state)
    shutil.copy(tmp_path / "a" / TRAINER_STATE, tmp_path / "b" / TRAINER_STATE)
    with pytest.raises(CheckpointError, match=r"the weights and trainer_state.pt were not written by the same save"):
        load_trainer_state(str(tmp_path / "b"))
    # weights replaced by a plain save_pretrained beside an old trainer state
    new_model.save_pretrained(tmp_path / "a", overwrite=True)
    with pytest.raises(CheckpointError, match=rf"{TRAINER_STATE} has run tag '[0-9a-f]+:5'"):
        load_trainer_state(str(tmp_path / "a"))


def test_the_run_tag_records_the_step(tmp_path, runs):
    (model, state), _ = runs
    save_single(model, str(tmp_path / "a"), state)
    assert load_trainer_state(str(tmp_path / "a"))[RUN_TAG].endswith(":5")
