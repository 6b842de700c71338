"""Every collective glm53 issues takes its tensors on the group's device (glm53.parallel.comm's rule): nccl has no
CPU path, so a flag made with torch.tensor(...) and all-reduced on an nccl group fails ("No backend type associated
with device type cpu"), as the exporter's did after writing every shard.

No GPU here: a fake process group (in-process, world 2) and tests/helpers/collective_recorder.py's simulated
accelerator group (the meta device stands in for cuda) show where each collective's tensors live. A source scan
checks that nothing in glm53 calls a c10d tensor collective except through parallel/comm.py.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from glm53.parallel import comm
from glm53.parallel.export import shared_atomic_directory
from glm53.parallel.memory import fake_world
from glm53.parallel.runtime import mean_over, sum_over
from tests.helpers.collective_recorder import COLLECTIVES, misplaced, record_collectives

ROOT = pathlib.Path(__file__).resolve().parents[2] / "glm53"


def test_backend_device_rule(monkeypatch):
    assert comm._device_of_backend("gloo") == torch.device("cpu")
    assert comm._device_of_backend("fake") == torch.device("cpu")
    assert comm._device_of_backend("cpu:gloo") == torch.device("cpu")
    if torch.accelerator.current_accelerator() is None:
        with pytest.raises(RuntimeError, match="needs an accelerator"):
            comm._device_of_backend("nccl")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    assert comm._device_of_backend("nccl") == torch.device("cuda", 3)
    assert comm._device_of_backend("cpu:gloo,cuda:nccl") == torch.device("cuda", 3)


def test_shared_directory_flag_on_the_group_device(tmp_path, monkeypatch):
    """The export bug, without a GPU: the success flag agreed on after the shards are written lives on the
    (simulated accelerator) group's device, and the directory is renamed into place."""
    with (
        fake_world(2),
        record_collectives(monkeypatch, simulate="meta") as records,
        shared_atomic_directory(tmp_path / "out") as tmp,
    ):
        (pathlib.Path(tmp) / "config.json").write_text("{}")
    assert [r[0] for r in records] == ["all_reduce"]
    assert misplaced(records) == []
    assert (tmp_path / "out" / "config.json").read_text() == "{}"


def test_mean_and_sum_over_move_a_host_value_to_the_group(monkeypatch):
    """A host scalar (a loss, the loss counts) reduced over a dp group: moved there and back (real fake-pg run,
    values unchanged: the fake backend reduces nothing)."""
    from glm53.parallel.memory import layout_mesh

    with fake_world(2):
        mesh = layout_mesh(2, 1, 1)
        with record_collectives(monkeypatch) as records:
            got = sum_over(torch.tensor([3.0, 4.0]), mesh), mean_over(torch.tensor([6.0]), mesh)
    assert len(records) == 2 and misplaced(records) == []
    assert got[0].tolist() == [3.0, 4.0] and got[1].tolist() == [3.0]  # mean divides by dp = 2


@pytest.mark.parametrize("helper", ["all_reduce", "all_reduce_", "reduce_", "all_to_all_single"])
def test_comm_helpers_move_host_tensors_to_the_group(helper, monkeypatch):
    with fake_world(2), record_collectives(monkeypatch, simulate="meta") as records:
        t = torch.zeros(4, device="meta")
        if helper == "reduce_":
            comm.reduce_(t, dst=0)
        elif helper == "all_to_all_single":
            comm.all_to_all_single(torch.empty(4, device="meta"), t)
        else:
            getattr(comm, helper)(t)
    assert len(records) == 1 and misplaced(records) == [], records


def test_recorder_catches_a_host_flag_on_an_accelerator_group(monkeypatch):
    """The recorder itself can fail: the old exporter's flag, torch.tensor([1]) all-reduced as made."""
    import torch.distributed as dist

    with fake_world(2), record_collectives(monkeypatch, simulate="meta") as records:
        dist.all_reduce(torch.tensor([1]), op=dist.ReduceOp.MIN)
    assert misplaced(records) == [("all_reduce", ["cpu"], "meta")]


def _direct_collective_calls(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{path.relative_to(ROOT.parent)}:{node.lineno} dist.{node.func.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in COLLECTIVES
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "dist"
    ]


def test_every_tensor_collective_goes_through_comm():
    calls = [c for path in sorted(ROOT.rglob("*.py")) if path.name != "comm.py" for c in _direct_collective_calls(path)]
    assert calls == [], "use glm53.parallel.comm's helpers (tensors on the group's device):\n" + "\n".join(calls)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_init_mesh_binds_the_rank_device_and_timeout(device_type, monkeypatch):
    """On cuda the process group is nccl bound to torchrun's LOCAL_RANK device (device_id) with the timeout."""
    import datetime

    import torch.distributed as dist

    from glm53.parallel import runtime

    calls, picked = [], []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.accelerator, "set_device_index", picked.append)
    timeout = datetime.timedelta(seconds=77)
    runtime._start_process_group(device_type, timeout)
    if device_type == "cpu":
        assert calls == [("gloo", {"timeout": timeout})] and picked == []
    else:
        assert calls == [("nccl", {"timeout": timeout, "device_id": torch.device("cuda", 3)})] and picked == [3]
    assert runtime.DEFAULT_TIMEOUT == datetime.timedelta(minutes=30)
