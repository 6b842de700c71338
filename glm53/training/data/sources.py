"""Where --data documents come from: files, shard directories, parquet, `datasets` datasets, and mixtures.

Legend: no tensors (records; tokenize.py and pack.py make the token rows).
    FILE.txt / FILE.jsonl      documents.py
    FILE.parquet               one record per row (pyarrow), the .jsonl record rules; null columns are absent keys
    DIR                        a `datasets` dataset saved with save_to_disk (its "train" split when it holds a
                               DatasetDict), else every .txt / .jsonl / .parquet file directly in DIR, by name
    hf:NAME[:SPLIT]            datasets.load_dataset(NAME, split=SPLIT or "train") from local files only
    A:0.7,B:0.3                a mixture: rows drawn from each source in proportion to its weight (pack.Mixer)
Records name their place as FILE:LINE or SOURCE:row N in every error.
"""

from __future__ import annotations

import hashlib
import os

from .documents import DataError, ReadReport, _document, read_documents

SHARD_EXTENSIONS = (".txt", ".jsonl", ".parquet")
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """'A:0.7,B:0.3' -> [(A, 0.7), (B, 0.3)] (weights normalised to sum 1); a plain source -> [(it, 1.0)]."""
    parts = [p for p in spec.split(",")] if "," in spec else [spec]
    out = []
    for part in parts:
        source, weight = part, None
        head, sep, tail = part.rpartition(":")
        if sep and head:
            try:
                weight = float(tail)
                source = head
            except ValueError:
                weight = None
        if weight is None and len(parts) > 1:
            raise DataError(f"--data {spec}: {part!r} has no weight (mix sources as A:0.7,B:0.3)")
        if weight is not None and not (weight > 0 and weight < float("inf")):
            raise DataError(f"--data {spec}: the weight of {source!r} must be a positive number, got {tail!r}")
        if not source:
            raise DataError(f"--data {spec}: an empty source name")
        out.append((source, 1.0 if weight is None else weight))
    names = [s for s, _ in out]
    if len(set(names)) != len(names):
        raise DataError(f"--data {spec}: a source is listed twice")
    total = sum(w for _, w in out)
    return [(s, w / total) for s, w in out]


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("reading a `datasets` dataset needs the datasets package: pip install 'glm53[data]'") from None
    return datasets


def _records(rows, where: str) -> ReadReport:
    report = ReadReport()
    for i, row in enumerate(rows):
        record = {k: v for k, v in dict(row).items() if v is not None} if isinstance(row, dict) else row
        doc = _document(record, f"{where}:row {i}")
        if doc is None:
            report.empty += 1
        else:
            report.documents.append(doc)
    return report


def _parquet(path: str) -> ReadReport:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"--data {path}: reading parquet needs pyarrow: pip install 'glm53[data]'") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise DataError(f"--data {path}: cannot be read as parquet ({type(e).__name__}: {e})") from None
    return _records(table.to_pylist(), path)


def _dataset(dataset, where: str) -> ReadReport:
    datasets = _datasets()
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise DataError(
                f"--data {where}: a DatasetDict without a 'train' split (splits: {sorted(dataset)}); use hf:NAME:SPLIT"
            )
        dataset = dataset["train"]
    return _records(dataset, where)


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, m)) for m in DATASET_MARKERS)


def shards(path: str) -> list[str]:
    return sorted(
        os.path.join(path, n)
        for n in os.listdir(path)
        if n.lower().endswith(SHARD_EXTENSIONS) and os.path.isfile(os.path.join(path, n))
    )


def read_source(path: str) -> ReadReport:
    """The documents of one source (module docstring), in a fixed order."""
    if path.startswith("hf:"):
        name, _, split = path[3:].partition(":")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files and caches only: nothing is downloaded
        try:
            dataset = _datasets().load_dataset(name, split=split or "train")
        except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError)
            raise DataError(f"--data {path}: datasets.load_dataset({name!r}) failed: {type(e).__name__}: {e}") from None
        return _dataset(dataset, path)
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            try:
                dataset = _datasets().load_from_disk(path)
            except Exception as e:
                raise DataError(f"--data {path}: datasets.load_from_disk failed: {type(e).__name__}: {e}") from None
            return _dataset(dataset, path)
        files = shards(path)
        if not files:
            raise DataError(
                f"--data {path}: a directory without {', '.join(SHARD_EXTENSIONS)} shards or a saved dataset"
            )
        report = ReadReport()
        for file in files:
            part = read_source(file)
            report.documents += part.documents
            report.empty += part.empty
        return report
    if path.lower().endswith(".parquet"):
        if not os.path.isfile(path):
            raise DataError(f"--data {path}: no such file")
        return _parquet(path)
    return read_documents(path)


def _file_digest(h, path: str) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def source_digest(path: str) -> str:
    """sha256 of a source's bytes (a directory: every file under it, by relative name; hf: the spec and the
    dataset's fingerprint)."""
    h = hashlib.sha256()
    if path.startswith("hf:"):
        name, _, split = path[3:].partition(":")
        dataset = _datasets().load_dataset(name, split=split or "train")
        h.update(f"{path}\0{getattr(dataset, '_fingerprint', '')}".encode())
    elif os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                h.update(os.path.relpath(full, path).encode() + b"\0")
                _file_digest(h, full)
    else:
        _file_digest(h, path)
    return h.hexdigest()


__all__ = ["parse_mixture", "read_source", "shards", "source_digest"]
