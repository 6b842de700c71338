"""Bad input to generation gets a clear error naming the argument (or the cache's model)."""

from __future__ import annotations

import pytest
import torch

from glm53.generation import CacheError, GenerationCache, GenerationError
from tests.helpers.generation import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_position_embeddings=32)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(max_new_tokens=30), "max_position_embeddings=32"),
        (dict(eos_token_id=320), "eos_token_id 320"),
        (dict(eos_token_id=[3, -1]), "eos_token_id -1"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, top_p=1.5), "top_p"),
        (dict(do_sample=True, top_k=0), "top_k"),
        (dict(speculative="mtp"), "MTP layer"),
        (dict(speculative="medusa"), "speculative"),
    ],
    ids=[
        "negative-new",
        "float-new",
        "too-long",
        "eos-vocab",
        "eos-negative",
        "temperature",
        "top-p",
        "top-k",
        "no-mtp",
        "unknown-speculative",
    ],
)
def test_bad_arguments(model, kwargs, match):
    ids = torch.randint(1, 320, (1, 5))
    with pytest.raises(GenerationError, match=match):
        model.generate(ids, **kwargs)


def test_bad_prompts(model):
    with pytest.raises(GenerationError, match="left-padded"):
        model.generate(torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        model.generate(torch.tensor([[1, 400]]))
    with pytest.raises(GenerationError, match="non-empty integer"):
        model.generate(torch.ones(1, 0, dtype=torch.long))


def test_cache_from_another_model(model):
    other = tiny_model(seed=2)
    cache = GenerationCache(other)
    with torch.inference_mode(), pytest.raises(CacheError, match="another model"):
        model.model(torch.ones(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(CacheError, match="MTP layers"):
        GenerationCache(model, part="mtp")


def test_zero_new_tokens_returns_the_prompt(model):
    ids = torch.randint(1, 320, (2, 5))
    assert torch.equal(model.generate(ids, max_new_tokens=0), ids)


def test_eos_defaults_to_the_config(model):
    """eos_token_id=None uses model.config.eos_token_id, as transformers' generate does."""
    ids = torch.randint(1, 320, (1, 5), generator=torch.Generator().manual_seed(0))
    free = model.generate(ids, max_new_tokens=6)
    eos = int(free[0, 7])  # the third new token
    configured = tiny_model(max_position_embeddings=32, eos_token_id=eos)
    out = configured.generate(ids, max_new_tokens=6)
    assert out.shape[1] <= 8 and int(out[0, -1]) == eos
    assert model.generate(ids, max_new_tokens=6, eos_token_id=eos).shape == out.shape
