"""Fine-tuning data edge values pinned exactly: .txt/.jsonl reading, byte-corpus windows, packing cursor and
segments, FileData's filtering, stats and dp split. Legend: T tokens per row (seq_len), no model.

Training data: a tokenizer.json that cannot be parsed (a DataError naming the flag and file; tokenizers raised a
bare Exception), the built-in corpus windows and the packer given bad sizes, documents or a resume state (each
named; an empty document looped forever, an out-of-range cursor resumed at a wrong token). Legend: T tokens.
"""

import argparse
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from glm53.errors import InputError
from glm53.losses import IGNORE_INDEX
from glm53.training.data import batches, decode, encode
from glm53.training.data.documents import DataError, Document, read_documents
from glm53.training.data.pack import Batch, Packer
from glm53.training.data.tokenize import TextTokenizer, TokenDoc, encode_document
from glm53.training.finetune import FileData, heldout_loss, model_inputs


def write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------------- reading
def test_txt_last_block_without_trailing_blank_line_and_upper_case_extension(tmp_path):
    docs = read_documents(write(tmp_path / "d.TXT", "a\n\nb\nc")).documents
    assert [(d.text, d.where.rsplit(":", 1)[1]) for d in docs] == [("a", "1"), ("b\nc", "3")]


def test_empty_message_list_is_an_error(tmp_path):
    with pytest.raises(DataError, match=r"d.jsonl:1: 'messages' must be a non-empty list"):
        read_documents(write(tmp_path / "d.jsonl", '{"messages": []}\n'))


# ------------------------------------------------------------------------------------------ byte corpus
def test_byte_zero_round_trips_and_the_shortest_corpus_has_one_window():
    assert encode("a\x00b").tolist() == [98, 1, 99] and decode(encode("a\x00b")) == "a\x00b"
    stream = torch.arange(1, 10)  # 9 tokens, windows of 8: only the first one fits with a next token
    window = next(batches(stream, 3, 8, torch.Generator().manual_seed(0)))
    assert window.tolist() == [list(range(1, 9))] * 3
    with pytest.raises(InputError, match="--seq-len 9 needs a corpus of more than 9 tokens"):
        batches(stream, 1, 9, torch.Generator())


# ---------------------------------------------------------------------------------------------------- packing
def doc(ids, where="f:1"):
    return TokenDoc(list(ids), [True] * len(ids), where)


def test_a_document_of_exactly_one_row_starts_a_new_row_and_padding_positions_count_up():
    packer = Packer([doc([5, 6]), doc([7, 8, 9, 10], "f:2")], 4, seed=0, pad_id=0)
    packer.order = [0, 1]
    assert packer.row() == ([5, 6, 0, 0], [IGNORE_INDEX, 6, IGNORE_INDEX, IGNORE_INDEX], [1, 1, 0, 0], [0, 1, 0, 1])
    assert packer.row() == ([7, 8, 9, 10], [IGNORE_INDEX, 8, 9, 10], [1, 1, 1, 1], [0, 1, 2, 3])
    assert packer.stats.split == 0 and packer.stats.rows == 2 and packer.stats.padding == 2


def test_pieces_of_a_long_document_restart_positions():
    packer = Packer([doc(range(10, 17))], 3, seed=0, pad_id=0)
    rows = [packer.row() for _ in range(3)]
    assert [r[0] for r in rows] == [[10, 11, 12], [13, 14, 15], [16, 10, 11]]  # then the next epoch's first
    assert [r[3] for r in rows] == [[0, 1, 2], [0, 1, 2], [0, 0, 1]]
    assert [r[1] for r in rows][1:] == [[IGNORE_INDEX, 14, 15], [IGNORE_INDEX, IGNORE_INDEX, 11]]  # no target at a
    assert packer.stats.split == 2 and packer.stats.padding == 0  # piece's first token; split once per epoch


def test_each_epoch_has_its_own_order_and_a_resume_into_a_later_epoch_uses_it():
    docs = [doc([10 * k + 1] * 2, f"f:{k}") for k in range(6)]
    packer = Packer(docs, 2, seed=3, pad_id=0)
    orders = []
    for _ in range(3):
        orders.append([packer.row()[0][0] // 10 for _ in range(6)])
    assert packer.state_dict() == dict(epoch=3, index=0, offset=0)
    assert all(sorted(o) == list(range(6)) for o in orders) and len({tuple(o) for o in orders}) == 3
    fresh = Packer(docs, 2, seed=3, pad_id=0)
    fresh.load_state_dict(dict(epoch=1, index=2, offset=1))
    assert fresh.row()[0] == [10 * orders[1][2] + 1, 0]  # the tail of epoch 1's third document, then padding
    assert fresh.row()[0] == [10 * orders[1][3] + 1] * 2


def test_resume_offset_at_the_document_end_is_refused():
    packer = Packer([doc([5, 6, 7]), doc([8, 9, 10], "f:2")], 4, seed=0, pad_id=0)
    with pytest.raises(ValueError, match="'offset' 3 is past the end of document 0"):
        packer.load_state_dict(dict(epoch=0, index=0, offset=3))


# ------------------------------------------------------------------------------------------------ FileData
@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A bare tokenizer.json (no EOS, no pad): one id per word."""
    path = tmp_path_factory.mktemp("tok")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("a b c d e f g h".split())}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def file_data(tmp_path, tok, lines, vocab=16, dp=1, rank=0, batch_size=1, grad_accum=1, seq_len=4):
    data = write(tmp_path / "d.jsonl", "".join(f'{{"text": "{t}"}}\n' for t in lines))
    args = argparse.Namespace(data=data, batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len, seed=0)
    return FileData(args, tok, vocab, 0, dp, rank)


def test_file_data_skips_single_token_documents_and_reports_exact_numbers(tmp_path, word_tokenizer):
    fd = file_data(tmp_path, word_tokenizer, ["a", "a b c d", "", "b c"])
    assert fd.skipped == {"without text": 1, "without target tokens": 1}
    text = fd.describe()
    assert "2 documents, 6 tokens (4 loss targets)" in text and "longer than" not in text  # 4 tokens == T: no split
    fd.packer.order = [1, 0]  # "b c" (then padding: "a b c d" fits a row, not its rest), then "a b c d"
    fd.next_step()
    fd.next_step()
    assert fd.packer.stats.rows == 2 and fd.packer.stats.padding == 2
    assert "packed 2 rows (25.0% padding)" in fd.summary()
    with pytest.raises(DataError, match="token id 8 .* outside the model's vocabulary \\(vocab_size 8\\)"):
        file_data(tmp_path, word_tokenizer, ["h a"], vocab=8)
    with pytest.raises(SystemExit, match="different --data file"):  # same file, other document count
        fd.load_state_dict({**fd.state_dict(), "documents": 3}, "run")


def test_file_data_dp_rank_takes_its_own_rows(tmp_path, word_tokenizer):
    lines = [" ".join("abcdefgh"[k : k + 2]) for k in range(7)]  # 7 two-token documents, one per row of T 2
    ref = file_data(tmp_path, word_tokenizer, lines, seq_len=2).packer.batch(8).input_ids
    fd = file_data(tmp_path, word_tokenizer, lines, dp=2, rank=1, batch_size=2, grad_accum=2, seq_len=2)
    micro = fd.next_step()
    assert [m.input_ids.tolist() for m in micro] == [ref[4:6].tolist(), ref[6:8].tolist()]


def test_position_ids_go_only_to_a_forward_that_takes_them():
    batch = Batch(*(torch.full((1, 2), v) for v in (1, 2, 3, 4)))

    class Packed(torch.nn.Module):
        def forward(self, input_ids, labels, attention_mask, position_ids=None): ...

    class Plain(torch.nn.Module):
        def forward(self, input_ids, labels, attention_mask): ...

    assert model_inputs(Packed(), batch)["position_ids"].tolist() == [[4, 4]]
    assert sorted(model_inputs(Plain(), batch)) == ["attention_mask", "input_ids", "labels"]


def test_targets_without_a_chat_template_but_with_an_eos():
    """A tokenizer with an EOS and no chat template: 'role: content' lines, the assistant content and one EOS
    after it are the targets; prompt/completion as the raw texts; text: every token then EOS."""
    tok = SimpleNamespace(
        eos_id=99, chat_template=None, encode_batch=lambda texts: [[ord(c) for c in s] for s in texts]
    )
    chat = Document("f:1", messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    got = encode_document(chat, tok)
    assert got.ids == [ord(c) for c in "user: Hi\nassistant: Yo"] + [99]
    assert "".join("1" if t else "0" for t in got.targets) == "0" * 20 + "111"
    pair = encode_document(
        Document(
            "f:2", messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "c"}], plain_prompt=True
        ),
        tok,
    )
    assert (pair.ids, pair.targets) == ([ord("q"), ord("c"), 99], [False, True, True])
    text = encode_document(Document("f:3", text="ab"), tok)
    assert (text.ids, text.targets) == ([97, 98, 99], [True] * 3)


def test_transformers_tokenizer_without_a_pad_token_pads_with_eos(tmp_path, word_tokenizer):
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(f"{word_tokenizer}/tokenizer.json")
    raw.add_special_tokens(["<eos>"])
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>").save_pretrained(str(tmp_path))
    tok = TextTokenizer(str(tmp_path))
    assert tok.hf.pad_token_id is None and tok.eos_id == 9 and tok.pad_id == 9
    args = argparse.Namespace(
        data=write(tmp_path / "d.jsonl", '{"text": "a b"}\n'), batch_size=1, grad_accum=1, seq_len=4, seed=0
    )
    assert FileData(args, str(tmp_path), 16, 0, 1, 0).packer.pad_id == 9  # the tokenizer's, not the config's 0


def test_heldout_loss_covers_every_row_whatever_the_batch_size(tmp_path, word_tokenizer):
    from glm53 import Glm53Config, Glm53ForCausalLM

    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config.tiny(vocab_size=64))
    data = write(tmp_path / "h.jsonl", "".join(f'{{"text": "{t}"}}\n' for t in ["a b c", "d e", "f g h a", "b"]))
    per_row = heldout_loss(model, data, word_tokenizer, 4, batch_size=1)
    assert heldout_loss(model, data, word_tokenizer, 4, batch_size=8) == pytest.approx(per_row, rel=1e-5)
    assert model.training  # restored


# -------------------------------------------------------------------------------- bad tokenizers, windows, packer input
@pytest.mark.parametrize("content", ["{", "", "[1, 2]", '{"model": 3}', "\xff"])
def test_unparsable_tokenizer_json(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content, encoding="latin-1")
    with pytest.raises(DataError, match=rf"--tokenizer {tmp_path}: tokenizer.json cannot be read \("):
        TextTokenizer(str(tmp_path))


# ------------------------------------------------------------------------------- built-in corpus windows
TOKENS = torch.arange(1, 101)  # [T] a token stream


@pytest.mark.parametrize(
    "tokens,batch_size,seq_len,match",
    [
        (TOKENS, 0, 8, "--batch-size must be a positive int, got 0"),
        (TOKENS, -1, 8, "--batch-size must be a positive int, got -1"),
        (TOKENS, 2.0, 8, "--batch-size must be a positive int, got 2.0"),
        (TOKENS, True, 8, "--batch-size must be a positive int, got True"),
        (TOKENS, 2, 8.0, "--seq-len must be a positive int, got 8.0"),
        (TOKENS[None].repeat(2, 1), 2, 8, r"tokens must be a 1-D torch.long tensor .* \(2, 100\)"),
        (TOKENS.tolist(), 2, 8, "tokens must be a 1-D torch.long tensor"),
        (TOKENS.float(), 2, 8, "tokens must be a 1-D torch.long tensor .*float32"),
    ],
)
def test_batches_arguments(tokens, batch_size, seq_len, match):
    with pytest.raises(InputError, match=match):
        batches(tokens, batch_size, seq_len, torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------- packing
DOCS = [TokenDoc([5, 6, 7, 8], [True] * 4, "d.txt:1"), TokenDoc([9, 10, 11], [True] * 3, "d.txt:3")]


@pytest.mark.parametrize(
    "docs,seq_len,pad,match",
    [
        (DOCS, 0, 0, "seq_len must be a positive int, got 0"),
        (DOCS, -4, 0, "seq_len must be a positive int"),
        (DOCS, 4.0, 0, "seq_len must be a positive int, got 4.0"),
        (DOCS, 8, None, "pad_id must be a token id"),
        (DOCS, 8, -1, "pad_id must be a token id"),
        ([TokenDoc([], [], "d.txt:7")], 8, 0, "d.txt:7: a packed document needs tokens"),  # row() looped forever
        ([TokenDoc([1, 2], [True], "d.txt:9")], 8, 0, "d.txt:9: .* got 2 ids and 1 flags"),
    ],
)
def test_packer_arguments(docs, seq_len, pad, match):
    with pytest.raises(ValueError, match=match):
        Packer(docs, seq_len, 0, pad)


@pytest.mark.parametrize(
    "state,match",
    [
        (dict(epoch=0, index=2, offset=0), "'index' 2 is past the 2 documents"),
        (dict(epoch=0, index=0, offset=99), "'offset' 99 is past the end of document 0"),
        (dict(epoch=0, index=0), "'offset' must be an int >= 0"),
        (dict(epoch=-1, index=0, offset=0), "'epoch'"),
        (dict(epoch=0, index="0", offset=0), "'index' must be an int >= 0"),
        (dict(epoch=0, index=0.0, offset=0), "'index' must be an int >= 0"),
    ],
)
def test_packer_resume_state_that_does_not_fit(state, match):
    packer = Packer(DOCS, 8, 0, 0)
    before = packer.state_dict()
    with pytest.raises(ValueError, match=f"data position: {match}"):
        packer.load_state_dict(state)
    assert packer.state_dict() == before  # the cursor is unchanged
    packer.load_state_dict(dict(epoch=torch.tensor(1), index=1, offset=torch.tensor(1)))  # 0-d tensors are ints
    assert packer.state_dict() == dict(epoch=1, index=1, offset=1)
