"""The sequence-wise balance loss (glm53/losses/parts.py `balance_loss`) in every layout, in one process, against
its definition (DeepSeek-V3 eq. 17-20) written here as a loop in fp64: whole rows, packed documents (`segment_ids`,
`num_documents`) and context-parallel slices (`cp`), with the loss's own count or a given `num_sequences`.

Context parallelism runs as `SIZE` Python threads, one per rank, exchanging tensors through `ThreadShards` (the
SequenceShards a real mesh implements in glm53/parallel/cp_shards.py): the ranks' shares are built in one autograd
graph, so their sum's gradient reaches every rank's logits as the real stack's backward sends it. The gloo version of
the same check is tests/parallel/test_cp_balance_loss.py; this one also runs where spawned process groups cannot
(mutmut's forkserver workers, setup.cfg).

Legend: B batch, T time (whole rows; a rank holds T / size of each), E routed experts, K experts per token.
"""

from __future__ import annotations

import threading

import pytest
import torch

from glm53.losses import balance_loss
from glm53.model.packing import document_boundaries, segment_ids

B, T, E, K = 2, 12, 8, 2
# row 0: a padding token, then a document over the slice edges of cp 2 (6) and cp 3 (4, 8); row 1: documents starting
# exactly at the cp 3 edges 4 and 8, a one-token document (8) and a last document that is all padding (9..11)
LENGTHS = [[2, 7, 3], [4, 4, 1, 3]]
# fp32 sums of at most T * K terms, then E products, against an fp64 loop: (T * K + E) * eps32 ~ 2e-6, doubled
RTOL = 2 * (T * K + E) * torch.finfo(torch.float32).eps
ROWS = torch.arange(B)[:, None].expand(B, T)  # [B, T] every row one sequence


def case() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, E, generator=g, dtype=torch.float64).float()
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, 0] = False
    valid[1, 9:] = False
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    cu = document_boundaries(B, T, pos.device, position_ids=pos)
    return dict(logits=logits, indices=logits.topk(K, dim=-1).indices, valid=valid, segment_ids=segment_ids(cu, B, T))


def definition(logits, indices, valid, groups, num_sequences=None) -> torch.Tensor:
    """sum over sequences s with a valid token of sum_i f_i P_i, / num_sequences (default: their count), in fp64:
    f_i = E / (K n_s) * #(valid token, slot) pairs routed to i, P_i = mean over valid tokens of s_i / sum_j s_j.
    logits [B, T, E], indices [B, T, K], valid [B, T], groups [B, T] the sequence of every token."""
    scores = logits.double().sigmoid()
    total, count = logits.new_zeros((), dtype=torch.float64), 0
    for s in groups.unique().tolist():
        tokens = (groups == s) & valid
        n = int(tokens.sum())
        if n == 0:
            continue
        probs = scores[tokens] / scores[tokens].sum(-1, keepdim=True)  # [n, E]
        f = torch.bincount(indices[tokens].flatten(), minlength=E).double() * E / (K * n)
        total, count = total + (f * probs.mean(0)).sum(), count + 1
    return total / (count if num_sequences is None else float(num_sequences))


class ThreadShards:
    """The SequenceShards of rank `rank` when every rank is a thread of this process: `stack` and `sum` meet at a
    barrier and read every rank's tensor from a shared board (with gradient for `stack`, as the real one)."""

    def __init__(self, rank: int, size: int, board: list, barrier: threading.Barrier) -> None:
        self.rank, self.size, self.offset, self.total = rank, size, rank * (T // size), T
        self.board, self.barrier = board, barrier

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.board[self.rank] = x
        self.barrier.wait(timeout=60)
        every = list(self.board)
        self.barrier.wait(timeout=60)  # nobody writes the next exchange's tensor before all have read this one
        return every

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(x))

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(x.detach())).sum(0)

    def all_gather(self, x, dim=1):
        raise AssertionError("the balance loss needs only stack and sum")

    from_previous = from_next = all_gather


def sharded_shares(inputs: dict, size: int, num_sequences, packed: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's `balance_loss(..., cp=...)` share of its slice, and the gradient of their sum w.r.t. logits."""
    logits = inputs["logits"].clone().requires_grad_()
    local = T // size
    board, barrier = [None] * size, threading.Barrier(size)
    shares, errors = [None] * size, []

    def rank_job(rank: int) -> None:
        mine = slice(rank * local, (rank + 1) * local)
        try:
            shares[rank] = balance_loss(
                logits[:, mine].reshape(-1, E),
                inputs["indices"][:, mine].reshape(-1, K),
                inputs["valid"][:, mine],
                num_sequences,
                inputs["segment_ids"][:, mine] if packed else None,
                cp=ThreadShards(rank, size, board, barrier),
            )
        except BaseException as e:  # noqa: BLE001 - reported by the test below, with the other ranks released
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_job, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    (grad,) = torch.autograd.grad(sum(shares), logits)
    return shares, grad


def reference(inputs: dict, groups: torch.Tensor, num_sequences) -> tuple[torch.Tensor, torch.Tensor]:
    x = inputs["logits"].double().requires_grad_()
    loss = definition(x, inputs["indices"], inputs["valid"], groups, num_sequences)
    return loss.detach(), torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("num_sequences", [None, 2.5], ids=["own-count", "given-count"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
def test_balance_loss_of_rows_and_documents_is_its_definition(packed, num_sequences):
    inputs = case()
    den = None if num_sequences is None else torch.tensor(num_sequences)
    groups = inputs["segment_ids"] if packed else ROWS
    expected, expected_grad = reference(inputs, groups, num_sequences)
    x = inputs["logits"].reshape(-1, E).clone().requires_grad_()
    docs = dict(segment_ids=inputs["segment_ids"], num_documents=7) if packed else {}
    loss = balance_loss(x, inputs["indices"].reshape(-1, K), inputs["valid"], den, **docs)
    torch.testing.assert_close(loss.double(), expected, rtol=RTOL, atol=0)
    grad = torch.autograd.grad(loss, x)[0].view(B, T, E)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=10 * RTOL, atol=RTOL * expected_grad.abs().max())
    if packed:  # the documents are not the rows: the two losses differ well above rounding
        rows = definition(inputs["logits"], inputs["indices"], inputs["valid"], ROWS, num_sequences)
        assert (rows - expected).abs() > 100 * RTOL * expected


def test_document_count_bounds_the_slots_and_is_checked():
    """num_documents sizes the per-document sums: any bound at or above the ids gives the same loss (7 documents are
    non-empty here, 24 = B * T is the default), one below the largest id is a ValueError naming it."""
    inputs = case()
    x, idx, valid, seg = (inputs[k] for k in ("logits", "indices", "valid", "segment_ids"))
    x, idx = x.reshape(-1, E), idx.reshape(-1, K)
    assert int(seg.max()) == 6
    exact = balance_loss(x, idx, valid, segment_ids=seg, num_documents=7)
    for bound in (8, B * T, None):
        torch.testing.assert_close(balance_loss(x, idx, valid, segment_ids=seg, num_documents=bound), exact)
    with pytest.raises(ValueError, match="num_documents=6 is too small: segment_ids go up to 6"):
        balance_loss(x, idx, valid, segment_ids=seg, num_documents=6)


@pytest.mark.parametrize("num_sequences", [None, 2.5], ids=["own-count", "given-count"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("size", [2, 3], ids=lambda n: f"cp{n}")
def test_context_parallel_shares_sum_to_the_definition(size, packed, num_sequences):
    """Each rank holds T / size of every row; its share is a part of the whole rows' (or documents') loss: the shares
    sum to the definition on the whole sequences and so does the gradient, which crosses the ranks."""
    inputs = case()
    den = None if num_sequences is None else torch.tensor(num_sequences)
    groups = inputs["segment_ids"] if packed else ROWS
    expected, expected_grad = reference(inputs, groups, num_sequences)
    shares, grad = sharded_shares(inputs, size, den, packed)
    torch.testing.assert_close(sum(shares).double(), expected, rtol=RTOL, atol=0)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=10 * RTOL, atol=RTOL * expected_grad.abs().max())
    for rank in range(size):  # every slice's logits move: the gradient really crossed the ranks
        assert grad[:, rank * (T // size) : (rank + 1) * (T // size)].abs().amax() > 1e-3
