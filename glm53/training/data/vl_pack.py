"""Pack VL records into rows of T tokens, whole records only, with their pixels in placeholder order.

Legend: B batch (rows), T time (--seq-len), N patch rows (vision/image_processing.py).
The packing is pack.py's (seeded per-epoch order, documents as segments restarting position_ids, the resumable
cursor), with one more rule: a record with images or videos is never cut. A record that does not fit in what is
left of a row starts the next one (pack.py's rule for any document that fits a row), and records longer than a
row are removed before packing (`fit_records`: skipped and counted, or an error with strict). Text-only records
of the same file pack exactly as in pack.py (a long one is cut into pieces).
A row carries its records' media spans in order; `VLBatch` turns the rows into tensors and decodes the pixels of
those spans only (under data parallelism each rank decodes only its own rows): `pixel_values` / `image_grid_thw`
of every image of the batch, row after row, placeholder order inside a row (the order the model splices them in),
and likewise `pixel_values_videos` / `video_grid_thw`. position_ids stay 1-D per row (document segments).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .documents import DataError
from .pack import Batch, Packer
from .vl_tokenize import MediaSpan, VLEncoder, VLTokenDoc


@dataclass
class VLBatch(Batch):
    """A micro-batch: Batch's [B, T] tensors plus the vision inputs of its rows (None when it has none)."""

    pixel_values: torch.Tensor | None = None  # [N_images, C·T·P·P]
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    pixel_values_videos: torch.Tensor | None = None  # [N_videos, C·T·P·P]
    video_grid_thw: torch.Tensor | None = None  # [videos, 3]
    spans: list[list[MediaSpan]] = field(default_factory=list)  # per row, in order

    def vision_inputs(self) -> dict[str, torch.Tensor]:
        """The forward's vision keyword arguments (only those present)."""
        names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def media_tokens(self) -> int:
        """Placeholder tokens of the batch's images and video frames (h·w/4 per image or video slice)."""
        return sum(s.grid[0] * s.grid[1] * s.grid[2] // 4 for row in self.spans for s in row)

    def rows(self, index: slice) -> VLBatch:
        raise TypeError("VLBatch rows are chosen before the pixels are decoded: use VLPacker.rows")


def fit_records(docs: list[VLTokenDoc], seq_len: int, strict: bool) -> tuple[list[VLTokenDoc], list[VLTokenDoc]]:
    """(kept, skipped): image/video records longer than `seq_len` are skipped, or with `strict` a DataError
    naming the first (a record is never cut: half an image span cannot be trained on)."""
    kept, skipped = [], []
    for doc in docs:
        if doc.media and len(doc.ids) > seq_len:
            if strict:
                raise DataError(
                    f"{doc.where}: the record is {len(doc.ids)} tokens with its images/videos expanded, "
                    f"longer than --seq-len {seq_len}; image/video records are never cut (raise "
                    f"--seq-len, lower the image budget, or drop --strict to skip such records)"
                )
            skipped.append(doc)
        else:
            kept.append(doc)
    return kept, skipped


class VLPacker(Packer):
    """pack.Packer over VLTokenDocs; `row()` also reports the media spans of the records packed in the row."""

    def __init__(self, docs: list[VLTokenDoc], seq_len: int, seed: int, pad_id: int) -> None:
        long = next((d for d in docs if d.media and len(d.ids) > seq_len), None)
        if long is not None:  # fit_records removes them first; a packer must never cut one
            raise ValueError(
                f"{long.where}: an image/video record of {len(long.ids)} tokens cannot be packed into rows of {seq_len}"
            )
        super().__init__(docs, seq_len, seed, pad_id)
        self._finished: list[int] = []

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.offset and self.docs[self.order[self.index]].media:
            raise ValueError(
                f"data position: 'offset' {self.offset} is inside an image/video record (they are never "
                f"cut): the saved state does not come from this data"
            )

    def _advance(self) -> None:
        self._finished.append(self.order[self.index])
        super()._advance()

    def vl_row(self) -> tuple[tuple[list[int], list[int], list[int], list[int]], list[MediaSpan]]:
        """The next row and the media spans of its records, in order. A record with media fits its row whole,
        so it is finished (advanced past) in the row it starts in."""
        self._finished = []
        row = self.row()
        return row, [s for i in self._finished for s in self.docs[i].media]

    def rows(self, count: int, keep: slice) -> list[tuple[tuple, list[MediaSpan]]]:
        """The next `count` rows (every rank packs them alike: one cursor), of which `keep` are returned."""
        return [self.vl_row() for _ in range(count)][keep]


def make_batch(rows: list[tuple[tuple, list[MediaSpan]]], encoder: VLEncoder) -> VLBatch:
    """Rows (from VLPacker.rows) -> a VLBatch, decoding the pixels of their media."""
    columns = [torch.tensor(c, dtype=torch.long) for c in zip(*(r for r, _ in rows))]
    spans = [s for _, s in rows]
    out = {}
    for kind, names in (
        ("image", ("pixel_values", "image_grid_thw")),
        ("video", ("pixel_values_videos", "video_grid_thw")),
    ):
        chosen = [s for row in spans for s in row if s.kind == kind]
        if chosen:
            out[names[0]] = torch.cat([encoder.pixels(s) for s in chosen])
            out[names[1]] = torch.tensor([list(s.grid) for s in chosen], dtype=torch.long)
    return VLBatch(*columns, spans=spans, **out)


__all__ = ["VLBatch", "VLPacker", "fit_records", "make_batch"]
