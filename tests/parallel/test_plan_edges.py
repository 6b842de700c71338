"""The TP plan at its edges (one process): tied embeddings are refused under tensor parallelism, a field that does
not split over tp is named with its value, and (LocalTensorMode, the `meshes` fixture of test_parallel_boundary.py)
the logits stay a vocab-sharded DTensor equal to one process's.

Legend: tp the tensor-parallel ranks; logits [B, T, vocab].
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Shard

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import parallelize
from glm53.parallel.plan import check_tp_size
from tests.parallel.test_parallel_boundary import WORLD, meshes, per_rank, tiny  # noqa: F401 (fixture)


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


def test_tp_logits_stay_a_vocab_sharded_dtensor_equal_to_one_process(meshes):  # noqa: F811
    """lm_head's output under TP is a Shard(-1) DTensor (loss_parallel reads it unsplit); its full tensor is one
    process's logits. A plain local tensor here would hand the caller vocab / tp columns without a word."""
    torch.manual_seed(0)
    model = Glm53ForCausalLM(tiny())
    ids = torch.randint(1, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
    with LocalTensorMode(WORLD):
        parallelize(model, meshes["tp2"])
        with torch.no_grad():
            logits = model(ids).logits
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)  # the vocab dimension
        assert logits.to_local().shape[-1] * 2 == model.config.vocab_size
    for value in per_rank(logits):
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5)
