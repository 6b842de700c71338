"""Context-parallel helpers (glm53/model/cp.py) written out on one rank (a SequenceShards of size 1): document
fields of packed rows numbered as one process numbers them, halo starts, boundaries, and `ahead` at the depth edge;
on gloo, `context_parallel_inputs` of a packed row that 2 ranks do not divide, written out.

Legend: B batch, T time (the rank's slice, here the whole sequence), W the causal-conv halo width.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config
from glm53.model.cp import ahead, halo_starts, sharded_packing_fields
from glm53.model.packing import starts_to_cu_seqlens
from tests.helpers.cp_inputs_edges_jobs import cp_inputs_job
from tests.helpers.cp_jobs import OneRank


def test_packed_rows_get_local_boundaries_and_one_process_document_numbers():
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    fields = sharded_packing_fields(position_ids, OneRank(5))
    assert fields["cu_seqlens"].tolist() == [0, 3, 5, 7, 10]
    assert fields["segment_ids"].tolist() == [[0, 0, 0, 1, 1], [2, 2, 3, 3, 3]]  # row 1 continues row 0's count


def test_a_row_whose_positions_do_not_start_at_zero_still_starts_a_document():
    fields = sharded_packing_fields(torch.tensor([[1, 2, 0, 1]]), OneRank(4))  # starts at 1, nothing before it
    assert fields["cu_seqlens"].tolist() == [0, 2, 4]
    assert fields["segment_ids"].tolist() == [[0, 0, 1, 1]]


def test_boundaries_add_row_starts_and_the_end():
    starts = torch.tensor([[False, False, True, False], [False, True, False, False]])
    assert starts_to_cu_seqlens(starts).tolist() == [0, 2, 4, 5, 8]


@pytest.mark.parametrize("width", [0, 1, 3])
def test_halo_starts_on_the_first_rank_start_at_its_first_position(width):
    segments = torch.tensor([[0, 0, 1, 1]])
    starts = halo_starts(segments, OneRank(4), width)
    assert starts.shape == (1, width + 4)
    # No tokens before the sequence: the halo is its own document, the slice's first token starts a new one.
    expected = [True] + [False] * (width - 1) + [True, False, True, False] if width else [True, False, True, False]
    assert starts[0].tolist() == expected


def test_ahead_reaches_the_depth_edge_and_refuses_past_it():
    x = torch.arange(1.0, 7.0).view(1, 6, 1)
    torch.testing.assert_close(ahead(x, 2, -1.0, OneRank(6)), torch.tensor([3.0, 4, 5, 6, -1, -1]).view(1, 6, 1))
    torch.testing.assert_close(ahead(x, 6, -1.0, OneRank(6)), torch.full((1, 6, 1), -1.0))  # d = T: all past the end
    mask = torch.tensor([[True, False, True]])
    assert ahead(mask, 1, False, OneRank(3)).tolist() == [[False, True, False]]
    with pytest.raises(ValueError, match="MTP depth 7 exceeds this rank's 6 positions"):
        ahead(x, 7, -1.0, OneRank(6))


def test_context_parallel_inputs_written_out(pool2):
    """T = 5 over 2 ranks (3 positions each, one padding token): the last rank gets the padding masked, its
    position continuing the last document and its target ignored; targets cross the rank edge; the loss
    denominators are the whole batch's."""
    ids = torch.tensor([[11, 12, 13, 14, 15]])
    config = Glm53Config.tiny(pad_token_id=0).to_dict()
    first, last = pool2.run(cp_inputs_job, config=config, ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
    assert first["cp"] == (0, 2, 0, 6) and last["cp"] == (1, 2, 3, 6)
    assert first["input_ids"].tolist() == [[11, 12, 13]] and last["input_ids"].tolist() == [[14, 15, 0]]
    assert first["attention_mask"].tolist() == [[1, 1, 1]] and last["attention_mask"].tolist() == [[1, 1, 0]]
    assert first["position_ids"].tolist() == [[0, 1, 2]] and last["position_ids"].tolist() == [[0, 1, 2]]
    assert first["labels"].tolist() == [[12, 13, 14]] and last["labels"].tolist() == [[15, -100, -100]]
    assert first["counts_match"] and last["counts_match"]
