"""Fine-tuning data: a tokenizer directory whose tokenizer.json cannot be parsed is a DataError naming the flag
and the file (tokenizers raised a bare Exception). No tensors."""

import pytest

from glm53.training.data.documents import DataError
from glm53.training.data.tokenize import TextTokenizer


@pytest.mark.parametrize("content", ["{", "", "[1, 2]", '{"model": 3}', "\xff"])
def test_unparsable_tokenizer_json(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content, encoding="latin-1")
    with pytest.raises(DataError, match=rf"--tokenizer {tmp_path}: tokenizer.json cannot be read \("):
        TextTokenizer(str(tmp_path))
