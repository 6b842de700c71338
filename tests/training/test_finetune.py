"""Fine-tuning on a data file: reading and its errors, SFT targets, packing, and `glm53 train --init --data`
(held-out loss falls, resume equals an uninterrupted run, --grad-accum equals the larger batch).

Legend: B batch, T time. The tokenizer, checkpoint and data come from examples/finetune.py (the README's
end-to-end example), loaded from its file: a BPE tokenizer trained on the built-in corpus, nothing downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.__main__ import main
from glm53.losses import IGNORE_INDEX
from glm53.training.data.documents import DataError, read_documents
from glm53.training.data.pack import Packer
from glm53.training.data.tokenize import TextTokenizer, TokenDoc, encode_document
from glm53.training.finetune import heldout_loss
from glm53.training.state import TRAINER_STATE
from tests.training.test_train_cli import losses

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune.py")
SEQ = 96


def load_example():
    spec = importlib.util.spec_from_file_location("finetune_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return load_example()


@pytest.fixture(scope="module")
def prepared(example, tmp_path_factory):
    torch.manual_seed(0)
    return example.prepare(str(tmp_path_factory.mktemp("finetune")))


def write(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def train_args(paths: dict, *extra: str) -> list[str]:
    return [
        "train",
        "--init",
        paths["base"],
        "--data",
        paths["train"],
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "2",
        "--lr",
        "1e-2",
        "--log-every",
        "1",
        "--seed",
        "5",
        *extra,
    ]


# ---------------------------------------------------------------------------------------------------- reading
@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"text": "a"}', "", '{"text": "b"'], r"data.jsonl:3: invalid JSON"),
        (['{"text": "a"}', '{"label": 1}'], r"data.jsonl:2: the record has neither 'text' nor 'messages'"),
        (['{"prompt": "q"}'], r"data.jsonl:1: .*'completion' is missing"),
        (['{"messages": [{"role": "user"}]}'], r"data.jsonl:1: messages\[0\] must be an object"),
        (['{"messages": [{"role": "bot", "content": "x"}]}'], r"data.jsonl:1: .*role 'bot'"),
        (['{"text": 3}'], r"data.jsonl:1: 'text' must be a string"),
        (["[1, 2]"], r"data.jsonl:1: expected a JSON object"),
        (["", "  "], r"data.jsonl: the file is empty"),
    ],
)
def test_bad_records_name_the_file_and_line(tmp_path, lines, match):
    with pytest.raises(DataError, match=match):
        read_documents(write(tmp_path / "data.jsonl", lines))


def test_reading_txt_blocks_and_counting_empty_records(tmp_path):
    docs = read_documents(write(tmp_path / "d.txt", ["one", "still one", "", "", "two", ""])).documents
    assert [(d.text, d.where.rsplit(":", 1)[1]) for d in docs] == [("one\nstill one", "1"), ("two", "5")]
    read = read_documents(write(tmp_path / "d.jsonl", ['{"text": ""}', '{"text": "x"}', '{"text": "  "}']))
    assert len(read.documents) == 1 and read.empty == 2
    with pytest.raises(DataError, match=r"d.csv: unknown format"):
        read_documents(write(tmp_path / "d.csv", ["a"]))


def test_tokenizer_directory_without_a_tokenizer(tmp_path, prepared):
    with pytest.raises(DataError, match=rf"--tokenizer {re.escape(str(tmp_path))}: no tokenizer there"):
        TextTokenizer(str(tmp_path))
    with pytest.raises(SystemExit, match="no tokenizer there"):  # through the command: a message, no traceback
        main(train_args(prepared, "--steps", "1", "--tokenizer", str(tmp_path)))


# ---------------------------------------------------------------------------------------------------- targets
def decoded_targets(tok: TextTokenizer, doc: TokenDoc) -> str:
    return tok.hf.decode([i for i, t in zip(doc.ids, doc.targets) if t]) if tok.hf else None


def test_sft_targets_are_the_completion_only(tmp_path, prepared, example):
    data = write(
        tmp_path / "sft.jsonl",
        [
            json.dumps({"prompt": "Finish: the river", "completion": " town woke early"}),
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello there"},
                        {"role": "user", "content": "Bye"},
                        {"role": "assistant", "content": "Goodbye"},
                    ]
                }
            ),
            json.dumps({"text": "Bakers lit their ovens"}),
        ],
    )
    docs = read_documents(data).documents
    chat = TextTokenizer(prepared["base"])  # the checkpoint's tokenizer, with a chat template
    enc = [encode_document(d, chat) for d in docs]
    assert decoded_targets(chat, enc[0]) == " town woke early<|endoftext|>\n"
    assert decoded_targets(chat, enc[1]) == "Hello there<|endoftext|>\nGoodbye<|endoftext|>\n"
    assert chat.hf.decode(enc[1].ids).startswith("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello")
    assert all(enc[2].targets) and chat.hf.decode(enc[2].ids) == "Bakers lit their ovens<|endoftext|>"
    # without a chat template: "role: content" lines, prompt/completion as the raw texts; a bare tokenizer.json
    bare = tmp_path / "bare"
    bare.mkdir()
    example.build_tokenizer(chat_template=False).backend_tokenizer.save(str(bare / "tokenizer.json"))
    raw = TextTokenizer(str(bare))
    assert raw.hf is None and raw.chat_template is None and raw.eos_id is None
    plain = [encode_document(d, raw) for d in docs]
    target_text = [raw.raw.decode([i for i, t in zip(d.ids, d.targets) if t]) for d in plain]
    assert target_text[0] == " town woke early\n"
    assert target_text[1] == "Hello there\nGoodbye\n"
    assert raw.raw.decode(plain[1].ids).startswith("system: Be brief.\nuser: Hi\nassistant: Hello there\n")


def test_packed_labels_put_loss_on_completion_tokens_only(prepared):
    """One epoch of the example's SFT data in rows: every segment is a whole document, its labels are its
    completion's tokens (targets from tokenize.py, checked above) and nothing else; padding has no labels."""
    tok = TextTokenizer(prepared["base"])
    docs = [encode_document(d, tok) for d in read_documents(prepared["train"]).documents]
    packer = Packer(docs, 128, seed=0, pad_id=0)
    rows = []
    while packer.epoch == 0:
        rows.append(packer.row())
    assert packer.stats.split == 0
    seen = []
    for ids, labels, mask, pos in rows:
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            assert pos[a:b] == list(range(b - a))  # position_ids count up from 0 in each segment
            if not mask[a]:
                assert set(labels[a:b]) == {IGNORE_INDEX} and set(mask[a:b]) == {0}
                continue
            doc = next(d for d in docs if d.ids == ids[a:b])
            expected = [IGNORE_INDEX] + [t if m else IGNORE_INDEX for t, m in zip(doc.ids[1:], doc.targets[1:])]
            assert labels[a:b] == expected
            seen.append(doc.where)
    assert sorted(seen) == sorted(d.where for d in docs)  # each document exactly once per epoch


# ---------------------------------------------------------------------------------------------------- packing
def test_packing_splits_long_documents_orders_by_seed_and_resumes_at_the_cursor():
    docs = [TokenDoc(list(range(10 * k, 10 * k + n)), [True] * n, f"f:{k}") for k, n in enumerate((3, 5, 20, 7, 2, 9))]

    def epoch(packer):
        rows = []
        while packer.epoch == 0:
            rows.append(packer.row())
        return rows

    a = Packer(docs, 8, seed=1, pad_id=0)
    first = epoch(a)
    assert epoch(Packer(docs, 8, seed=1, pad_id=0)) == first and epoch(Packer(docs, 8, seed=2, pad_id=0)) != first
    assert a.stats.split == 2  # the 20- and 9-token documents; the others are never cut
    tokens = [t for ids, _, mask, _ in first for t, m in zip(ids, mask) if m]
    assert sorted(tokens) == sorted(t for d in docs for t in d.ids)  # every token once per epoch
    assert all(len(ids) == 8 for ids, *_ in first)
    # resume: a fresh packer at a saved cursor (mid-document here) continues with exactly the same rows
    c = Packer(docs, 8, seed=1, pad_id=0)
    for _ in range(3):
        c.row()
    d = Packer(docs, 8, seed=1, pad_id=0)
    d.load_state_dict(c.state_dict())
    assert [d.row() for _ in range(8)] == [c.row() for _ in range(8)]
    assert c.state_dict()["epoch"] == 1  # past the end of the first epoch: the next permutation continues


# --------------------------------------------------------------------------------------------------- training
def test_finetune_lowers_heldout_loss_and_resume_equals_uninterrupted(tmp_path, prepared, capsys):
    save = tmp_path / "tuned"
    assert main(train_args(prepared, "--steps", "8", "--save", str(save), "--save-every", "4")) == 0
    out = capsys.readouterr().out
    straight = losses(out)
    assert sorted(straight) == list(range(1, 9)) and straight[8] < straight[1]
    assert "fine-tuning" in out and "documents are longer than --seq-len" not in out and "packed" in out
    assert (save / "tokenizer.json").is_file() and (save / "step-4" / "tokenizer_config.json").is_file()
    state = torch.load(save / "step-4" / TRAINER_STATE, weights_only=True)["data"]
    assert state["index"] > 0 and len(state["file_sha256"]) == 64
    before = heldout_loss(
        Glm53ForCausalLM.from_pretrained(prepared["base"]), prepared["heldout"], prepared["base"], SEQ
    )
    after = heldout_loss(Glm53ForCausalLM.from_pretrained(save), prepared["heldout"], str(save), SEQ)
    assert after < before - 0.2, (before, after)

    resume = [
        "train",
        "--resume",
        str(save / "step-4"),
        "--data",
        prepared["train"],
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "2",
        "--lr",
        "1e-2",
        "--log-every",
        "1",
        "--seed",
        "5",
        "--steps",
        "8",
    ]
    assert main(resume) == 0
    again = losses(capsys.readouterr().out)
    assert sorted(again) == [5, 6, 7, 8]
    for step in again:  # model, optimizer, router biases and the exact data position restored
        assert again[step] == pytest.approx(straight[step], rel=1e-5, abs=1e-6), (step, again, straight)
    other = tmp_path / "other.jsonl"
    shutil.copy(prepared["heldout"], other)
    with pytest.raises(SystemExit):  # run.toml: another --data is another run
        main([*resume[:4], str(other), *resume[5:]])
    assert "--data" in capsys.readouterr().err and "--override data" in capsys.readouterr().err + "--override data"
    with pytest.raises(SystemExit, match="different --data file"):  # forced: the file's digest still differs
        main([*resume[:4], str(other), *resume[5:], "--override", "data"])


def test_grad_accum_equals_the_larger_batch(prepared, capsys):
    assert main(train_args(prepared, "--steps", "3", "--batch-size", "2")) == 0
    whole = losses(capsys.readouterr().out)
    assert main(train_args(prepared, "--steps", "3", "--batch-size", "1", "--grad-accum", "2")) == 0
    accumulated = losses(capsys.readouterr().out)
    assert sorted(whole) == sorted(accumulated) == [1, 2, 3]
    for step in whole:  # the same rows, one loss normalised over both micro-batches: the same steps
        assert accumulated[step] == pytest.approx(whole[step], rel=1e-5), (accumulated, whole)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--grad-accum", "0"], None),
        (["--grad-accum", "x"], None),
        (["--data", "x.jsonl"], "--data needs --init"),
        (["--tokenizer", "t"], "--tokenizer needs --data"),
    ],
)
def test_flag_errors(flags, message, capsys):
    with pytest.raises(SystemExit, match=message) as err:
        main(["train", "--steps", "1", *flags])
    if message is None:  # argparse usage error: exit status 2, the flag named
        assert err.value.code == 2 and "--grad-accum" in capsys.readouterr().err
