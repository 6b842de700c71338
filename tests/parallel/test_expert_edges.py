"""Expert parallelism at its edges (one process, no mesh): a remainder of exactly one expert is refused like any
other, every even split passes, and the mixed-mesh gradient clip never scales gradients up.

Legend: E routed experts, ep the expert-parallel ranks.
"""

from __future__ import annotations

import pytest
import torch

from glm53.parallel import check_ep_size, clip_grad_norm_
from tests.parallel.test_expert_placement import experts_module


@pytest.mark.parametrize("E,ep", [(9, 4), (5, 2), (7, 3)])
def test_one_expert_left_over_is_refused(E, ep):
    with pytest.raises(ValueError, match=f"n_routed_experts={E} is not divisible by {ep}"):
        check_ep_size(experts_module(E, 8, 4, 0), ep)


@pytest.mark.parametrize("E,ep", [(8, 4), (6, 2), (6, 6), (4, 1)])
def test_even_splits_pass(E, ep):
    check_ep_size(experts_module(E, 8, 4, 0), ep)


@pytest.mark.parametrize("scale", [0.25, 4.0], ids=["below", "above"])
def test_clip_grad_norm_leaves_small_gradients_alone_and_scales_large_ones(scale):
    """The mixed-mesh clip on plain gradients equals torch's: below max_norm nothing changes (never scaled up)."""
    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    theirs = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    grads = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    norm = torch.linalg.vector_norm(torch.cat([x.flatten() for x in grads]))
    for a, b, x in zip(ours, theirs, grads):
        a.grad, b.grad = x * scale / norm, x * scale / norm  # total norm = scale
    total = clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(total, torch.tensor(scale))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours]))
    torch.testing.assert_close(after, torch.tensor(min(scale, 1.0)), rtol=1e-5, atol=1e-6)
