"""Tokenise VL conversations: render, expand every image/video placeholder exactly as transformers' processor
does, and mark the loss targets.

Legend: token lists; pixel rows [N, C·T·P·P] only in `VLEncoder.pixels` (vision/image_processing.py legend).
Rendering: the tokenizer's chat template when it writes the media markers itself (its text mentions
`<|begin_of_image|>`: messages go to it as transformers content lists, {"type": "image"} / {"type": "video"}
parts); otherwise the built-in GLM-5.3 rendering: each image written inline as
`<|begin_of_image|><|image|><|end_of_image|>` and each video as `<|begin_of_video|><|video|><|end_of_video|>` in
its message's text, rendered by the template (or tokenize.py's plain "role: content" form without one). The
turn-by-turn target rule is tokenize.py's (assistant turns after the generation prompt are targets).
Expansion (transformers' `Glm5NextProcessor`): an image's `<|image|>` becomes h·w/m² of them; a video's
`<|video|>` becomes, per temporal slice, `<|begin_of_image|>` + h·w/m² `<|image|>` + `<|end_of_image|>` + the
text "{t:.1f} seconds". Every token of a marker or an expansion is never a target (labels -100).
Each record's media are decoded once here (bad files fail now, naming the record and field); the pixels are
decoded again when a row needs them (`pixels`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ...errors import InputError
from ...vision.image_processing import ImageProcessor
from ...vision.media import load_image
from ...vision.video_processing import VideoProcessor
from .documents import DataError, Document
from .tokenize import TextTokenizer, TokenDoc, _pieces
from .vl_records import Media, VLDocument

IMAGE_START, IMAGE, IMAGE_END = "<|begin_of_image|>", "<|image|>", "<|end_of_image|>"
VIDEO_START, VIDEO, VIDEO_END = "<|begin_of_video|>", "<|video|>", "<|end_of_video|>"
MEDIA_TOKENS = (IMAGE_START, IMAGE, IMAGE_END, VIDEO_START, VIDEO, VIDEO_END)
IMAGE_MARKER = IMAGE_START + IMAGE + IMAGE_END  # what the chat template writes per image, before expansion
VIDEO_MARKER = VIDEO_START + VIDEO + VIDEO_END
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")


@dataclass
class MediaSpan:
    """A record's image or video as the model sees it: its grid (t, h, w) in patches, and a video's timestamps."""

    media: Media
    grid: tuple[int, int, int]
    timestamps: list[float] | None = None  # per temporal slice (videos)

    @property
    def kind(self) -> str:
        return self.media.kind


@dataclass
class VLTokenDoc(TokenDoc):
    """A tokenised record with its media in placeholder order (empty for text-only records)."""

    media: list[MediaSpan] = field(default_factory=list)


def media_token_ids(tok: TextTokenizer) -> dict[str, int]:
    """The six media tokens' ids in `tok`; a tokenizer without them is a DataError naming the first missing."""
    ids = {}
    for text in MEDIA_TOKENS:
        if tok.raw is not None:
            value = tok.raw.token_to_id(text)
        else:
            value = tok.hf.convert_tokens_to_ids(text)
            value = None if value == tok.hf.unk_token_id else value
        if value is None:
            raise DataError(
                f"--tokenizer {tok.path} has no {text} token: image/video records need a GLM-5.3 "
                f"tokenizer (with {', '.join(MEDIA_TOKENS)})"
            )
        ids[text] = value
    return ids


class VLEncoder:
    """Records -> VLTokenDocs; `pixels(span)` -> that span's pixel rows."""

    def __init__(
        self, tok: TextTokenizer, images: ImageProcessor | None = None, videos: VideoProcessor | None = None
    ) -> None:
        self.tok, self.images, self.videos = tok, images or ImageProcessor(), videos or VideoProcessor()
        self.ids = media_token_ids(tok)
        self.template_renders_media = bool(tok.chat_template) and IMAGE_START in tok.chat_template

    # -------------------------------------------------------------------------------------------- media
    def span(self, media: Media, where: str) -> MediaSpan:
        """Decode one medium (checking it) and compute its grid; errors name `where` (FILE:LINE) and the field."""
        try:
            if media.kind == "image":
                pixels = load_image(media.path)
                h, w = self.images.canvas(*pixels.shape[:2])
                return MediaSpan(media, (1, h // self.images.patch_size, w // self.images.patch_size))
            grid, stamps, _, _ = self.videos.layout(self.videos.load(media.path, media.fps, media.path))
            return MediaSpan(media, grid, stamps)
        except InputError as e:  # MediaError, BudgetError: re-raised naming the record and the field
            raise DataError(f"{where}: {media.field}: {e}") from None

    def pixels(self, span: MediaSpan) -> torch.Tensor:
        """The pixel rows [t·h·w, C·T·P·P] of a span (decoded again)."""
        if span.kind == "image":
            rows, grid = self.images.process(load_image(span.media.path))
        else:
            rows, grid, _ = self.videos.process(self.videos.load(span.media.path, span.media.fps, span.media.path))
        if tuple(grid) != tuple(span.grid):
            raise DataError(
                f"{span.media.path}: changed on disk since the data was read (grid {tuple(grid)}, was "
                f"{tuple(span.grid)})"
            )
        return rows

    # ------------------------------------------------------------------------------------------- tokens
    def encode(self, doc: VLDocument | Document) -> VLTokenDoc:
        if isinstance(doc, Document):  # a text-only record of the same file
            from .tokenize import encode_document

            plain = encode_document(doc, self.tok)
            self._check_no_media_tokens(plain.ids, doc.where)
            return VLTokenDoc(plain.ids, plain.targets, plain.where)
        spans = [self.span(m, doc.where) for m in doc.media]
        rendered = Document(
            where=doc.where, messages=[{"role": m["role"], "content": self._content(m["parts"])} for m in doc.messages]
        )
        queue, ids, targets = list(spans), [], []
        for piece, trained in _pieces(rendered, self.tok):
            if isinstance(piece, list):
                ids += piece
                targets += [trained] * len(piece)
                continue
            for k, chunk in enumerate(_MARKERS.split(piece)):
                if k % 2:  # a marker
                    tokens = self._expand(chunk, queue, doc.where)
                    ids += tokens
                    targets += [False] * len(tokens)
                elif chunk:
                    tokens = self.tok.encode(chunk)
                    self._check_no_media_tokens(tokens, doc.where)
                    ids += tokens
                    targets += [trained] * len(tokens)
        if queue:
            raise DataError(
                f"{doc.where}: the chat template of {self.tok.path} wrote {len(spans) - len(queue)} media "
                f"markers for the record's {len(spans)} images/videos"
            )
        return VLTokenDoc(ids, targets, doc.where, spans)

    def _content(self, parts: list) -> str | list[dict]:
        if self.template_renders_media:
            return [{"type": "text", "text": p} if isinstance(p, str) else {"type": p.kind} for p in parts]
        return "".join(p if isinstance(p, str) else IMAGE_MARKER if p.kind == "image" else VIDEO_MARKER for p in parts)

    def _expand(self, marker: str, queue: list[MediaSpan], where: str) -> list[int]:
        kind = "image" if marker == IMAGE_MARKER else "video"
        if not queue or queue[0].kind != kind:
            got = queue[0].kind if queue else "nothing"
            raise DataError(
                f"{where}: the chat template of {self.tok.path} wrote a {kind} marker where the record "
                f"has {got} next (text that spells a media marker, or a template that reorders media)"
            )
        span = queue.pop(0)
        t, h, w = span.grid
        per_slice = h * w // self.images.merge_size**2
        ids = self.ids
        if kind == "image":
            return [ids[IMAGE_START]] + [ids[IMAGE]] * per_slice + [ids[IMAGE_END]]
        out = [ids[VIDEO_START]]
        for stamp in span.timestamps:
            out += [ids[IMAGE_START]] + [ids[IMAGE]] * per_slice + [ids[IMAGE_END]]
            out += self.tok.encode(f"{stamp:.1f} seconds")
        return out + [ids[VIDEO_END]]

    def _check_no_media_tokens(self, tokens: list[int], where: str) -> None:
        found = set(tokens) & set(self.ids.values())
        if found:
            name = next(t for t, i in self.ids.items() if i in found)
            raise DataError(
                f"{where}: the text holds the media token {name} outside an image/video item; media "
                f"go in 'images'/'videos' lists or content parts"
            )


__all__ = [
    "IMAGE_MARKER",
    "MEDIA_TOKENS",
    "VIDEO_MARKER",
    "MediaSpan",
    "VLEncoder",
    "VLTokenDoc",
    "media_token_ids",
]
