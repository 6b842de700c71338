"""loss_counts edges the normalisation tests do not reach: a padding hole inside a row (a pool with an invalid token
is no candidate, so it never opens the indexer KL rows) and document starts where position_ids jump without
restarting at 0.

Legend: B batch, T time.
"""

from __future__ import annotations

import torch

from glm53.config import Glm53Config
from glm53.losses import document_spans, indexer_query_rows


def test_indexer_rows_start_at_the_first_complete_pool():
    """index_kpool 4, pools from each row's first valid token. Row 0 (a hole at 2): pool [0, 4) is incomplete, the
    first complete one ends at 7. Row 1 (left-padded by 2): pool [2, 6) ends at 5."""
    config = Glm53Config.tiny()
    assert config.index_kpool == 4
    valid = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # [B, T]
    expected = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(indexer_query_rows(valid, config), expected)


def test_documents_start_where_positions_do_not_continue():
    spans = document_spans(torch.tensor([[0, 1, 2, 5, 6, 0, 1], [3, 4, 5, 6, 7, 8, 9]]))
    assert spans == [[(0, 3), (3, 5), (5, 7)], [(0, 7)]]
