"""Expert-parallel size checks at their edges (one process, no mesh): a remainder of exactly one expert is refused
like any other, and every even split passes.

Legend: E routed experts, ep the expert-parallel ranks.
"""

from __future__ import annotations

import pytest

from glm53.parallel import check_ep_size
from tests.parallel.test_expert_placement import experts_module


@pytest.mark.parametrize("E,ep", [(9, 4), (5, 2), (7, 3)])
def test_one_expert_left_over_is_refused(E, ep):
    with pytest.raises(ValueError, match=f"n_routed_experts={E} is not divisible by {ep}"):
        check_ep_size(experts_module(E, 8, 4, 0), ep)


@pytest.mark.parametrize("E,ep", [(8, 4), (6, 2), (6, 6), (4, 1)])
def test_even_splits_pass(E, ep):
    check_ep_size(experts_module(E, 8, 4, 0), ep)
