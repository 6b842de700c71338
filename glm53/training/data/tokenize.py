"""Tokenise fine-tuning documents: token ids plus which of them are loss targets.

Legend: token lists, no tensors (pack.py makes the [B, T] rows).
The tokenizer comes from a directory: `transformers.AutoTokenizer` when it holds a tokenizer_config.json (chat
template, end-of-sequence token), else a bare `tokenizers` tokenizer.json (no chat template, no EOS).
- text: every token is a target, then EOS (when the tokenizer has one).
- messages / prompt+completion: with a chat template, the conversation is rendered turn by turn and only the
  assistant turns' tokens (after the generation prompt) are targets; without one, each message is written as
  "role: content\n" (a prompt/completion pair as prompt then completion) and only the assistant content and
  the EOS after it are targets.
Each rendered piece is tokenised on its own, so the target boundary never falls inside a token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .documents import TRAINED_ROLE, DataError, Document

HF_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"
ENCODE_BATCH = 4096  # texts per batch call: all cores busy, the batch's encodings bounded in memory


class TextTokenizer:
    """The few things the data pipeline needs from either kind of tokenizer."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isdir(path):
            raise DataError(f"--tokenizer {path}: not a directory")
        if os.path.isfile(os.path.join(path, HF_CONFIG)):
            try:
                from transformers import AutoTokenizer  # only for tokenizer directories written by transformers
            except ImportError:
                raise DataError(
                    f"--tokenizer {path}: a transformers tokenizer directory needs transformers: "
                    f"pip install 'glm53[data]'"
                ) from None

            try:
                self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except (OSError, ValueError) as e:  # re-raised with the flag and directory named
                raise DataError(f"--tokenizer {path}: transformers.AutoTokenizer cannot load it ({e})") from e
            self.raw = None
            self.eos_id = self.hf.eos_token_id
            self.pad_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id
            self.vocab_size = len(self.hf)
            self.chat_template = getattr(self.hf, "chat_template", None)
        elif os.path.isfile(os.path.join(path, TOKENIZER_JSON)):
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise DataError(
                    f"--tokenizer {path}: needs the tokenizers package: pip install 'glm53[data]'"
                ) from None

            try:
                self.hf, self.raw = None, Tokenizer.from_file(os.path.join(path, TOKENIZER_JSON))
            except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
                raise DataError(f"--tokenizer {path}: {TOKENIZER_JSON} cannot be read ({e})") from e
            self.eos_id = self.pad_id = None
            self.vocab_size = self.raw.get_vocab_size(with_added_tokens=True)
            self.chat_template = None
        else:
            raise DataError(
                f"--tokenizer {path}: no tokenizer there (neither {HF_CONFIG} nor {TOKENIZER_JSON}); "
                f"pass --tokenizer DIR with the checkpoint's tokenizer files"
            )

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added. A `tokenizers` tokenizer (and a transformers "fast"
        one, which wraps it) encodes a batch on every core (its Rust thread pool; TOKENIZERS_PARALLELISM=false
        or RAYON_NUM_THREADS=N limits it); a slow transformers tokenizer encodes one text at a time."""
        out: list[list[int]] = [[] for _ in texts]
        todo = [i for i, t in enumerate(texts) if t]
        for start in range(0, len(todo), ENCODE_BATCH):
            part = todo[start : start + ENCODE_BATCH]
            batch = [texts[i] for i in part]
            if self.raw is not None:
                ids = [e.ids for e in self.raw.encode_batch(batch, add_special_tokens=False)]
            elif getattr(self.hf, "is_fast", False):
                ids = self.hf(batch, add_special_tokens=False)["input_ids"]
            else:
                ids = [self.hf.encode(t, add_special_tokens=False) for t in batch]
            for i, row in zip(part, ids, strict=True):
                out[i] = list(row)
        return out

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2 raises its own types (TemplateError, UndefinedError, TypeError, ...)
            raise DataError(
                f"the chat template of {self.path} raised on a conversation of {len(messages)} "
                f"messages: {type(e).__name__}: {e}"
            ) from e

    def save(self, path: str) -> None:
        """Write the tokenizer files into checkpoint directory `path` (a resumed run finds them there)."""
        if self.raw is not None:
            self.raw.save(os.path.join(path, TOKENIZER_JSON))
        else:
            self.hf.save_pretrained(path)


@dataclass
class TokenDoc:
    ids: list[int]
    targets: list[bool]  # per token: is it a loss target
    where: str  # FILE:LINE


def encode_document(doc: Document, tok: TextTokenizer) -> TokenDoc:
    return encode_documents([doc], tok)[0]


def encode_documents(docs: list[Document], tok: TextTokenizer) -> list[TokenDoc]:
    """Every document's pieces rendered first (the chat template, in Python), then all their texts tokenised in
    batch calls (on every core, TextTokenizer.encode_batch), then reassembled in order."""
    pieces = [_pieces(d, tok) for d in docs]
    texts = [piece for ps in pieces for piece, _ in ps if not isinstance(piece, list)]
    encoded = iter(tok.encode_batch(texts))
    out = []
    for doc, ps in zip(docs, pieces, strict=True):
        ids, targets = [], []
        for piece, trained in ps:
            tokens = piece if isinstance(piece, list) else next(encoded)
            ids += tokens
            targets += [trained] * len(tokens)
        out.append(TokenDoc(ids, targets, doc.where))
    return out


RENDERED_KEYS = ("tool_calls", "reasoning_content")  # message keys that must reach the rendered text


def _check_rendered(doc: Document, tok: TextTokenizer, pieces: list[tuple[str, bool]]) -> None:
    """Every reasoning_content and tool call of the conversation appears in its rendering, or DataError: a
    template that drops them would train on a conversation without them, silently."""
    text = "".join(p for p, _ in pieces)
    for i, m in enumerate(doc.messages):
        wanted = []
        if m.get("reasoning_content"):
            wanted.append(("reasoning_content", str(m["reasoning_content"])))
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            wanted.append(("tool_calls", str(fn.get("name", "")) if isinstance(fn, dict) else ""))
        for key, needle in wanted:
            if needle and needle not in text:
                raise DataError(
                    f"{doc.where}: the chat template of {tok.path} does not render messages[{i}]'s "
                    f"{key!r}; training would drop it silently (use a template that renders it)"
                )


def _pieces(doc: Document, tok: TextTokenizer) -> list[tuple[str | list[int], bool]]:
    """(text or token ids, trained) in document order."""
    eos = [[tok.eos_id]] if tok.eos_id is not None else []
    if doc.text is not None:
        return [(doc.text, True), *((e, True) for e in eos)]
    if tok.chat_template:
        try:
            pieces = _chat_pieces(doc, tok)
        except DataError as e:
            raise e if str(e).startswith(doc.where) else DataError(f"{doc.where}: {e}") from e
        _check_rendered(doc, tok, pieces)
        return pieces
    for i, m in enumerate(doc.messages):
        key = next((k for k in RENDERED_KEYS if m.get(k)), None)
        if key:
            raise DataError(
                f"{doc.where}: messages[{i}] has {key!r}, which only a chat template can render; "
                f"{tok.path} has none (pass --tokenizer DIR with a chat_template)"
            )
    out = []
    for m in doc.messages:
        trained = m["role"] == TRAINED_ROLE
        if doc.plain_prompt:  # prompt then completion, as the raw texts
            out.append((m["content"], trained))
        else:
            out += [(f"{m['role']}: ", False), (m["content"] + ("" if trained else "\n"), trained)]
        if trained:
            out += [(e, True) for e in eos] or [("\n", True)]
    return out


def _chat_pieces(doc: Document, tok: TextTokenizer) -> list[tuple[str, bool]]:
    """Render the conversation turn by turn; each turn's new text is a piece (assistant turns: trained after
    the generation prompt). A template whose renders are not prefixes of each other cannot be split so."""
    out, before = [], ""
    for i, m in enumerate(doc.messages):
        after = tok.render(doc.messages[: i + 1], add_generation_prompt=False)
        if m["role"] == TRAINED_ROLE:
            prompt = tok.render(doc.messages[:i], add_generation_prompt=True) if i else before
            _check_prefix(before, prompt, doc, tok)
            _check_prefix(prompt, after, doc, tok)
            out += [(prompt[len(before) :], False), (after[len(prompt) :], True)]
        else:
            _check_prefix(before, after, doc, tok)
            out.append((after[len(before) :], False))
        before = after
    return out


def _check_prefix(prefix: str, text: str, doc: Document, tok: TextTokenizer) -> None:
    if not text.startswith(prefix):
        raise DataError(
            f"{doc.where}: the chat template of {tok.path} renders this conversation differently as it "
            f"grows (an earlier turn changes), so the assistant tokens cannot be told apart"
        )


__all__ = ["TextTokenizer", "TokenDoc", "encode_document", "encode_documents"]
