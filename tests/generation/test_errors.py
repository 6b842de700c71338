"""Bad input to generation gets a clear error naming the argument (or the cache's model).

`generate` arguments of the wrong type, value or device: a GenerationError (InputError for a prompt on another
device) naming the argument, raised before any decoding. Legend: B batch, T prompt length.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from glm53.errors import Glm53Error
from glm53.generation import CacheError, GenerationCache, GenerationError, generate
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


# ------------------------------------------------------------------------- arguments of the wrong type, value or device
IDS = torch.tensor([[4, 5, 6, 7], [8, 9, 10, 11]])  # [B, T]


@pytest.fixture(scope="module")
def model_args():
    return tiny_model()


class PutOnly:
    def put(self, ids):
        pass


class EndOnly:
    end = "not callable"


BAD = {
    # sampling options: str, None, bool, nan, inf where a number is meant
    "temperature-str": (dict(do_sample=True, temperature="1"), "temperature must be a finite number > 0"),
    "temperature-none": (dict(do_sample=True, temperature=None), "temperature must be a finite number > 0"),
    "temperature-bool": (dict(do_sample=True, temperature=True), "got True"),
    "temperature-inf": (dict(do_sample=True, temperature=math.inf), "got inf"),
    "temperature-nan": (dict(do_sample=True, temperature=math.nan), "got nan"),
    "top-k-bool": (dict(do_sample=True, top_k=True), "top_k must be an integer >= 1"),
    "top-k-numpy-float": (dict(do_sample=True, top_k=np.float64(2)), "top_k must be an integer >= 1"),
    "top-p-str": (dict(do_sample=True, top_p="0.5"), "top_p must lie in"),
    "top-p-bool": (dict(do_sample=True, top_p=True), "top_p must lie in"),
    "top-p-nan": (dict(do_sample=True, top_p=math.nan), "top_p must lie in"),
    # flags: a non-empty string is truthy (do_sample="no" sampled)
    "do-sample-str": (dict(do_sample="no"), "do_sample must be True or False, got 'no'"),
    "do-sample-none": (dict(do_sample=None), "do_sample must be True or False"),
    "do-sample-int": (dict(do_sample=1), "do_sample must be True or False"),
    "return-stats-str": (dict(return_stats="yes"), "return_stats must be True or False"),
    # ids used as fill values
    "pad-float": (dict(pad_token_id=1.5), "pad_token_id must be an integer token id or None, got 1.5"),
    "pad-str": (dict(pad_token_id="1"), "pad_token_id must be an integer token id"),
    "pad-bool": (dict(pad_token_id=True), "pad_token_id must be an integer token id or None, got True"),
    # objects called during decoding
    "generator-int": (dict(do_sample=True, generator=3), "generator must be a torch.Generator or None, got int"),
    "streamer-object": (dict(streamer=object()), "streamer must have put.* lacks put and end"),
    "streamer-put-only": (dict(streamer=PutOnly()), "PutOnly lacks end"),
    "streamer-end-not-callable": (dict(streamer=EndOnly()), "EndOnly lacks put and end"),
    # the prompt and its mask
    "ids-list": (dict(input_ids=IDS.tolist()), "input_ids must be a torch.Tensor"),
    "ids-numpy": (dict(input_ids=IDS.numpy()), "input_ids must be a torch.Tensor"),
    "ids-meta": (dict(input_ids=IDS.to("meta")), "input_ids is on the meta device"),
    "mask-list": (dict(attention_mask=[[1] * 4] * 2), "attention_mask must be a torch.Tensor"),
    "mask-meta": (dict(attention_mask=torch.ones(2, 4, device="meta")), "attention_mask is on the meta device"),
    "mask-two": (dict(attention_mask=torch.full((2, 4), 2)), "attention_mask must hold only 0"),
    "mask-half": (dict(attention_mask=torch.full((2, 4), 0.5)), "attention_mask must hold only 0"),
    "mask-negative": (dict(attention_mask=-torch.ones(2, 4)), "attention_mask must hold only 0"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_arguments_name_the_argument(model_args, case):
    kwargs, match = BAD[case]
    kwargs = {"input_ids": IDS, "max_new_tokens": 2, **kwargs}
    with pytest.raises(Glm53Error, match=match):
        generate(model_args, **kwargs)


def test_good_values_of_the_same_arguments_still_work(model_args):
    """Ints for float options, a float mask of 0/1, the same generator device: accepted, and equal to greedy."""
    greedy = generate(model_args, IDS, max_new_tokens=2)
    same = generate(
        model_args,
        IDS,
        attention_mask=torch.ones(2, 4),
        max_new_tokens=2,
        do_sample=True,
        temperature=1,
        top_k=1,
        top_p=1,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(same, greedy)


def test_generator_on_another_device_than_the_model():
    """A CPU generator for a model elsewhere (here: the meta device, where no generator can be made)."""
    with torch.device("meta"):
        model_args = tiny_model(random_weights=False)
    with pytest.raises(GenerationError, match=r"generator is on cpu but the model is on meta"):
        generate(model_args, IDS.to("meta"), max_new_tokens=1, do_sample=True, generator=torch.Generator())


@pytest.mark.parametrize("step", ["decode", "verify"])
@pytest.mark.parametrize(
    "case,match",
    [
        ("float", "takes integer ids"),
        ("list", "takes ids as a torch.Tensor, got list"),
        ("meta", "ids is on the meta device"),
        ("not-a-cache", "takes a GenerationCache, got dict"),
    ],
)
def test_step_inputs(model_args, step, case, match):
    """The generation step (decode and verify shapes): a meta ids tensor decoded NaNs, a float one failed in
    F.embedding."""
    from glm53.generation import GenerationCache
    from glm53.generation import step as run_step

    cache = GenerationCache(model_args)
    model_args.model(IDS, cache=cache)
    good = IDS[:, -1:] if step == "decode" else IDS[:, -2:]
    ids = {"float": good.float(), "list": good.tolist(), "meta": good.to("meta")}.get(case, good)
    with pytest.raises(Glm53Error, match=match):
        run_step(model_args, {} if case == "not-a-cache" else cache, ids)
