"""VL records: both conventions parsed to the same media order, paths kept inside the media root, and every bad
record a DataError naming FILE:LINE and the field."""

from __future__ import annotations

import os

import pytest

from glm53.training.data.documents import DataError, Document
from glm53.training.data.tokenize import TextTokenizer
from glm53.training.data.vl_records import VLDocument, read_vl_records
from glm53.training.data.vl_tokenize import VLEncoder
from glm53.vision.image_processing import ImageProcessor
from tests.helpers.vl_data import (
    save_tokenizer,
    vl_tokenizer,
    write_frames,
    write_image,
    write_jsonl,
)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "media"
    write_image(str(r / "a.png"), 60, 60)
    write_image(str(r / "b.png"), 60, 60, 1)
    write_frames(str(r / "clip"), 4, 28, 28)
    (r / "empty").mkdir()
    (r / "bad.png").write_bytes(b"\x89PNG not really")
    write_image(str(tmp_path / "outside.png"), 30, 30)
    os.symlink(tmp_path / "outside.png", r / "link.png")
    return r


def _read(tmp_path, root, records):
    return read_vl_records(write_jsonl(str(tmp_path / "d.jsonl"), records), str(root))


def test_conventions_and_paths(tmp_path, root):
    docs, empty = _read(
        tmp_path,
        root,
        [
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": "a.png"},
                            {"type": "video_url", "video_url": {"url": "file://clip"}},
                        ],
                    },
                    {"role": "assistant", "content": "ok"},
                ]
            },
            {
                "messages": [
                    {"role": "user", "content": "<video> vs <image><image>"},
                    {"role": "assistant", "content": "x"},
                ],
                "images": ["b.png", str(root / "a.png")],
                "videos": ["clip"],
            },
            {
                "conversations": [{"from": "human", "value": "<image>hi"}, {"from": "gpt", "value": "yo"}],
                "images": ["a.png"],
            },
            {"text": "only text"},
            {"text": "  "},
        ],
    )
    assert [type(d) for d in docs] == [VLDocument, VLDocument, VLDocument, Document] and empty == 1
    assert [(m.kind, os.path.basename(m.path), m.field) for m in docs[0].media] == [
        ("image", "a.png", "messages[0].content[0].image"),
        ("video", "clip", "messages[0].content[1].video_url.url"),
    ]
    assert [(m.kind, os.path.basename(m.path)) for m in docs[1].media] == [
        ("video", "clip"),
        ("image", "b.png"),
        ("image", "a.png"),
    ]
    assert docs[1].messages[0]["parts"][1] == " vs "
    assert docs[2].messages[1]["role"] == "assistant" and docs[2].media[0].field == "images[0]"


BAD = [
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "../outside.png"}]}]},
        r"d.jsonl:1: messages\[0\].content\[0\].image '../outside.png' resolves to .*outside --media-root",
    ),
    (
        {"messages": [{"role": "user", "content": "<image>"}], "images": ["link.png"]},
        r"d.jsonl:1: images\[0\] 'link.png' resolves to .*outside.png, outside --media-root",
    ),
    (
        {"messages": [{"role": "user", "content": "<image> <image>"}], "images": ["a.png"]},
        r"d.jsonl:1: images: the record lists 1 images but its messages hold 2 <image> placeholders",
    ),
    (
        {"messages": [{"role": "user", "content": "no placeholder"}], "images": ["a.png"]},
        r"d.jsonl:1: images: the record lists 1 images but its messages hold 0 <image> placeholders",
    ),
    (
        {"messages": [{"role": "user", "content": "<video>"}], "videos": []},
        r"d.jsonl:1: videos: the record lists 0 videos but its messages hold 1 <video> placeholders",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        r"d.jsonl:1: messages\[0\].content\[0\].text must be a string, got int",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]},
        r"d.jsonl:1: messages\[0\].content\[0\] must be an object with 'type' one of .*got 'audio'",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
        r"d.jsonl:1: messages\[0\].content\[0\].image_url.url is a URL .*local files only",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "clip", "fps": -2}]}]},
        r"d.jsonl:1: messages\[0\].content\[0\].fps must be a positive number",
    ),
    (
        {"messages": [{"role": "robot", "content": [{"type": "text", "text": "x"}]}]},
        r"d.jsonl:1: messages\[0\].role is 'robot'",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}], "images": ["a.png"]},
        r"d.jsonl:1: messages\[0\].content is a list of parts while the record also has 'images'",
    ),
    (
        {"messages": [{"role": "user", "content": "<image>"}], "images": [7]},
        r"d.jsonl:1: images\[0\] must be a non-empty path string, got 7",
    ),
]


@pytest.mark.parametrize("record,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_records(tmp_path, root, record, message):
    with pytest.raises(DataError, match=message):
        _read(tmp_path, root, [record])


MEDIA_BAD = [
    ("missing.png", "image", r"d.jsonl:2: images\[0\]: .*missing.png: no such image file"),
    ("bad.png", "image", r"d.jsonl:2: images\[0\]: .*bad.png: not a readable image"),
    ("empty", "video", r"d.jsonl:2: videos\[0\]: .*empty: the frames folder holds no frames"),
    ("nothing", "video", r"d.jsonl:2: videos\[0\]: .*nothing: no such video file or frames folder"),
]


@pytest.mark.parametrize("path,kind,message", MEDIA_BAD, ids=[m[0] for m in MEDIA_BAD])
def test_bad_media_named_at_encoding(tmp_path, root, path, kind, message):
    """Media are decoded when the record is encoded: the error names the line and the field."""
    placeholder = "<image>" if kind == "image" else "<video>"
    docs, _ = _read(
        tmp_path,
        root,
        [{"text": "first"}, {"messages": [{"role": "user", "content": placeholder}], f"{kind}s": [path]}],
    )
    enc = VLEncoder(TextTokenizer(save_tokenizer(vl_tokenizer(), str(tmp_path / "tok"))))
    with pytest.raises(DataError, match=message):
        enc.encode(docs[1])


def test_image_too_large_for_the_budget(tmp_path, root):
    write_image(str(root / "strip.png"), 1, 3000)
    docs, _ = _read(tmp_path, root, [{"messages": [{"role": "user", "content": "<image>"}], "images": ["strip.png"]}])
    enc = VLEncoder(TextTokenizer(save_tokenizer(vl_tokenizer(), str(tmp_path / "tok"))), ImageProcessor(max_tokens=50))
    with pytest.raises(DataError, match=r"d.jsonl:1: images\[0\]: a 1x3000 .*cannot fit 50 tokens at any scale"):
        enc.encode(docs[0])


def test_file_level_errors(tmp_path, root):
    with pytest.raises(DataError, match="no such file"):
        read_vl_records(str(tmp_path / "nope.jsonl"), str(root))
    with pytest.raises(DataError, match="need a .jsonl file"):
        read_vl_records(write_jsonl(str(tmp_path / "d.txt"), ["x"]), str(root))
    with pytest.raises(DataError, match="--media-root .*: not a directory"):
        read_vl_records(write_jsonl(str(tmp_path / "d.jsonl"), [{"text": "x"}]), str(tmp_path / "no-root"))
    with pytest.raises(DataError, match=r"d.jsonl:2: invalid JSON"):
        read_vl_records(write_jsonl(str(tmp_path / "d.jsonl"), [{"text": "x"}, "{oops"]), str(root))
