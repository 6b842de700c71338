"""Pack tokenised documents into rows of T tokens with document boundaries, in a seeded order, resumably.

Legend: B batch (rows), T time (--seq-len).
Each row holds whole documents one after another; a document that does not fit in what is left of a row starts
the next row (the rest is padding), and a document longer than a row is cut into pieces, the first filling the
current row. Every document (or piece) is a segment: `position_ids` restart at 0 at its first token (the
padding-free convention of transformers' DataCollatorWithFlattening; padding is a segment of its own), and its
first token is never a target (nothing before it in the segment predicts it), so the previous document's last
token has no next-token target across the boundary.
Order: a permutation of the documents per epoch from (seed, epoch). The cursor (epoch, index into the
permutation, token offset into that document) is the data position saved in the trainer state: a resumed run
continues at exactly the next token of the same document.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ...losses import IGNORE_INDEX
from .tokenize import TokenDoc

EPOCH_SEED_STRIDE = 1_000_003  # keeps (seed, epoch) pairs apart


@dataclass
class Batch:
    """One micro-batch: every tensor [B, T]."""

    input_ids: torch.Tensor
    labels: torch.Tensor  # IGNORE_INDEX where no loss
    attention_mask: torch.Tensor  # 1 at document tokens, 0 at padding
    position_ids: torch.Tensor  # restart at 0 at each segment

    def rows(self, index: slice) -> "Batch":
        return Batch(*(t[index] for t in (self.input_ids, self.labels, self.attention_mask, self.position_ids)))


@dataclass
class PackStats:
    rows: int = 0
    padding: int = 0  # padding tokens in those rows
    split: int = 0  # documents cut into pieces (counted when their first piece is packed)


class Packer:
    def __init__(self, docs: list[TokenDoc], seq_len: int, seed: int, pad_id: int) -> None:
        if not docs:
            raise ValueError("nothing to pack: no documents")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
            raise ValueError(f"pad_id must be a token id (an int >= 0), got {pad_id!r}")
        for doc in docs:  # an empty document would never fill a row: row() would loop forever
            if not doc.ids or len(doc.ids) != len(doc.targets):
                raise ValueError(
                    f"{doc.where}: a packed document needs tokens and one target flag per token, got "
                    f"{len(doc.ids)} ids and {len(doc.targets)} flags"
                )
        self.docs, self.seq_len, self.seed, self.pad_id = docs, seq_len, seed, pad_id
        self.epoch, self.index, self.offset = 0, 0, 0
        self.order = self._order(0)
        self.stats = PackStats()

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * EPOCH_SEED_STRIDE + epoch)
        return torch.randperm(len(self.docs), generator=g).tolist()

    # ------------------------------------------------------------------------------------------- position
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        """Restore the cursor; a state that does not fit these documents (a corrupt or foreign trainer state) is a
        ValueError naming the key, never a resume at a wrong token."""
        state = dict(state)
        for key in ("epoch", "index", "offset"):
            try:  # a python int, or a 0-d integer tensor / numpy int
                state[key] = operator.index(state[key])
            except (KeyError, TypeError):
                state[key] = None
            if state[key] is None or state[key] < 0:
                raise ValueError(f"data position: {key!r} must be an int >= 0 in the saved state")
        if state["index"] >= len(self.docs):
            raise ValueError(f"data position: 'index' {state['index']} is past the {len(self.docs)} documents")
        order = self._order(state["epoch"])
        if state["offset"] >= len(self.docs[order[state["index"]]].ids):
            raise ValueError(
                f"data position: 'offset' {state['offset']} is past the end of document "
                f"{state['index']} ({len(self.docs[order[state['index']]].ids)} tokens)"
            )
        self.epoch, self.index, self.offset, self.order = state["epoch"], state["index"], state["offset"], order

    def _advance(self) -> None:
        self.index, self.offset = self.index + 1, 0
        if self.index == len(self.order):
            self.epoch, self.index = self.epoch + 1, 0
            self.order = self._order(self.epoch)

    # ---------------------------------------------------------------------------------------------- rows
    def row(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """The next row: (ids, labels, attention mask, position_ids), each of length T."""
        T = self.seq_len
        ids, labels, positions = [], [], []
        while len(ids) < T:
            doc = self.docs[self.order[self.index]]
            space, rest = T - len(ids), len(doc.ids) - self.offset
            if space < rest <= T and ids:  # fits in a row, not in this one: start the next row with it
                break
            take = min(space, rest)
            if self.offset == 0 and take < len(doc.ids):
                self.stats.split += 1
            piece = slice(self.offset, self.offset + take)
            ids += doc.ids[piece]
            labels += [IGNORE_INDEX] + [
                t if m else IGNORE_INDEX for t, m in zip(doc.ids[piece][1:], doc.targets[piece][1:])
            ]
            positions += range(take)
            self.offset += take
            if self.offset == len(doc.ids):
                self._advance()
        real, pad = len(ids), T - len(ids)
        self.stats.rows += 1
        self.stats.padding += pad
        return (
            ids + [self.pad_id] * pad,
            labels + [IGNORE_INDEX] * pad,
            [1] * real + [0] * pad,
            positions + list(range(pad)),
        )

    def batch(self, rows: int) -> Batch:
        """The next `rows` rows as tensors [rows, T]."""
        return Batch(*(torch.tensor(column, dtype=torch.long) for column in zip(*(self.row() for _ in range(rows)))))


class Mixer:
    """Rows from several Packers in proportion to `weights`: each row comes from the source furthest behind its
    share (the largest weight * (rows + 1) - rows drawn from it; ties to the first), so after n rows source i has
    given round(weight_i * n) rows to within one, and the cursor (rows drawn per source plus each packer's
    position) is exact to resume."""

    def __init__(self, packers: list[Packer], weights: list[float]) -> None:
        if len(packers) != len(weights) or not packers:
            raise ValueError("a mixture needs one weight per source")
        self.packers, self.weights = packers, weights
        self.drawn = [0] * len(packers)

    def _next_source(self) -> int:
        total = sum(self.drawn) + 1
        return max(range(len(self.packers)), key=lambda i: (self.weights[i] * total - self.drawn[i], -i))

    def row(self) -> tuple[list[int], list[int], list[int], list[int]]:
        i = self._next_source()
        self.drawn[i] += 1
        return self.packers[i].row()

    def batch(self, rows: int) -> Batch:
        return Batch(*(torch.tensor(column, dtype=torch.long) for column in zip(*(self.row() for _ in range(rows)))))

    @property
    def stats(self) -> PackStats:
        s = PackStats()
        for p in self.packers:
            s.rows, s.padding, s.split = s.rows + p.stats.rows, s.padding + p.stats.padding, s.split + p.stats.split
        return s

    def state_dict(self) -> dict:
        return {"drawn": list(self.drawn), "sources": [p.state_dict() for p in self.packers]}

    def load_state_dict(self, state: dict) -> None:
        drawn, sources = state.get("drawn"), state.get("sources")
        if (
            not isinstance(drawn, list)
            or not isinstance(sources, list)
            or len(drawn) != len(self.packers)
            or len(sources) != len(self.packers)
        ):
            raise ValueError(f"data position: the mixture state does not have {len(self.packers)} sources")
        for p, s in zip(self.packers, sources):
            p.load_state_dict(s)
        self.drawn = [operator.index(d) for d in drawn]


__all__ = ["Batch", "Mixer", "Packer", "PackStats"]
