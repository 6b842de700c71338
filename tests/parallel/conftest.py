"""One gloo world of 4 spawned ranks shared by the checkpoint test modules (spawning costs seconds per world)."""

import pytest

from tests.helpers.parallel_harness import WorkerPool


@pytest.fixture(scope="session")
def pool4():
    """A module that defines its own `pool4` fixture gets that one instead."""
    pool = WorkerPool(4)
    yield pool
    pool.close()
