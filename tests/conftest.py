"""Shared pytest setup: two intra-op threads (the CI machine has 2 cores) and a fixed seed per test.

Helpers shared by several test files live in the `tests.helpers` package (tests/ is a package, so pytest puts
the repository root on sys.path and they import as `tests.helpers.<module>`).
"""

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
