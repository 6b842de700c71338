"""Edges of model/packing.py's boundaries: positions that jump without restarting at 0, boundaries given without
the row starts, duplicate boundaries (empty documents) in segment ids, the one-document-per-row case, the
compile form (duplicates kept, sorted) against the eager one, and the k-pool layout written out by hand.

Legend (glm53/model/__init__.py): B batch, T time, n documents, P pools, L tokens per pool.
"""

from __future__ import annotations

import torch

from glm53.model.packing import document_boundaries, document_pool_layout, segment_ids

CPU = torch.device("cpu")


def brute_segments(cu: list[int], B: int, T: int) -> list[list[int]]:
    """Index of each token's document among the non-empty ones, by a plain loop."""
    ids, k = [], -1
    for s, e in zip(cu[:-1], cu[1:]):
        if e > s:
            k += 1
            ids += [k] * (e - s)
    return [ids[b * T : (b + 1) * T] for b in range(B)]


def test_positions_that_jump_start_a_document():
    """A document starts wherever the position does not continue the previous one, not only at 0."""
    pos = torch.tensor([[0, 1, 2, 5, 6, 0, 1, 2], [3, 4, 0, 1, 2, 3, 9, 10]])
    cu = document_boundaries(2, 8, CPU, position_ids=pos)
    assert cu.tolist() == [0, 3, 5, 8, 10, 14, 16]


def test_boundaries_without_row_starts_get_them():
    """cu_seqlens over the flattened tokens need not list the row starts: they are added."""
    cu = document_boundaries(2, 4, CPU, cu_seqlens=torch.tensor([0, 2, 8]))
    assert cu.tolist() == [0, 2, 4, 8]


def test_one_document_per_row_is_not_packed():
    assert document_boundaries(2, 4, CPU, cu_seqlens=torch.tensor([0, 4, 4, 8])) is None
    assert document_boundaries(2, 4, CPU, cu_seqlens=torch.tensor([0, 8])) is None
    assert document_boundaries(2, 4, CPU, position_ids=torch.arange(4).expand(2, 4)) is None
    assert document_boundaries(1, 4, CPU, cu_seqlens=torch.tensor([0, 1, 4])).tolist() == [0, 1, 4]


def test_segment_ids_skip_empty_documents():
    cu = [0, 3, 3, 4, 4, 6, 6, 8, 12]  # with every row start (a valid packed batch)
    ids = segment_ids(torch.tensor(cu), 3, 4)
    assert ids.tolist() == brute_segments(cu, 3, 4) and int(ids.max()) == 4  # 5 non-empty documents


def test_compile_form_keeps_duplicates_and_gives_the_same_segments(monkeypatch):
    """Under torch.compile (is_compiling faked here) the boundaries are sorted with duplicates kept; segment ids
    from them equal the eager ones."""
    given = torch.tensor([0, 5, 5, 8, 11, 12])
    eager = document_boundaries(3, 4, CPU, cu_seqlens=given)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compiled = document_boundaries(3, 4, CPU, cu_seqlens=given)
    assert compiled.tolist() == [0, 0, 4, 5, 5, 8, 8, 11, 12, 12]
    assert eager.tolist() == sorted(set(compiled.tolist()))
    assert torch.equal(segment_ids(compiled, 3, 4), segment_ids(eager, 3, 4))


# row 0: documents of 5 and 3 tokens; row 1: one of 3 padded tokens only, then one of 5 (its last pool short)
POOL_CU, POOL_KPOOL = torch.tensor([0, 5, 8, 11, 16]), 3


def pool_case() -> torch.Tensor:
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, :3] = False
    return valid


def test_document_pool_layout_written_out():
    """Eager: every pool from each document's first valid token, short last pools kept (their tokens past the end
    invalid), no pool for an all-padding document, the slots past a row's pools empty (T + slot, invalid)."""
    positions, token_valid = document_pool_layout(pool_case(), POOL_CU, POOL_KPOOL)
    empty = [8, 9, 10]
    assert positions.tolist() == [
        [[0, 1, 2], [3, 4, 5], [5, 6, 7], empty, empty, empty],
        [[3, 4, 5], [6, 7, 8], empty, empty, empty, empty],
    ]
    full, none = [True] * 3, [False] * 3
    assert token_valid.tolist() == [
        [full, [True, True, False], full, none, none, none],
        [full, [True, True, False], none, none, none, none],
    ]


def test_document_pool_layout_compile_form_written_out(monkeypatch):
    """Compile form (is_compiling faked): whole pools only, P = T // L slots, the rest empty."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    positions, token_valid = document_pool_layout(pool_case(), POOL_CU, POOL_KPOOL)
    assert positions.tolist() == [[[0, 1, 2], [5, 6, 7]], [[3, 4, 5], [8, 9, 10]]]
    assert token_valid.tolist() == [[[True] * 3] * 2, [[True] * 3, [False] * 3]]
