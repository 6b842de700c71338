"""Training data: a tokenizer.json that cannot be parsed (a DataError naming the flag and file; tokenizers raised a
bare Exception), the built-in corpus windows and the packer given bad sizes, documents or a resume state (each
named; an empty document looped forever, an out-of-range cursor resumed at a wrong token). Legend: T tokens."""

import pytest
import torch

from glm53.errors import InputError
from glm53.training.data import batches
from glm53.training.data.documents import DataError
from glm53.training.data.pack import Packer
from glm53.training.data.tokenize import TextTokenizer, TokenDoc


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
