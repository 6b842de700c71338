"""VL packing: whole records, media in placeholder order, too-long records skipped (or strict errors), exact
resume, and each data-parallel rank decoding only its own rows."""

from __future__ import annotations

import pytest
import torch

from glm53.training.data.documents import DataError
from glm53.training.data.tokenize import TextTokenizer
from glm53.training.data.vl_pack import VLPacker, fit_records, make_batch
from glm53.training.data.vl_records import read_vl_records
from glm53.training.data.vl_tokenize import VLEncoder
from tests.helpers.vl_data import (
    save_tokenizer,
    vl_tokenizer,
    write_frames,
    write_image,
    write_jsonl,
)

SIZES = [(56, 56), (56, 84), (84, 56), (112, 56), (56, 112), (84, 84)]  # distinct grids identify the images


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlpack")
    root = tmp / "media"
    for k, (h, w) in enumerate(SIZES):
        write_image(str(root / f"i{k}.png"), h, w, k)
    write_frames(str(root / "clip"), 4, 56, 56, 9)
    records = [{"text": "plain words " * 3}]
    for k in range(len(SIZES)):
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"<image>look {k}<image>"},
                    {"role": "assistant", "content": f"answer {k}"},
                ],
                "images": [f"i{k}.png", f"i{(k + 1) % len(SIZES)}.png"],
            }
        )
    records.append(
        {
            "messages": [{"role": "user", "content": "<video> and <image>"}, {"role": "assistant", "content": "both"}],
            "videos": [{"path": "clip", "fps": 4}],
            "images": ["i0.png"],
        }
    )
    records.append(
        {
            "messages": [{"role": "user", "content": "<image>" * 8}, {"role": "assistant", "content": "many"}],
            "images": [f"i{k % 6}.png" for k in range(8)],
        }
    )  # ~180 tokens: skipped at T = 128
    data = write_jsonl(str(tmp / "d.jsonl"), records)
    enc = VLEncoder(TextTokenizer(save_tokenizer(vl_tokenizer(), str(tmp / "tok"))))
    docs, _ = read_vl_records(data, str(root))
    return enc, [enc.encode(d) for d in docs]


def _image_runs(ids: list[int], enc: VLEncoder) -> list[tuple[str, int]]:
    """(kind, placeholder count) per <|begin_of_image|> ... <|end_of_image|> run, inside a video span or not."""
    t = enc.ids
    runs, depth, count = [], 0, None
    for i in ids:
        if i == t["<|begin_of_video|>"]:
            depth += 1
        elif i == t["<|end_of_video|>"]:
            depth -= 1
        elif i == t["<|begin_of_image|>"]:
            count = 0
        elif i == t["<|image|>"]:
            count += 1
        elif i == t["<|end_of_image|>"]:
            runs.append(("video" if depth else "image", count))
    return runs


def test_rows_keep_records_whole_with_media_in_order(corpus):
    enc, docs = corpus
    T = 128
    kept, skipped = fit_records(docs, T, strict=False)
    assert len(skipped) == 1 and len(skipped[0].media) == 8  # the 8-image record is > 128 tokens
    packer = VLPacker(kept, T, seed=3, pad_id=0)
    batch = make_batch(packer.rows(12, slice(None)), enc)
    assert batch.input_ids.shape == (12, T) and batch.position_ids.dim() == 2  # 1-D positions per row
    assert any(len(row) >= 4 for row in batch.spans)  # some rows hold two image records: order across records
    for r in range(12):  # the row's marker runs are its spans' structure, in order: no span cut or reordered
        expected = [(s.kind, s.grid[1] * s.grid[2] // 4) for s in batch.spans[r] for _ in range(s.grid[0])]
        assert _image_runs(batch.input_ids[r].tolist(), enc) == expected
    flat = [s for row in batch.spans for s in row]
    assert batch.image_grid_thw.tolist() == [list(s.grid) for s in flat if s.kind == "image"]
    assert batch.video_grid_thw.tolist() == [list(s.grid) for s in flat if s.kind == "video"]
    assert batch.pixel_values.shape[0] == sum(t * h * w for t, h, w in batch.image_grid_thw.tolist())
    # the pixels are the spans' own rows, in order
    spans = [s for row in batch.spans for s in row if s.kind == "image"]
    torch.testing.assert_close(batch.pixel_values, torch.cat([enc.pixels(s) for s in spans]), rtol=0, atol=0)
    # every record's tokens sit contiguous in one row (never cut)
    for doc in kept:
        if not doc.media:
            continue
        n = len(doc.ids)
        found = [
            (r, c) for r in range(12) for c in range(T - n + 1) if batch.input_ids[r, c : c + n].tolist() == doc.ids
        ]
        seen = sum(1 for row in batch.spans for s in row if s is doc.media[0])
        assert len(found) >= seen  # each time the record was packed, it is whole in a row


def test_strict_too_long_is_an_error(corpus):
    _, docs = corpus
    with pytest.raises(DataError, match=r"d.jsonl:9: the record is \d+ tokens .* longer than --seq-len 128"):
        fit_records(docs, 128, strict=True)
    with pytest.raises(ValueError, match="cannot be packed into rows of 128"):
        VLPacker(docs, 128, 0, 0)


def test_resume_is_exact(corpus):
    enc, docs = corpus
    kept, _ = fit_records(docs, 128, strict=False)
    a = VLPacker(kept, 128, seed=1, pad_id=0)
    a.rows(7, slice(None))
    state = a.state_dict()
    rest = a.rows(9, slice(None))
    b = VLPacker(kept, 128, seed=1, pad_id=0)
    b.load_state_dict(state)
    again = b.rows(9, slice(None))
    assert [r for r, _ in again] == [r for r, _ in rest]
    assert [[s.media.path for s in sp] for _, sp in again] == [[s.media.path for s in sp] for _, sp in rest]
    bad = dict(state)
    vl_position = next(i for i, k in enumerate(b._order(state["epoch"])) if kept[k].media)
    bad.update(index=vl_position, offset=3)
    with pytest.raises(ValueError, match="'offset' 3 is inside an image/video record"):
        b.load_state_dict(bad)


def test_dp_ranks_decode_only_their_rows(corpus, monkeypatch):
    enc, docs = corpus
    kept, _ = fit_records(docs, 128, strict=False)
    full = VLPacker(kept, 128, seed=2, pad_id=0).rows(8, slice(None))
    decoded = []
    monkeypatch.setattr(enc, "pixels", lambda span: decoded.append(span) or torch.zeros(0, 1176))
    for rank in range(2):
        packer = VLPacker(kept, 128, seed=2, pad_id=0)
        mine = packer.rows(8, slice(rank * 4, (rank + 1) * 4))
        assert [r for r, _ in mine] == [r for r, _ in full[rank * 4 : (rank + 1) * 4]]
        decoded.clear()
        make_batch(mine, enc)
        assert decoded == [s for _, sp in mine for s in sp if s.kind == "image"] + [
            s for _, sp in mine for s in sp if s.kind == "video"
        ]


def test_fit_records_boundary(corpus):
    """A record of exactly T tokens fits a row; one token more is skipped (text-only records are never skipped)."""
    _, docs = corpus
    doc = next(d for d in docs if d.media)
    text = next(d for d in docs if not d.media)
    n = len(doc.ids)
    assert fit_records([doc, text], n, strict=False) == ([doc, text], [])
    assert fit_records([doc, text], n - 1, strict=False) == ([text], [doc])
    assert fit_records([text], 2, strict=True) == ([text], [])
