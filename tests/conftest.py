"""Shared pytest setup: two intra-op threads (the CI machine has 2 cores; one per worker when pytest-xdist runs two
workers, `-n 2`) and a fixed seed per test.

Helpers shared by several test files live in the `tests.helpers` package (tests/ is a package, so pytest puts
the repository root on sys.path and they import as `tests.helpers.<module>`).
"""

import os

import pytest
import torch

from tests.helpers.parallel_harness import WorkerPool

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set by pytest-xdist in each worker
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // WORKERS))


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
