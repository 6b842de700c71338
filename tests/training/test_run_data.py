"""--data sources and the data-side failure families: parquet / shard directories / saved `datasets` equal the
jsonl path token for token, mixtures hold their weights and resume exactly, tokenization is cached and reused,
--eval-data's loss equals a manual computation, and silent-data inputs (BOM, form feed, text+messages,
tool_calls without a template, a raising template, --init without --data, a long --seq-len) are handled.
Legend: B batch, T time. The tokenizer and checkpoint come from examples/finetune.py (tests/training/test_finetune.py)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F

from glm53.__main__ import main
from glm53.training.cli import add_arguments
from glm53.training.data import cache as cache_mod
from glm53.training.data import tokenize as tokenize_mod
from glm53.training.data.documents import DataError, read_documents
from glm53.training.data.pack import Mixer, Packer
from glm53.training.data.sources import parse_mixture, read_source
from glm53.training.data.tokenize import TextTokenizer, TokenDoc, encode_document, encode_documents
from glm53.training.finetune import FileData, heldout_loss
from glm53.training.trainer import Trainer
from tests.training.test_finetune import load_example

SEQ = 64


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    torch.manual_seed(0)
    return load_example().prepare(str(tmp_path_factory.mktemp("rundata")))


def records(prepared) -> list[dict]:
    with open(prepared["train"], encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def file_data(prepared, data: str, *extra: str, cache_dir: str | None = None) -> FileData:
    args = parse("--data", data, "--seq-len", str(SEQ), "--batch-size", "2", "--seed", "1", *extra)
    args.cache_dir = cache_dir
    return FileData(args, prepared["base"], 1 << 20, 0, 1, 0)


def rows(data: FileData, steps: int) -> list[torch.Tensor]:
    return [torch.cat([b.input_ids, b.labels, b.position_ids]) for _ in range(steps) for b in data.next_step()]


# ---------------------------------------------------------------------------------------------- formats
def test_parquet_directory_and_datasets_equal_jsonl_token_for_token(prepared, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = records(prepared)
    keys = sorted({k for r in recs for k in r})
    table = [{k: r.get(k) for k in keys} for r in recs]  # every column in every row (null where absent)
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "train.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    half = len(recs) // 2
    for name, part in (("a.jsonl", recs[:half]), ("b.jsonl", recs[half:])):
        (shards / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    datasets.Dataset.from_list(table).save_to_disk(str(tmp_path / "saved"))
    reference = rows(file_data(prepared, prepared["train"]), 3)
    for source in (tmp_path / "train.parquet", shards, tmp_path / "saved"):
        got = rows(file_data(prepared, str(source)), 3)
        assert all(torch.equal(a, b) for a, b in zip(got, reference)), source


def test_parquet_row_errors_name_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"text": "fine", "prompt": None}, {"text": None, "prompt": "x"}]),
        tmp_path / "bad.parquet",
    )
    with pytest.raises(DataError, match=r"bad.parquet:row 1: a prompt/completion record needs both"):
        read_source(str(tmp_path / "bad.parquet"))


# ---------------------------------------------------------------------------------------------- mixtures
def test_mixture_spec():
    assert parse_mixture("a.jsonl") == [("a.jsonl", 1.0)]
    assert parse_mixture("a.jsonl:3,dir/b:1") == [("a.jsonl", 0.75), ("dir/b", 0.25)]
    assert parse_mixture("hf:name:train:2,x.txt:2") == [("hf:name:train", 0.5), ("x.txt", 0.5)]
    for bad, message in (("a:1,b", "has no weight"), ("a:0,b:1", "positive number"), ("a:1,a:1", "twice")):
        with pytest.raises(DataError, match=message):
            parse_mixture(bad)


def docs(n: int, tag: int) -> list[TokenDoc]:
    return [TokenDoc([tag, tag + i + 1, tag + i + 2], [True] * 3, f"{tag}:{i}") for i in range(n)]


def test_mixer_holds_the_weights_and_resumes_exactly():
    def make():
        return Mixer([Packer(docs(5, 100), 3, 0, 0), Packer(docs(7, 200), 3, 1, 0)], [0.7, 0.3])

    mixer = make()
    picks = []
    for _ in range(10):  # by hand: each row from the largest w_i * (n + 1) - drawn_i (ties to the first source)
        before = list(mixer.drawn)
        mixer.row()
        picks.append(next(i for i in range(2) if mixer.drawn[i] != before[i]))
    assert picks == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    mixer = make()
    for n in range(1, 1001):
        mixer.row()
        assert abs(mixer.drawn[0] - 0.7 * n) <= 1 and sum(mixer.drawn) == n  # within one row, at every step
    state = json.loads(json.dumps(mixer.state_dict()))  # it travels as JSON (the DCP path)
    straight = [mixer.row() for _ in range(50)]
    resumed = make()
    resumed.load_state_dict(state)
    assert [resumed.row() for _ in range(50)] == straight


def test_mixture_run_resumes_exactly(prepared, tmp_path, capsys):
    spec = f"{prepared['train']}:0.6,{prepared['heldout']}:0.4"
    data = file_data(prepared, spec)
    straight = rows(data, 6)
    again = file_data(prepared, spec)
    rows(again, 3)
    state = again.state_dict()
    resumed = file_data(prepared, spec)
    resumed.load_state_dict(json.loads(json.dumps(state)), "x")
    assert all(torch.equal(a, b) for a, b in zip(rows(resumed, 3), straight[3 * 1 :]))
    assert "mixture:" in data.describe()


# ------------------------------------------------------------------------------------------------ cache
def test_tokenization_is_cached_and_reused(prepared, tmp_path, monkeypatch):
    calls = []
    real = cache_mod.tokenize_source
    monkeypatch.setattr(cache_mod, "tokenize_source", lambda *a: calls.append(a) or real(*a))
    first = file_data(prepared, prepared["train"], cache_dir=str(tmp_path / "cache"))
    assert len(calls) == 1 and "cached in" in first.describe()
    second = file_data(prepared, prepared["train"], cache_dir=str(tmp_path / "cache"))
    assert len(calls) == 1 and "read from the cache" in second.describe()  # the second start did not tokenize
    assert all(torch.equal(a, b) for a, b in zip(rows(first, 3), rows(second, 3)))
    # another tokenizer is another cache entry (one more token: other ids for the same text)
    other = tmp_path / "tok"
    other.mkdir()
    changed = TextTokenizer(prepared["base"])
    changed.hf.add_tokens(["<an added token>"])
    changed.save(str(other))
    args = parse("--data", prepared["train"], "--seq-len", str(SEQ))
    args.cache_dir = str(tmp_path / "cache")
    FileData(args, str(other), 1 << 20, 0, 1, 0)
    assert len(calls) == 2


class CountingTokenizer:
    """A `tokenizers.Tokenizer` stand-in that counts the batch calls it forwards."""

    def __init__(self, raw) -> None:
        self.raw, self.batches = raw, []

    def encode_batch(self, texts, add_special_tokens):
        self.batches.append(len(texts))
        return self.raw.encode_batch(texts, add_special_tokens=add_special_tokens)


def test_tokenization_is_batched_and_equals_text_by_text(prepared, tmp_path, monkeypatch):
    """A source is tokenised in batch calls (the tokenizers library runs a batch on every core), ENCODE_BATCH texts
    at most, and gives the ids of encoding every rendered piece alone, for each tokenizer kind."""
    docs = read_source(prepared["train"]).documents
    bare = tmp_path / "bare"
    bare.mkdir()
    load_example().build_tokenizer(chat_template=False).backend_tokenizer.save(str(bare / "tokenizer.json"))
    for tok in (TextTokenizer(prepared["base"]), TextTokenizer(str(bare))):

        def alone(text: str) -> list[int]:
            if not text:
                return []
            if tok.raw is not None:
                return tok.raw.encode(text, add_special_tokens=False).ids
            return tok.hf.encode(text, add_special_tokens=False)

        expected = [
            [
                t
                for piece, _ in tokenize_mod._pieces(d, tok)
                for t in (piece if isinstance(piece, list) else alone(piece))
            ]
            for d in docs
        ]
        assert [e.ids for e in encode_documents(docs, tok)] == expected
    tok = TextTokenizer(str(bare))
    tok.raw = CountingTokenizer(tok.raw)
    texts = sum(len(tokenize_mod._pieces(d, tok)) for d in docs)
    monkeypatch.setattr(tokenize_mod, "ENCODE_BATCH", 7)
    encode_documents(docs, tok)
    assert tok.raw.batches == [7] * (texts // 7) + ([texts % 7] if texts % 7 else []), (texts, tok.raw.batches)


def test_run_caches_in_the_run_directory(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    base = [
        "train",
        "--init",
        prepared["base"],
        "--data",
        prepared["train"],
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "2",
        "--steps",
        "1",
        "--save",
        str(run),
    ]
    assert main(base) == 0
    assert "cached in" in capsys.readouterr().out and list((run / "cache").glob("tokens-*.pt"))
    assert main(["train", "--resume", str(run), "--steps", "2"]) == 0
    assert "read from the cache" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- evaluation
def test_eval_loss_equals_a_manual_computation(prepared, tmp_path):
    args = parse(
        "--init",
        prepared["base"],
        "--data",
        prepared["train"],
        "--eval-data",
        prepared["heldout"],
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "3",
        "--steps",
        "1",
    )
    args.config_notes, args.train_parser = [], None
    trainer = Trainer(args)
    got = trainer.evaluate()
    want = heldout_loss(trainer.model, prepared["heldout"], prepared["base"], SEQ)
    # by hand: cross-entropy summed over every target of every row (HF's shift), over the number of targets
    model, total, count = trainer.model.eval(), 0.0, 0
    with torch.no_grad():
        for b in trainer.eval_rows:
            logits = model(b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
            labels = b.labels[:, 1:]
            total += float(
                F.cross_entropy(
                    logits[:, :-1].flatten(0, 1).double(), labels.flatten(), reduction="sum", ignore_index=-100
                )
            )
            count += int(labels.ne(-100).sum())
    model.train()
    # the same rows and formula in another batch grouping: fp32 rounding of a mean over ~1e3 tokens (eps 1.2e-7 x
    # sqrt(1e3) ~ 4e-6)
    assert got["eval_loss"] == pytest.approx(want, rel=1e-5)
    assert got["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["eval_perplexity"] == pytest.approx(math.exp(got["eval_loss"]), rel=1e-12)
    assert trainer.model.training  # back in training mode


def test_eval_runs_in_training_and_is_recorded(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--init",
                prepared["base"],
                "--data",
                prepared["train"],
                "--eval-data",
                prepared["heldout"],
                "--eval-every",
                "2",
                "--seq-len",
                str(SEQ),
                "--batch-size",
                "2",
                "--steps",
                "3",
                "--log-every",
                "5",
                "--save",
                str(run),
            ]
        )
        == 0
    )
    got = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [m["step"] for m in got if "eval_loss" in m]
    assert evals == [2, 3] and "eval  step     2" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- silent data
def test_bom_and_line_separators(tmp_path):
    path = tmp_path / "d.txt"
    path.write_bytes("\ufeffone\x0ctwo\u2028three\n\nnext\r\nline\n".encode())
    got = [d.text for d in read_documents(str(path)).documents]
    assert got == ["one\x0ctwo\u2028three", "next\nline"]  # no BOM, form feed and U+2028 kept in the text
    jl = tmp_path / "d.jsonl"
    jl.write_bytes('\ufeff{"text": "a\\fb"}\n'.encode())
    assert [d.text for d in read_documents(str(jl)).documents] == ["a\x0cb"]


@pytest.mark.parametrize(
    "record,message",
    [
        ({"text": "a", "messages": [{"role": "user", "content": "b"}]}, "both 'text' and 'messages'"),
        ({"text": "a", "prompt": "b", "completion": "c"}, "both 'text' and 'prompt'"),
        ({"messages": [{"role": "user", "content": "b", "weight": 1}]}, "unknown key 'weight'"),
    ],
)
def test_ambiguous_records_are_refused(tmp_path, record, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=message):
        read_documents(str(path))


TOOL_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    "reasoning_content": "I should look it up",
}


def conversation(tmp_path, *messages) -> str:
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "weather?"}, *messages]}) + "\n")
    return str(path)


def test_tool_calls_and_reasoning_through_the_template(prepared, tmp_path):
    tok = TextTokenizer(prepared["base"])
    doc = read_documents(conversation(tmp_path, TOOL_CALL)).documents[0]
    assert doc.messages[1]["tool_calls"] == TOOL_CALL["tool_calls"]  # kept, not dropped
    template = (
        "{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
        "</think>{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}"
        "</call>{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok.hf.chat_template = tok.chat_template = template
    ids = encode_document(doc, tok).ids
    assert tok.hf.decode(ids).count("get_weather") == 1 and "I should look it up" in tok.hf.decode(ids)
    tok.hf.chat_template = tok.chat_template = template.replace("<call>{{ c.function.name }}</call>", "")
    with pytest.raises(DataError, match=r"c.jsonl:1: .* does not render messages\[1\]'s 'tool_calls'"):
        encode_document(doc, tok)
    tok.hf.chat_template = tok.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(DataError, match=r"c.jsonl:1: the chat template .* raised .*no tools here"):
        encode_document(doc, tok)
    tok.hf.chat_template = tok.chat_template = None
    with pytest.raises(DataError, match="only a chat template can render"):
        encode_document(doc, tok)


def test_init_without_data_and_long_seq_len_with_data(prepared, capsys):
    with pytest.raises(SystemExit, match="has a tokenizer: it needs --data"):
        main(["train", "--init", prepared["base"], "--steps", "1"])
    # the built-in corpus's length does not bound a --data run's rows: a row longer than the whole corpus
    from glm53.training.data import corpus_text

    seq_len = 2 * len(corpus_text().encode("utf-8"))  # 1408 bytes: the check refused --seq-len 1408 and above
    assert (
        main(
            [
                "train",
                "--init",
                prepared["base"],
                "--data",
                prepared["train"],
                "--seq-len",
                str(seq_len),
                "--batch-size",
                "1",
                "--steps",
                "1",
            ]
        )
        == 0
    )


def test_save_over_other_tokenizer_files_is_refused(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tokenizer.json").write_text("{}")  # the user's own file
    with pytest.raises(SystemExit, match=r"holds a tokenizer.json that is not this run's"):
        main(
            [
                "train",
                "--init",
                prepared["base"],
                "--data",
                prepared["train"],
                "--seq-len",
                str(SEQ),
                "--steps",
                "1",
                "--save",
                str(run),
            ]
        )
    assert (run / "tokenizer.json").read_text() == "{}"


def test_data_cursor_refuses_another_seed_or_tokenizer(prepared, tmp_path):
    data = file_data(prepared, prepared["train"])
    rows(data, 2)
    state = json.loads(json.dumps(data.state_dict()))
    with pytest.raises(SystemExit, match="another --seed"):
        file_data(prepared, prepared["train"], "--seed", "2").load_state_dict(state, "x")
    other = tmp_path / "tok"
    other.mkdir()
    changed = TextTokenizer(prepared["base"])
    changed.hf.add_tokens(["<an added token>"])
    changed.save(str(other))
    args = parse("--data", prepared["train"], "--seq-len", str(SEQ), "--batch-size", "2", "--seed", "1")
    args.cache_dir = None
    with pytest.raises(SystemExit, match="another --tokenizer"):
        FileData(args, str(other), 1 << 20, 0, 1, 0).load_state_dict(state, "x")
    same = file_data(prepared, prepared["train"])
    same.load_state_dict(state, "x")
    assert all(torch.equal(a, b) for a, b in zip(rows(same, 2), rows(data, 2)))
