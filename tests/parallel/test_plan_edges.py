"""The TP plan's size checks (one process, no mesh): tied embeddings are refused under tensor parallelism, and a
field that does not split over tp is named with its value.

Legend: tp the tensor-parallel ranks.
"""

from __future__ import annotations

import pytest

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel.plan import check_tp_size


def test_tied_embeddings_are_refused_under_tensor_parallelism():
    model = Glm53ForCausalLM(Glm53Config.tiny(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        check_tp_size(model, 2)
    check_tp_size(Glm53ForCausalLM(Glm53Config.tiny()), 2)  # untied: passes


@pytest.mark.parametrize("field,value", [("vocab_size", 321), ("moe_intermediate_size", 15)])
def test_a_field_that_does_not_split_is_named(field, value):
    model = Glm53ForCausalLM(Glm53Config.tiny(**{field: value}))
    with pytest.raises(ValueError, match=f"{field}={value} is not divisible by 2"):
        check_tp_size(model, 2)
