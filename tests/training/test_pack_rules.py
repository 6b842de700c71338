"""The packer's two rules a mutation audit found untested (issue #34): a document that exactly fills the rest of a
row goes into that row (not the next), and each epoch's order comes from (seed, epoch) with seeds kept apart, so
seed 1's first epoch is not seed 0's second."""

from __future__ import annotations

import pytest

from glm53.training.data.pack import Packer
from glm53.training.data.tokenize import TokenDoc


def docs(lengths: list[int]) -> list[TokenDoc]:
    """Document i holds tokens 100 * (i + 1) + j, so every token names its document."""
    return [TokenDoc([100 * (i + 1) + j for j in range(n)], [True] * n, f"doc{i}") for i, n in enumerate(lengths)]


@pytest.mark.parametrize("seed", range(4))
def test_a_document_that_exactly_fills_the_rest_of_a_row_goes_into_it(seed):
    packer = Packer(docs([3, 5]), seq_len=8, seed=seed, pad_id=0)
    ids, labels, mask, positions = packer.row()
    assert mask == [1] * 8 and packer.stats.padding == 0 and packer.stats.split == 0
    first = 3 if ids[0] == 100 else 5
    assert positions == list(range(first)) + list(range(8 - first))
    assert sorted(ids) == [100, 101, 102, 200, 201, 202, 203, 204]


def test_each_epoch_order_depends_on_seed_and_epoch_apart():
    n = 24
    seed0, seed1 = Packer(docs([1] * n), 1, 0, 0), Packer(docs([1] * n), 1, 1, 0)  # one-token documents and rows
    epoch0 = [seed0.row()[0][0] for _ in range(n)]
    epoch1 = [seed0.row()[0][0] for _ in range(n)]
    first_of_seed1 = [seed1.row()[0][0] for _ in range(n)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(first_of_seed1) == [100 * (i + 1) for i in range(n)]
    assert epoch0 != epoch1  # a new order every epoch
    assert first_of_seed1 != epoch1 and first_of_seed1 != epoch0  # seed + epoch would make seed 1 = seed 0's next
