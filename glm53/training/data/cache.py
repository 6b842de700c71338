"""Tokenize a --data source once: the token documents cached under --cache-dir (default: DIR/cache of --save).

Legend: flat tensors in the file (ids int32 [N], targets bool [N], lengths int64 [D]); TokenDoc lists outside.
The cache file is named by the sha256 of the source's bytes, the tokenizer's files and CACHE_VERSION, so another
file, tokenizer or tokenization rule never reads a stale cache. Under torchrun rank 0 tokenizes (in batches on every core: tokenize.encode_documents) and writes it
(a temporary file renamed into place) while the others wait at a barrier, then read it; a resume finds it too.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import torch

from .documents import DataError
from .sources import read_source, source_digest
from .tokenize import TextTokenizer, TokenDoc, encode_documents

CACHE_VERSION = "glm53-tokens-1"  # change when tokenize.py's output for the same input changes


def tokenizer_digest(tok: TextTokenizer) -> str:
    """sha256 of the files the tokenizer writes (tok.save): the same tokenizer read from its source directory or
    from a checkpoint that copied it has one digest."""
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="glm53-tokenizer-") as tmp:
        tok.save(tmp)
        for name in sorted(os.listdir(tmp)):
            h.update(name.encode() + b"\0")
            with open(os.path.join(tmp, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def tokenize_source(path: str, tok: TextTokenizer) -> tuple[list[TokenDoc], int]:
    """(token documents, records without text) of one source, tokenized here (batched over every core)."""
    read = read_source(path)
    return encode_documents(read.documents, tok), read.empty


def _pack(docs: list[TokenDoc], empty: int) -> dict:
    return {
        "version": CACHE_VERSION,
        "empty": empty,
        "where": [d.where for d in docs],
        "lengths": torch.tensor([len(d.ids) for d in docs], dtype=torch.long),
        "ids": torch.tensor([i for d in docs for i in d.ids], dtype=torch.int32),
        "targets": torch.tensor([t for d in docs for t in d.targets], dtype=torch.bool),
    }


def _unpack(state: dict, file: str) -> tuple[list[TokenDoc], int]:
    try:
        ids, targets, lengths = state["ids"].tolist(), state["targets"].tolist(), state["lengths"].tolist()
        where, empty = state["where"], int(state["empty"])
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{file}: not a glm53 token cache (missing {e}); delete it") from None
    docs, at = [], 0
    for n, w in zip(lengths, where):
        docs.append(TokenDoc(ids[at : at + n], targets[at : at + n], w))
        at += n
    return docs, empty


def cached_tokens(path: str, tok: TextTokenizer, cache_dir: str | None, par=None) -> tuple[list[TokenDoc], int, str]:
    """(token documents, empty records, how they were obtained: 'tokenized' / 'cache FILE')."""
    if cache_dir is None:
        return (*tokenize_source(path, tok), "tokenized")
    key = hashlib.sha256(f"{source_digest(path)}\0{tokenizer_digest(tok)}\0{CACHE_VERSION}".encode()).hexdigest()
    file = os.path.join(cache_dir, f"tokens-{key[:24]}.pt")
    rank0 = par is None or par.rank() == 0
    built = False
    if rank0 and not os.path.isfile(file):
        docs, empty = tokenize_source(path, tok)
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{file}.tmp-{os.getpid()}"
        torch.save(_pack(docs, empty), tmp)
        os.replace(tmp, file)
        built = True
    if par is not None:
        par.barrier()
    if built:
        return docs, empty, f"tokenized, cached in {file}"
    try:
        state = torch.load(file, weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise DataError(f"{file}: the token cache cannot be read ({type(e).__name__}: {e}); delete it") from None
    return (*_unpack(state, file), f"read from the cache {file}")


__all__ = ["CACHE_VERSION", "cached_tokens", "tokenize_source", "tokenizer_digest"]
