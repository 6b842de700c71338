"""Read vision-language SFT records from .jsonl: both conventions users bring, media paths under a root.

Legend: no tensors (records, strings and paths; vl_tokenize.py makes the token ids and media grids).
A record is a VL record when it has "images"/"videos" lists or a message whose content is a list of parts;
any other line is read by documents.py (text, messages, prompt/completion), so one file mixes both.
- transformers / OpenAI content lists: {"messages": [{"role", "content": [part, ...]}]} with parts
  {"type": "text", "text": str}, {"type": "image", "image": PATH}, {"type": "image_url", "image_url": {"url": PATH}},
  {"type": "video", "video": PATH, "fps": number (optional)}, {"type": "video_url", "video_url": {"url": PATH}}.
- LLaMA-Factory / ShareGPT: {"messages": [{"role", "content": str}], "images": [PATH], "videos": [PATH or
  {"path": PATH, "fps": number}]} with one "<image>" / "<video>" placeholder per item, in order (also
  "conversations" with "from"/"value", ShareGPT's names: human, gpt, system).
Paths: relative ones are resolved under the media root; every path must stay inside it after resolving links
(an escape is an error naming the record and field). A "file://" prefix is dropped; remote URLs are refused (no
downloads). A video path is a folder of extracted frames or a video file (vision/video_processing.py).
Every error names FILE:LINE and the field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from .documents import ROLES, DataError, Document, _document

IMAGE_PLACEHOLDER = "<image>"  # LLaMA-Factory's placeholders, one per listed item
VIDEO_PLACEHOLDER = "<video>"
SHAREGPT_ROLES = {
    "human": "user",
    "gpt": "assistant",
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
}
PART_TYPES = ("text", "image", "image_url", "video", "video_url")


@dataclass
class Media:
    """One image or video of a record, in placeholder order."""

    kind: str  # "image" or "video"
    path: str  # resolved, inside the media root
    field: str  # where the record names it, e.g. "messages[0].content[1].image" or "images[2]"
    fps: float | None = None  # a video's frame rate when the record gives one (a frames folder needs it)


@dataclass
class VLDocument:
    """A conversation whose messages are lists of parts: str (text) or Media, in order."""

    where: str  # FILE:LINE
    messages: list[dict] = field(default_factory=list)  # {"role": str, "parts": [str | Media, ...]}

    @property
    def media(self) -> list[Media]:
        return [p for m in self.messages for p in m["parts"] if isinstance(p, Media)]


def read_vl_records(path: str, media_root: str | None = None) -> tuple[list[Document | VLDocument], int]:
    """(documents in file order, empty text records skipped). VL records become VLDocuments, the rest
    Documents (documents.py's rules). `media_root` defaults to the data file's directory."""
    if not os.path.isfile(path):
        raise DataError(f"--data {path}: no such file")
    if os.path.splitext(path)[1].lower() != ".jsonl":
        raise DataError(f"--data {path}: image and video records need a .jsonl file (one JSON object per line)")
    root = os.path.realpath(media_root if media_root is not None else os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(root):
        raise DataError(f"--media-root {media_root}: not a directory")
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.read().splitlines()
        except UnicodeDecodeError as e:
            raise DataError(f"--data {path}: not UTF-8 text ({e})") from None
    if not any(line.strip() for line in lines):
        raise DataError(f"--data {path}: the file is empty (no documents)")
    docs, empty = [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        doc = vl_document(record, where, root) if _is_vl(record) else _document(record, where)
        if doc is None:
            empty += 1
        else:
            docs.append(doc)
    return docs, empty


def _is_vl(record: object) -> bool:
    if not isinstance(record, dict):
        return False
    if "images" in record or "videos" in record or "conversations" in record:
        return True
    messages = record.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages
    )


def vl_document(record: dict, where: str, root: str) -> VLDocument:
    """One VL record -> a VLDocument, validated (see the module docstring)."""
    key = "messages" if "messages" in record else "conversations"
    messages = record.get(key)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {key!r} must be a non-empty list of messages")
    listed = "images" in record or "videos" in record
    doc = VLDocument(where)
    for i, m in enumerate(messages):
        role, content = _role_and_content(m, key, i, where)
        if isinstance(content, list):
            if listed:
                raise DataError(
                    f"{where}: {key}[{i}].content is a list of parts while the record also has "
                    f"'images'/'videos' lists; use one convention per record"
                )
            parts = [_part(p, f"{key}[{i}].content[{j}]", where, root) for j, p in enumerate(content)]
        elif isinstance(content, str):
            parts = [content]
        else:
            raise DataError(
                f"{where}: {key}[{i}].content must be a string or a list of parts, got {type(content).__name__}"
            )
        doc.messages.append({"role": role, "parts": parts})
    if listed:
        _place_listed(doc, record, key, where, root)
    return doc


def _role_and_content(m: object, key: str, i: int, where: str) -> tuple[str, object]:
    if not isinstance(m, dict):
        raise DataError(f"{where}: {key}[{i}] must be an object, got {type(m).__name__}")
    if key == "conversations":
        role, content, role_field = SHAREGPT_ROLES.get(m.get("from")), m.get("value"), "from"
        if role is None:
            raise DataError(
                f"{where}: {key}[{i}].from is {m.get('from')!r}; expected one of {', '.join(SHAREGPT_ROLES)}"
            )
    else:
        role, content, role_field = m.get("role"), m.get("content"), "role"
        if role not in ROLES:
            raise DataError(f"{where}: {key}[{i}].{role_field} is {role!r}; expected one of {', '.join(ROLES)}")
    return role, content


def _part(part: object, name: str, where: str, root: str) -> str | Media:
    if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
        got = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise DataError(f"{where}: {name} must be an object with 'type' one of {', '.join(PART_TYPES)}, got {got!r}")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise DataError(f"{where}: {name}.text must be a string, got {type(part.get('text')).__name__}")
        return part["text"]
    base = kind.removesuffix("_url")
    value, fname = part.get(kind), f"{name}.{kind}"
    if kind.endswith("_url") and isinstance(value, dict):
        value, fname = value.get("url"), f"{fname}.url"
    fps = _fps(part.get("fps"), f"{name}.fps", where) if base == "video" else None
    return Media(base, resolve_media(value, root, where, fname), fname, fps)


def _fps(value: object, name: str, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise DataError(f"{where}: {name} must be a positive number (frames per second), got {value!r}")
    return float(value)


def _place_listed(doc: VLDocument, record: dict, key: str, where: str, root: str) -> None:
    """Replace LLaMA-Factory placeholders in the messages' text by the listed media, in order."""
    lists = {}
    for name, kind in (("images", "image"), ("videos", "video")):
        items = record.get(name, [])
        if not isinstance(items, list):
            raise DataError(f"{where}: {name!r} must be a list of paths, got {type(items).__name__}")
        lists[kind] = [_listed(item, f"{name}[{k}]", kind, where, root) for k, item in enumerate(items)]
    counts = {
        kind: sum(p.count(ph) for m in doc.messages for p in m["parts"])
        for kind, ph in (("image", IMAGE_PLACEHOLDER), ("video", VIDEO_PLACEHOLDER))
    }
    for kind, ph in (("image", IMAGE_PLACEHOLDER), ("video", VIDEO_PLACEHOLDER)):
        if counts[kind] != len(lists[kind]):
            raise DataError(
                f"{where}: {kind}s: the record lists {len(lists[kind])} {kind}s but its {key} hold "
                f"{counts[kind]} {ph} placeholders (one per item, in order)"
            )
    queues = {kind: iter(items) for kind, items in lists.items()}
    for m in doc.messages:
        m["parts"] = _split_placeholders(m["parts"][0], queues)


def _split_placeholders(text: str, queues: dict) -> list[str | Media]:
    parts, rest = [], text
    while True:
        hits = [
            (rest.find(ph), kind, ph)
            for kind, ph in (("image", IMAGE_PLACEHOLDER), ("video", VIDEO_PLACEHOLDER))
            if ph in rest
        ]
        if not hits:
            break
        at, kind, ph = min(hits)
        if at:
            parts.append(rest[:at])
        parts.append(next(queues[kind]))
        rest = rest[at + len(ph) :]
    if rest or not parts:
        parts.append(rest)
    return parts


def _listed(item: object, name: str, kind: str, where: str, root: str) -> Media:
    fps = None
    if kind == "video" and isinstance(item, dict):
        fps, item, name = _fps(item.get("fps"), f"{name}.fps", where), item.get("path"), f"{name}.path"
    return Media(kind, resolve_media(item, root, where, name), name, fps)


def resolve_media(value: object, root: str, where: str, name: str) -> str:
    """A record's media path -> an absolute path inside `root` (links resolved); anything else a DataError."""
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: {name} must be a non-empty path string, got {value!r}")
    if value.startswith(("http://", "https://", "data:")):
        raise DataError(
            f"{where}: {name} is a URL ({value[:40]}); glm53 reads local files only: download it under "
            f"--media-root and give its path"
        )
    path = value.removeprefix("file://")
    real = os.path.realpath(os.path.join(root, path))  # an absolute path stays itself
    if os.path.commonpath([real, root]) != root:
        raise DataError(f"{where}: {name} {value!r} resolves to {real}, outside --media-root {root}")
    return real


__all__ = [
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "Media",
    "VLDocument",
    "read_vl_records",
    "resolve_media",
    "vl_document",
]
