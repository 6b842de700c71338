"""Read fine-tuning documents from a file, validating every record (errors name the file and line).

Legend: no tensors (records and strings; tokenize.py and pack.py make the token rows).

    .txt    one document per block of lines separated by blank lines (loss on every token)
    .jsonl  one JSON object per line, either
              {"text": str}                                   pretraining-style, loss on every token
              {"messages": [{"role": str, "content": str}, ...]}   SFT, loss on the assistant messages only
              {"prompt": str, "completion": str}              SFT, loss on the completion only
Blank lines in a .jsonl file are allowed and ignored. A document with no text (an empty "text", a whitespace-only
block) is not an error but is skipped, counted and reported (tokenize.py counts what else is skipped).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant", "tool")  # chat roles accepted in "messages"; loss on "assistant" only
TRAINED_ROLE = "assistant"


@dataclass
class Document:
    """One record: `text`, or chat `messages` (prompt/completion become a user and an assistant message)."""

    where: str  # "FILE:LINE" of the record (of its first line for .txt), for messages about it
    text: str | None = None
    messages: list[dict] | None = None
    plain_prompt: bool = False  # came as prompt/completion (formatted without a chat template as prompt+completion)


@dataclass
class ReadReport:
    documents: list[Document] = field(default_factory=list)
    empty: int = 0  # records without any text, skipped


class DataError(ValueError):
    """A bad data file or record; the message names the file and line."""


def read_documents(path: str) -> ReadReport:
    """All documents of a .txt or .jsonl file, in file order."""
    if not os.path.isfile(path):
        raise DataError(f"--data {path}: no such file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".txt", ".jsonl"):
        raise DataError(
            f"--data {path}: unknown format {ext or '(no extension)'}; use .txt (documents separated "
            f"by blank lines) or .jsonl (one JSON object per line)"
        )
    # utf-8-sig: a byte-order mark is not text. Lines end only at \n (\r\n and \r are read as \n): a form
    # feed or U+2028 inside a document is content, not a line break as str.splitlines would make it.
    with open(path, encoding="utf-8-sig") as f:
        try:
            lines = f.read().split("\n")
        except UnicodeDecodeError as e:
            raise DataError(f"--data {path}: not UTF-8 text ({e})") from None
    if not any(line.strip() for line in lines):
        raise DataError(f"--data {path}: the file is empty (no documents)")
    return _read_txt(path, lines) if ext == ".txt" else _read_jsonl(path, lines)


def _read_txt(path: str, lines: list[str]) -> ReadReport:
    report, block, start = ReadReport(), [], 0
    for number, line in enumerate([*lines, ""], start=1):
        if line.strip():
            if not block:
                start = number
            block.append(line)
        elif block:
            report.documents.append(Document(where=f"{path}:{start}", text="\n".join(block)))
            block = []
    return report


def _read_jsonl(path: str, lines: list[str]) -> ReadReport:
    report = ReadReport()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        doc = _document(record, where)
        if doc is None:
            report.empty += 1
        else:
            report.documents.append(doc)
    return report


def _string(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def _document(record: object, where: str) -> Document | None:
    """One validated JSONL record -> a Document (None when it holds no text at all)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    kinds = [k for k in ("text", "messages", "prompt") if k in record or (k == "prompt" and "completion" in record)]
    if len(kinds) > 1:
        raise DataError(
            f"{where}: the record has both {kinds[0]!r} and {kinds[1]!r}; one record is one kind of "
            f"document (split it into two records)"
        )
    if "text" in record:
        text = _string(record, "text", where)
        return Document(where=where, text=text) if text.strip() else None
    if "messages" in record:
        return Document(where=where, messages=_messages(record["messages"], where))
    if "prompt" in record or "completion" in record:
        missing = [k for k in ("prompt", "completion") if k not in record]
        if missing:
            raise DataError(f"{where}: a prompt/completion record needs both fields; {missing[0]!r} is missing")
        messages = [
            {"role": "user", "content": _string(record, "prompt", where)},
            {"role": TRAINED_ROLE, "content": _string(record, "completion", where)},
        ]
        return Document(where=where, messages=messages, plain_prompt=True)
    raise DataError(
        f"{where}: the record has neither 'text' nor 'messages' nor 'prompt'/'completion' (keys: {sorted(record)})"
    )


OPTIONAL_MESSAGE_KEYS = ("tool_calls", "reasoning_content", "name", "tool_call_id")  # passed to the chat template


def _messages(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] must be an object with string 'role' and 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{i}] has role {m['role']!r}; expected one of {', '.join(ROLES)}")
    out = []
    for i, m in enumerate(messages):
        extra = sorted(set(m) - {"role", "content", *OPTIONAL_MESSAGE_KEYS})
        if extra:
            raise DataError(
                f"{where}: messages[{i}] has unknown key {extra[0]!r}; known: role, content, "
                f"{', '.join(OPTIONAL_MESSAGE_KEYS)}"
            )
        out.append({k: m[k] for k in ("role", "content", *OPTIONAL_MESSAGE_KEYS) if k in m and m[k] is not None})
    return out


__all__ = ["DataError", "Document", "ReadReport", "ROLES", "TRAINED_ROLE", "read_documents"]
