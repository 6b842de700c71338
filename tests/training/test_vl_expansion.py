"""VL rendering and expansion against transformers' Glm5NextProcessor + the chat template, token for token.

The oracle renders the conversation with the tokenizer's chat template (content lists for a template that writes
media markers; the markers inline otherwise) and lets Glm5NextProcessor expand and tokenise it.
"""

from __future__ import annotations

import os

import pytest
import torch
from PIL import Image

from glm53.training.data.documents import DataError
from glm53.training.data.tokenize import TextTokenizer
from glm53.training.data.vl_records import read_vl_records
from glm53.training.data.vl_tokenize import (
    IMAGE_MARKER,
    MEDIA_TOKENS,
    VIDEO_MARKER,
    VLEncoder,
)
from glm53.vision.video_processing import VideoProcessor
from tests.helpers.vl_data import (
    hf_processor,
    save_tokenizer,
    vl_tokenizer,
    write_frames,
    write_image,
    write_jsonl,
)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    write_image(str(root / "a.png"), 120, 150, 1)  # within budget: 5 x 6 blocks -> 30 tokens
    write_image(str(root / "b.jpg"), 40, 70, 2)  # below the minimum: scaled up
    write_image(str(root / "sub" / "c.png"), 300, 200, 3)
    write_frames(str(root / "clip"), 9, 56, 84, 4)  # 9 frames; fps from the record
    return root


@pytest.fixture(scope="module", params=["markers", "plain"])  # no template: test_plain_form_targets
def tok_dir(request, tmp_path_factory):
    return save_tokenizer(vl_tokenizer(request.param), str(tmp_path_factory.mktemp(f"tok-{request.param}")))


CONVERSATIONS = {
    "several-images": [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "a.png"},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": "sub/c.png"}},
                {"type": "text", "text": " differ how?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Colours."}]},
    ],
    "video": [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "video", "video": "clip", "fps": 3}, {"type": "text", "text": "What happens?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Noise moves."}]},
    ],
    "interleaved-multi-turn": [
        {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image", "image": "b.jpg"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A small one."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Now "},
                {"type": "video", "video": "clip", "fps": 6},
                {"type": "text", "text": " then "},
                {"type": "image", "image": "a.png"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Both seen."}]},
    ],
    "image-in-answer": [
        {"role": "user", "content": "Show me one."},
        {"role": "assistant", "content": [{"type": "text", "text": "Here: "}, {"type": "image", "image": "a.png"}]},
    ],
}


def _oracle_ids(tok, root, messages, template_renders_media: bool) -> list[int]:
    """transformers: render with the chat template, then Glm5NextProcessor expands and tokenises."""
    images, layouts, hf_messages = [], [], []
    vp = VideoProcessor()
    for m in messages:
        parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        out = []
        for p in parts:
            if p["type"] == "text":
                out.append(p)
                continue
            kind = p["type"].removesuffix("_url")
            path = p.get(kind) or p[p["type"]]["url"]
            if kind == "image":
                images.append(Image.open(os.path.join(root, path)))
            else:
                clip = vp.load(os.path.join(root, path), p.get("fps"))
                grid, _, _, _ = vp.layout(clip)
                layouts.append((grid, clip.timestamps))
            out.append({"type": kind})
        if template_renders_media:
            hf_messages.append({"role": m["role"], "content": out})
        else:
            text = "".join(
                p["text"] if p["type"] == "text" else IMAGE_MARKER if p["type"] == "image" else VIDEO_MARKER
                for p in out
            )
            hf_messages.append({"role": m["role"], "content": text})
    text = tok.apply_chat_template(hf_messages, tokenize=False)
    processor = hf_processor(tok, layouts)
    dummy = [torch.zeros(2, 28, 28, 3, dtype=torch.uint8)] * len(layouts)  # the stand-in ignores the pixels
    out = processor(text=[text], images=images or None, videos=dummy or None)
    return out["input_ids"][0] if isinstance(out["input_ids"][0], list) else out["input_ids"][0].tolist()


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_ids_equal_glm5next_processor(name, media, tok_dir, tmp_path):
    data = write_jsonl(str(tmp_path / "d.jsonl"), [{"messages": CONVERSATIONS[name]}])
    docs, _ = read_vl_records(data, str(media))
    tok = TextTokenizer(tok_dir)
    enc = VLEncoder(tok)
    doc = enc.encode(docs[0])
    template = tok.hf.chat_template or ""
    ref = _oracle_ids(tok.hf, str(media), CONVERSATIONS[name], "begin_of_image" in template)
    assert doc.ids == ref
    # labels: no media token is ever a target, and the targets are exactly the assistant turns' text + EOS + "\n"
    media_ids = {tok.hf.convert_tokens_to_ids(t) for t in MEDIA_TOKENS}
    assert not any(t for i, t in zip(doc.ids, doc.targets) if i in media_ids)
    trained = tok.hf.decode([i for i, t in zip(doc.ids, doc.targets) if t])
    answers = [
        "".join(p["text"] for p in m["content"] if p["type"] == "text")
        for m in CONVERSATIONS[name]
        if m["role"] == "assistant"
    ]
    assert trained == "".join(a + "<|endoftext|>\n" for a in answers)


def test_expansion_counts(media, tmp_path):
    """Per image h·w/4 <|image|> between its markers; per video slice the structure with "{t:.1f} seconds"."""
    tok = TextTokenizer(save_tokenizer(vl_tokenizer("markers"), str(tmp_path / "tok")))
    data = write_jsonl(str(tmp_path / "d.jsonl"), [{"messages": CONVERSATIONS["interleaved-multi-turn"]}])
    doc = VLEncoder(tok).encode(read_vl_records(data, str(media))[0][0])
    assert [s.kind for s in doc.media] == ["image", "video", "image"]
    image_id = tok.hf.convert_tokens_to_ids("<|image|>")
    expected = sum(s.grid[0] * s.grid[1] * s.grid[2] // 4 for s in doc.media)
    assert doc.ids.count(image_id) == expected
    assert doc.media[2].grid == (1, 10, 12)  # a.png 120 x 150: canvas 140 x 168, no resize
    clip = doc.media[1]  # one timestamp per slice: every second sampled frame's index / fps
    assert clip.timestamps == [i / 6 for i in VideoProcessor().load(str(media / "clip"), 6.0).indices[::2]]
    text = tok.hf.decode(doc.ids)
    assert text.count(" seconds") == clip.grid[0]
    assert "0.0 seconds" in text and f"{clip.timestamps[-1]:.1f} seconds" in text


def test_plain_form_targets(media, tmp_path):
    """No chat template: 'role: content' lines with inline markers; targets the assistant content + EOS."""
    tok = TextTokenizer(save_tokenizer(vl_tokenizer("none"), str(tmp_path / "tok")))
    data = write_jsonl(str(tmp_path / "d.jsonl"), [{"messages": CONVERSATIONS["several-images"]}])
    doc = VLEncoder(tok).encode(read_vl_records(data, str(media))[0][0])
    assert tok.hf.decode([i for i, t in zip(doc.ids, doc.targets) if t]) == "Colours.<|endoftext|>"
    assert tok.hf.decode(doc.ids).startswith("user: <|begin_of_image|><|image|>")


def test_llamafactory_equals_content_lists(media, tmp_path):
    """The same conversation as LLaMA-Factory images/videos lists with placeholders: identical ids and targets."""
    tok = TextTokenizer(save_tokenizer(vl_tokenizer("markers"), str(tmp_path / "tok")))
    lf = {
        "messages": [
            {"role": "user", "content": "Look: <image>"},
            {"role": "assistant", "content": "A small one."},
            {"role": "user", "content": "Now <video> then <image>"},
            {"role": "assistant", "content": "Both seen."},
        ],
        "images": ["b.jpg", "a.png"],
        "videos": [{"path": "clip", "fps": 6}],
    }
    data = write_jsonl(str(tmp_path / "d.jsonl"), [{"messages": CONVERSATIONS["interleaved-multi-turn"]}, lf])
    docs, _ = read_vl_records(data, str(media))
    enc = VLEncoder(tok)
    a, b = enc.encode(docs[0]), enc.encode(docs[1])
    assert a.ids == b.ids and a.targets == b.targets
    assert [s.media.path for s in a.media] == [s.media.path for s in b.media]


def test_text_only_records_in_vl_file(media, tmp_path):
    tok = TextTokenizer(save_tokenizer(vl_tokenizer("markers"), str(tmp_path / "tok")))
    data = write_jsonl(
        str(tmp_path / "d.jsonl"),
        [{"text": "plain text"}, {"prompt": "Q?", "completion": "A."}, {"messages": CONVERSATIONS["several-images"]}],
    )
    docs, _ = read_vl_records(data, str(media))
    enc = VLEncoder(tok)
    out = [enc.encode(d) for d in docs]
    assert [len(d.media) for d in out] == [0, 0, 2]
    assert tok.hf.decode(out[0].ids) == "plain text<|endoftext|>"
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [{"text": "sneaky <|image|> token"}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: the text holds the media token <\|image\|>"):
        enc.encode(read_vl_records(bad, str(media))[0][0])


def test_tokenizer_without_media_tokens(tmp_path):
    from examples.finetune import build_tokenizer

    path = str(tmp_path / "tok")
    build_tokenizer().save_pretrained(path)
    with pytest.raises(DataError, match=r"has no <\|begin_of_image\|> token: image/video records need a GLM-5.3"):
        VLEncoder(TextTokenizer(path))
