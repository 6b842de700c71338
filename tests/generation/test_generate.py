"""Edges of `generate` (loop.py, emit.py): what the streamer sees, EOS and padding per row, pad_token_id and its
fallback, one and zero new tokens, the returned statistics, buffer reservation, and argument checks at their
boundaries.

Legend: B batch, T prompt length (padding included), Z kv_lora_rank, L index_kpool.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import GenerationCache, GenerationError, loop, step
from glm53.model.cache import MlaCache
from tests.helpers.generation import left_padded, tiny_model

NEW = 6


@pytest.fixture(scope="module")
def run():
    """The tiny model, a left-padded batch of two and its free greedy continuation."""
    model = tiny_model()
    ids, mask = left_padded(model.config.vocab_size, [7, 4])
    return model, ids, mask, model.generate(ids, mask, max_new_tokens=NEW)


class Recorder:
    def __init__(self) -> None:
        self.events: list = []

    def put(self, ids: torch.Tensor) -> None:
        self.events.append(ids.clone())

    def end(self) -> None:
        self.events.append("end")


def test_rows_finish_at_their_own_eos_and_the_streamer_sees_the_padded_tokens(run):
    """Row 0 meets EOS at its 3rd new token, row 1 never: row 0 then holds pad_token_id (streamed as such), row 1
    continues exactly as without EOS; the streamer gets the prompt, one [B] put per step, then end() once."""
    model, ids, mask, free = run
    T = ids.shape[1]
    eos = int(free[0, T + 2])
    assert eos not in free[1, T:].tolist() and eos not in free[0, T : T + 2].tolist()
    rec = Recorder()
    out = model.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=5, streamer=rec)
    assert out.shape == free.shape
    assert torch.equal(out[1], free[1]) and torch.equal(out[0, : T + 3], free[0, : T + 3])
    assert out[0, T + 3 :].tolist() == [5] * (NEW - 3) != free[0, T + 3 :].tolist()
    assert torch.equal(rec.events[0], ids) and rec.events[-1] == "end" and len(rec.events) == NEW + 2
    assert torch.equal(torch.stack(rec.events[1:-1], dim=1), out[:, T:])


def test_pad_falls_back_to_the_first_eos_and_any_listed_eos_stops(run):
    """With no pad_token_id anywhere a finished row repeats its EOS (transformers' fallback); every id of an EOS
    list stops a row."""
    model, ids, mask, free = run
    T = ids.shape[1]
    eos = int(free[0, T + 1])
    unused = next(i for i in range(1, 300) if i not in free.tolist()[0] + free.tolist()[1])
    pad = model.config.pad_token_id
    model.config.pad_token_id = None
    try:
        alone = model.generate(ids[:1], mask[:1], max_new_tokens=NEW, eos_token_id=[unused, eos])
        both = model.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[eos, unused])
    finally:
        model.config.pad_token_id = pad
    assert alone.tolist() == [free[0, : T + 2].tolist()]  # the only row finished: the loop ends
    assert both[0, T + 2 :].tolist() == [eos] * (NEW - 2) and torch.equal(both[1], free[1])


def test_one_and_zero_new_tokens(run):
    model, ids, mask, free = run
    T = ids.shape[1]
    one, stats = model.generate(ids, mask, max_new_tokens=1, return_stats=True)
    assert torch.equal(one, free[:, : T + 1])
    assert (stats.new_tokens, stats.cache_positions, stats.prompt_tokens) == (1, T, ids.numel())
    none, stats = model.generate(ids, mask, max_new_tokens=0, return_stats=True)
    assert torch.equal(none, ids)
    assert (stats.new_tokens, stats.cache_bytes, stats.cache_positions, stats.decode_tokens_per_second) == (0, 0, 0, 0)


@pytest.mark.parametrize("latent_dtype", [None, torch.bfloat16], ids=["exact", "bf16"])
def test_stats_count_the_cache_of_the_steps_run(run, latent_dtype):
    """cache_bytes is the nbytes of a cache after the prefill and the NEW - 1 fed-back tokens (the last pick is not
    fed), in the requested latent dtype."""
    model, ids, mask, free = run
    T = ids.shape[1]
    out, stats = model.generate(ids, mask, max_new_tokens=NEW, return_stats=True, latent_dtype=latent_dtype)
    assert torch.equal(out, free)
    with torch.inference_mode():
        cache = GenerationCache(model, latent_dtype=latent_dtype)
        model.model(ids, mask, cache=cache)
        for t in range(T, T + NEW - 1):
            step(model, cache, free[:, t : t + 1])
    exact = GenerationCache(model)
    assert (stats.prompt_tokens, stats.new_tokens, stats.cache_positions) == (ids.numel(), NEW, T + NEW - 1)
    assert stats.cache_bytes == cache.nbytes() > 0
    assert stats.decode_seconds > 0 and stats.decode_tokens_per_second == NEW / stats.decode_seconds
    if latent_dtype is not None:
        n_mla, Z = len(model.config.attention_layers), model.config.kv_lora_rank
        with torch.inference_mode():
            model.model(ids, mask, cache=exact)
            for t in range(T, T + NEW - 1):
                step(model, exact, free[:, t : t + 1])
        assert exact.nbytes() - stats.cache_bytes == n_mla * ids.shape[0] * (T + NEW - 1) * 2 * Z


def test_generate_reserves_the_buffers_once(run, monkeypatch):
    """The MLA buffers are sized for the whole generation at the prefill, exactly (no geometric overshoot)."""
    model, ids, mask, _ = run
    made = []

    class Spy(GenerationCache):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(loop, "GenerationCache", Spy)
    new = 9
    model.generate(ids, mask, max_new_tokens=new)
    mla = [c for c in made[0]._layers.values() if isinstance(c, MlaCache)]
    L, total = model.config.index_kpool, ids.shape[1] + new
    assert mla and all(c.latent.shape[1] == total and c.pool_keys.shape[1] == -(-total // L) + 1 for c in mla)


BAD = {
    "hole-in-mask": (dict(attention_mask=torch.tensor([[1, 0, 1, 1]])), "left-padded"),
    "all-padding-row": (
        dict(input_ids=torch.ones(2, 4).long(), attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]])),
        "a token last",
    ),
    "float-ids": (dict(input_ids=torch.ones(1, 4)), "non-empty integer"),
    "1d-ids": (dict(input_ids=torch.ones(4, dtype=torch.long)), "non-empty integer"),
    "mask-shape": (dict(attention_mask=torch.ones(1, 3)), r"attention_mask has shape \(1, 3\)"),
    "bool-new-tokens": (dict(max_new_tokens=True), "max_new_tokens"),
    "id-equals-vocab": (dict(input_ids=torch.tensor([[1, 2, 320, 3]])), "outside the vocabulary"),
    "negative-id": (dict(input_ids=torch.tensor([[1, -1, 2, 3]])), "outside the vocabulary"),
    "bool-eos": (dict(eos_token_id=True), "eos_token_id True"),
    "float-top-k": (dict(do_sample=True, top_k=2.5), "top_k"),
    "zero-top-p": (dict(do_sample=True, top_p=0.0), "top_p"),
    "pad-equals-vocab": (dict(pad_token_id=320), "pad_token_id 320"),
    "negative-pad": (dict(pad_token_id=-1), "pad_token_id -1"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_arguments_at_the_boundaries(run, case):
    model = run[0]
    kwargs, match = BAD[case]
    kwargs = dict(dict(input_ids=torch.tensor([[4, 5, 6, 7]]), max_new_tokens=2), **kwargs)
    with pytest.raises(GenerationError, match=match):
        model.generate(**kwargs)


def test_arguments_at_their_limits_are_accepted(run):
    """prompt + new == max_position_embeddings, top_p = 1 (no filter), and temperature 0 when not sampling."""
    model, ids, mask, free = run
    T = ids.shape[1]
    limit = model.config.max_position_embeddings
    model.config.max_position_embeddings = T + 3
    try:
        assert torch.equal(model.generate(ids, mask, max_new_tokens=3), free[:, : T + 3])
        with pytest.raises(GenerationError, match="max_position_embeddings"):
            model.generate(ids, mask, max_new_tokens=4)
    finally:
        model.config.max_position_embeddings = limit
    assert torch.equal(model.generate(ids, mask, max_new_tokens=NEW, temperature=0.0, top_p=5.0), free)
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    sampled = model.generate(ids, mask, max_new_tokens=NEW, do_sample=True, top_p=1.0, generator=gen())
    assert torch.equal(sampled, model.generate(ids, mask, max_new_tokens=NEW, do_sample=True, generator=gen()))
