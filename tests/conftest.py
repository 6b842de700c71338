"""Shared pytest setup: two intra-op threads (the CI machine has 2 cores; one per worker when pytest-xdist runs two
workers, `-n 2`) and a fixed seed per test.

The slowest files run first (SLOW_FIRST: torchrun CLI runs, compiles): pytest-xdist's `--dist loadfile` hands
files to the workers in collection order, so longest-first keeps the two workers finishing together instead of
one running a two-minute file alone at the end. The list only orders; a file missing from it runs in its usual place.

Helpers shared by several test files live in the `tests.helpers` package (tests/ is a package, so pytest puts
the repository root on sys.path and they import as `tests.helpers.<module>`).
"""

import os

import pytest
import torch

from tests.helpers.parallel_harness import WorkerPool

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set by pytest-xdist in each worker
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // WORKERS))


# Per-file test time, slowest first, from a full run's --durations (2026-12-02): each over ~30 s on two workers.
SLOW_FIRST = (
    "tests/training/test_train_distributed.py",
    "tests/generation/test_step.py",
    "tests/training/test_train_composed.py",
    "tests/training/test_vl_train_distributed.py",
    "tests/generation/test_cli.py",
    "tests/training/test_train_ep.py",
    "tests/compile/test_compile_parallel.py",
    "tests/peft/test_lora_dcp.py",
    "tests/parallel/test_train_state_dcp.py",
    "tests/compile/test_compile_blocks.py",
    "tests/parallel/test_parallel_gloo.py",
    "tests/parallel/test_composed_mesh_world8.py",
    "tests/compile/test_compile_model.py",
    "tests/compile/test_compile_packed.py",
    "tests/parallel/test_context_parallel.py",
    "tests/compile/test_compile_position_ids.py",
)


def pytest_configure(config):
    # xdist (3.x) re-sorts files by their number of tests unless told not to (--no-loadscope-reorder): many quick
    # parametrized kernel tests would go first and the slow torchrun files last, the opposite of what is wanted
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files keep their order


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# One spawned gloo world per size for the whole session (spawning costs seconds per world); every multi-process
# test module shares them. A job that kills a worker fails the tests that use the pool afterwards too.
@pytest.fixture(scope="session")
def pool2():
    pool = WorkerPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = WorkerPool(4)
    yield pool
    pool.close()
