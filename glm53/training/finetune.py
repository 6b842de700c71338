"""Fine-tuning a checkpoint on a data file: `glm53 train --init CHECKPOINT_DIR --data FILE [--tokenizer DIR]`.

Legend: B batch (rows per micro-batch), T time (--seq-len).
The flags and their checks, the model's initial weights (`init_model`), and `FileData`, the trainer's data
source for --data: read (data/documents.py), tokenise (data/tokenize.py), pack (data/pack.py). Every
data-parallel rank packs the same global stream and takes its own rows of each step, so the data position is one
cursor, identical on every rank, saved in the trainer state.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os

import torch

from ..losses import IGNORE_INDEX, Glm53ForCausalLM
from .args import nonempty_path, positive_int
from .data.cache import cached_tokens, tokenizer_digest
from .data.documents import DataError
from .data.pack import Batch, Mixer, Packer
from .data.sources import parse_mixture, read_source, source_digest
from .data.tokenize import TextTokenizer, encode_documents


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--init",
        metavar="CHECKPOINT_DIR",
        type=nonempty_path,
        help="start from this official-layout checkpoint (with --data when it holds a tokenizer)",
    )
    p.add_argument(
        "--data",
        metavar="FILE",
        type=nonempty_path,
        help=".txt (blank-line-separated documents), .jsonl ({'text'}, {'messages'} or {'prompt', "
        "'completion'} per line), .parquet, a directory of shards or a saved `datasets` dataset, "
        "hf:NAME[:SPLIT] (datasets.load_dataset, local); A:0.7,B:0.3 mixes sources by weight",
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", type=nonempty_path, help="tokenizer directory (default: --init, or --resume)"
    )
    p.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        metavar="N",
        help="micro-batches of --batch-size rows per optimizer step, one loss over all of them",
    )


def check_args(args: argparse.Namespace) -> None:
    """Flag combinations argparse cannot check (a usage error, before any work)."""
    if args.init and args.resume:
        raise SystemExit("--init and --resume exclude each other: --resume already holds the model")
    if args.tokenizer and not args.data:
        raise SystemExit("--tokenizer needs --data FILE")
    if args.init and not args.data and _has_tokenizer(args.init):
        # a checkpoint with its own tokenizer was trained on its tokens: byte ids would be other tokens to it
        raise SystemExit(
            f"--init {args.init} has a tokenizer: it needs --data FILE (the built-in corpus is byte "
            f"ids, not this checkpoint's tokens)"
        )
    if args.data and not (args.init or args.resume):
        raise SystemExit("--data needs --init CHECKPOINT_DIR (or --resume of a run that used --data)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _has_tokenizer(path: str) -> bool:
    return any(os.path.lexists(os.path.join(path, name)) for name in TOKENIZER_FILES)


def init_model(path: str) -> Glm53ForCausalLM:
    """The model --init starts from (one process, full weights)."""
    return Glm53ForCausalLM.from_pretrained(path)


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_inputs(model: Glm53ForCausalLM, batch: Batch) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments for a packed micro-batch. Its position_ids (restarting at each document)
    go only to a forward that takes them (packed documents); otherwise each row's documents are one sequence."""
    inputs = dict(input_ids=batch.input_ids, labels=batch.labels, attention_mask=batch.attention_mask)
    if "position_ids" in inspect.signature(model.forward).parameters:
        inputs["position_ids"] = batch.position_ids
    return inputs


@torch.no_grad()
def heldout_loss(model: Glm53ForCausalLM, path: str, tokenizer_dir: str, seq_len: int, batch_size: int = 8) -> float:
    """The next-token loss (mean over every target token) of `model` on every document of data file `path`,
    packed as for training (eval mode: no expert-load counting)."""
    tokenizer = TextTokenizer(tokenizer_dir)
    docs = encode_documents(read_source(path).documents, tokenizer)
    packer = Packer([d for d in docs if any(d.targets[1:])], seq_len, 0, tokenizer.pad_id or 0)
    rows = []
    while packer.epoch == 0:
        rows.append(packer.row())
    batches = [
        Batch(*(torch.tensor(c, dtype=torch.long) for c in zip(*rows[i : i + batch_size])))
        for i in range(0, len(rows), batch_size)
    ]
    inputs = [model_inputs(model, b) for b in batches]
    counts = [model.loss_counts(i["labels"], i["attention_mask"], i.get("position_ids")) for i in inputs]
    den = sum(counts[1:], counts[0])
    was_training = model.training
    model.eval()
    total = sum(model(**i, loss_denominators=den, return_logits=False).lm_loss for i in inputs)
    model.train(was_training)
    return float(total)


def eval_batches(
    path: str, tokenizer: TextTokenizer, seq_len: int, batch_size: int, dp: int, dp_rank: int
) -> list[Batch]:
    """Every document of held-out file `path` packed once into rows (as heldout_loss packs them); data rank `dp_rank` of `dp` takes
    rows dp_rank, dp_rank + dp, ...; a rank left without rows gets one row of padding (no targets), so every rank
    runs the same forwards."""
    docs = encode_documents(read_source(path).documents, tokenizer)
    docs = [d for d in docs if any(d.targets[1:])]
    if not docs:
        raise DataError(f"--eval-data {path}: no document has a token to evaluate")
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    packer, rows = Packer(docs, seq_len, 0, pad), []  # seed 0: the order heldout_loss packs in
    while packer.epoch == 0:
        rows.append(packer.row())
    mine = rows[dp_rank::dp] or [([pad] * seq_len, [IGNORE_INDEX] * seq_len, [0] * seq_len, list(range(seq_len)))]
    return [
        Batch(*(torch.tensor(c, dtype=torch.long) for c in zip(*mine[i : i + batch_size])))
        for i in range(0, len(mine), batch_size)
    ]


MIX_SEED_STRIDE = 1_000_000_007  # the packing seed of mixture source i: --seed + i * this


class FileData:
    """Packed rows from --data; `next_step` -> this rank's micro-batches of one optimizer step."""

    def __init__(
        self,
        args: argparse.Namespace,
        tokenizer_dir: str,
        vocab_size: int,
        pad_id: int,
        dp: int,
        dp_rank: int,
        par=None,
    ) -> None:
        self.path, self.dp, self.dp_rank = args.data, dp, dp_rank
        self.batch_size, self.grad_accum = args.batch_size, args.grad_accum
        self.tokenizer = TextTokenizer(tokenizer_dir)
        cache_dir = getattr(args, "cache_dir", None) or (
            os.path.join(args.save, "cache") if getattr(args, "save", None) else None
        )
        self.sources = parse_mixture(args.data)
        self.skipped = {"without text": 0, "without target tokens": 0}
        self.docs, self.digests, packers, self.how = [], [], [], []
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else pad_id
        for i, (source, _) in enumerate(self.sources):
            docs, empty, how = cached_tokens(source, self.tokenizer, cache_dir, par)
            self.how.append(how)
            self.skipped["without text"] += empty
            kept = self._kept(docs, source, vocab_size, tokenizer_dir)
            self.docs += kept
            self.digests.append(source_digest(source))
            # source 0 keeps the seed's order (a one-source run packs as before); others their own
            packers.append(Packer(kept, args.seq_len, args.seed + i * MIX_SEED_STRIDE, pad))
        self.seq_len, self.seed = args.seq_len, args.seed
        self.tokenizer_sha256 = tokenizer_digest(self.tokenizer)
        self.digest = self.digests[0] if len(self.sources) == 1 else self.digests
        self.packer = packers[0] if len(packers) == 1 else Mixer(packers, [w for _, w in self.sources])

    def _kept(self, docs: list, source: str, vocab_size: int, tokenizer_dir: str) -> list:
        kept = []
        for doc in docs:
            if not any(doc.targets[1:]):  # a segment's first token is never a target (pack.py)
                self.skipped["without target tokens"] += 1
            else:
                kept.append(doc)
        if not kept:
            raise DataError(f"--data {source}: no document has a token to train on ({self._skip_text()})")
        for doc in kept:
            top = max(doc.ids)
            if top >= vocab_size:
                raise DataError(
                    f"{doc.where}: token id {top} from --tokenizer {tokenizer_dir} is outside the "
                    f"model's vocabulary (vocab_size {vocab_size})"
                )
        return kept

    def _skip_text(self) -> str:
        return ", ".join(f"{n} {why}" for why, n in self.skipped.items() if n) or "nothing"

    def describe(self) -> str:
        """What was read, kept and skipped, and which documents get split (said once, at the start)."""
        tokens = sum(len(d.ids) for d in self.docs)
        targets = sum(sum(d.targets[1:]) for d in self.docs)
        long = [d for d in self.docs if len(d.ids) > self.seq_len]
        text = (
            f"data {self.path}: {len(self.docs)} documents, {tokens:,} tokens ({targets:,} loss targets); "
            f"skipped: {self._skip_text()}; {', '.join(dict.fromkeys(self.how))}"
        )
        if len(self.sources) > 1:
            text += "\nmixture: " + ", ".join(f"{s} {w:.3g}" for s, w in self.sources)
        if long:
            text += (
                f"\n{len(long)} documents are longer than --seq-len {self.seq_len} and are split into pieces "
                f"(the first at {long[0].where})"
            )
        return text

    def summary(self) -> str:
        s = self.packer.stats
        share = s.padding / max(1, s.rows * self.seq_len)
        if isinstance(self.packer, Mixer):
            where = "rows per source " + ", ".join(map(str, self.packer.drawn))
        else:
            pos = self.packer.state_dict()
            where = f"next: epoch {pos['epoch']}, document {pos['index']} of {len(self.docs)}"
        return f"data: packed {s.rows} rows ({share:.1%} padding); {where}; skipped: {self._skip_text()}"

    def next_step(self) -> list[Batch]:
        """All dp ranks pack the step's rows identically; this rank keeps its grad_accum micro-batches."""
        per_rank = self.batch_size * self.grad_accum
        rows = self.packer.batch(per_rank * self.dp).rows(slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank))
        return [rows.rows(slice(m * self.batch_size, (m + 1) * self.batch_size)) for m in range(self.grad_accum)]

    def _documents(self):
        if isinstance(self.packer, Mixer):
            return [len(p.docs) for p in self.packer.packers]
        return len(self.docs)

    def state_dict(self) -> dict:
        return {
            "file_sha256": self.digest,
            "documents": self._documents(),
            "seed": self.seed,
            "tokenizer_sha256": self.tokenizer_sha256,
            **self.packer.state_dict(),
        }

    def load_state_dict(self, state: dict, where: str) -> None:
        # the cursor indexes documents in the seed's order, tokenized by one tokenizer: another reinterprets it
        for key, mine, flag in (
            ("seed", self.seed, "--seed"),
            ("tokenizer_sha256", self.tokenizer_sha256, "--tokenizer"),
        ):
            if key in state and state[key] != mine:
                raise SystemExit(
                    f"glm53 train: error: --resume {where} packed its data with another {flag} "
                    f"({key} {state[key]!r}, now {mine!r}); its data position would point at other "
                    f"tokens: resume with the run's {flag}"
                )
        if state.get("file_sha256") != self.digest or state.get("documents") != self._documents():
            raise SystemExit(
                f"--resume {where} was trained on a different --data file than {self.path} (its "
                f"sha256 or document count differs); resume with the same file"
            )
        try:
            self.packer.load_state_dict(state)
        except ValueError as e:  # a corrupt trainer state: one line naming it
            raise SystemExit(f"glm53 train: error: --resume {where}: {e}") from None


__all__ = ["FileData", "eval_batches", "add_arguments", "check_args", "heldout_loss", "init_model", "model_inputs"]
