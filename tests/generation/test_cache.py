"""Edges of GenerationCache (model/cache.py): exact nbytes of KDA and MLA layers, the int8 latent's round trip,
fixed and growing buffers, a prefill with an all-padding row, bad uses, and rewinds through the user's forward.

Legend (glm53/model/__init__.py): B batch, T positions, H KDA heads, K head width (KDA; the indexer's for pools),
V KDA value width, W conv width, Z kv_lora_rank, L index_kpool, P k-pools.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import CacheError, GenerationCache, step
from glm53.model.cache import INT8_MAX, KdaCache, MlaCache
from tests.generation.test_incremental import KDA_ONLY
from tests.helpers.generation import assert_matches_full, left_padded, tiny_model, verify_rewind_decode

F32 = 4  # bytes per element


@pytest.fixture(scope="module")
def model():
    return tiny_model(random_weights=False)


def _prefill(model, lengths, **cache_kw):
    ids, mask = left_padded(model.config.vocab_size, lengths)
    cache = GenerationCache(model, **cache_kw)
    with torch.inference_mode():
        model.model(ids, mask, cache=cache)
    return cache, ids


def test_kda_layer_bytes_are_the_state_and_the_conv_histories():
    model = tiny_model(random_weights=False, **KDA_ONLY)
    cfg = model.config
    cache, _ = _prefill(model, [9, 5])
    H, K, W, B = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim, 2
    per_layer = B * H * K * K * F32 + B * (W - 1) * 3 * H * K * F32
    assert cache.nbytes() == cfg.num_hidden_layers * per_layer
    assert cache.seq_len == 9 and cache.bytes_per_token() == cache.nbytes() / 9


def test_mla_layer_bytes_count_the_filled_part_only(model):
    """latent B*S*Z and one pooled key per complete pool (the exact minimum); room reserved adds nothing."""
    cfg = model.config
    B, S, Z, K, L = 2, 13, cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_kpool
    cache, ids = _prefill(model, [S, S - 6], max_length=40)
    mla = [c for c in cache._layers.values() if isinstance(c, MlaCache)]
    kda = sum(c.nbytes() for c in cache._layers.values() if isinstance(c, KdaCache))

    def expected(S):
        return len(mla) * (B * S * Z * F32 + B * (S // L) * K * F32)

    assert all(c.latent.shape[1] == 40 for c in mla) and cache.nbytes() - kda == expected(S)
    with torch.inference_mode():
        for t in range(3):
            step(model, cache, ids[:, t : t + 1])
    assert cache.nbytes() - kda == expected(S + 3)
    assert cache.bytes_per_token() == cache.nbytes() / (S + 3)


def test_int8_latent_round_trip(model):
    """Each row is stored as round(x / s) with s = absmax / 127: read back within s / 2 of the input, the absmax
    entry exactly (up to fp32 rounding), and an all-zero row as zeros (not NaN)."""
    g = torch.Generator().manual_seed(0)
    Z = model.config.kv_lora_rank
    latent = torch.randn(2, 3, Z, generator=g) * torch.tensor([1.0, 30.0, 0.01])[None, :, None]
    latent[1, 2] = 0.0
    mla = next(layer.self_attn for layer in model.model.layers if not hasattr(layer.self_attn, "A_log"))
    cache = MlaCache(mla, 2, 5, 1, torch.int8)
    cache.write(torch.tensor([0, 1]), latent[:, :2])
    cache.write(torch.tensor([2]), latent[:, 2:])
    assert cache.latent.dtype == torch.int8
    scale = latent.abs().amax(-1) / INT8_MAX  # [B, T]
    scale[1, 2] = 1.0
    torch.testing.assert_close(cache.scale[:, :3], scale)
    back = cache.keys(torch.float32)[:, :3]
    assert ((back - latent).abs() <= scale[..., None] / 2 * (1 + 1e-5)).all()
    peak = latent.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, peak), latent.gather(-1, peak), rtol=1e-6, atol=0)
    assert torch.equal(back[1, 2], torch.zeros(Z))


def test_buffers_fixed_or_growing(model):
    """max_length: the buffers are allocated once at the prefill and never moved; without it, 28 one-token
    forwards after a 4-token prefill reallocate the latent 3 times (4, 8, 16, 32 slots), not once per token."""
    cache, ids = _prefill(model, [9, 6], max_length=20)
    mla = [c for c in cache._layers.values() if isinstance(c, MlaCache)]
    L = model.config.index_kpool
    assert all(c.latent.shape[1] == 20 and c.pool_keys.shape[1] == -(-20 // L) + 1 for c in mla)
    buffers = [(c.latent.data_ptr(), c.pool_keys.data_ptr()) for c in mla]
    with torch.inference_mode():
        for t in range(11):
            model.model(ids[:, t % 6 : t % 6 + 1], cache=cache)
        with pytest.raises(CacheError, match="max_length=20"):
            model.model(ids[:, :1], cache=cache)
    assert cache.seq_len == 20 and [(c.latent.data_ptr(), c.pool_keys.data_ptr()) for c in mla] == buffers
    cache, ids = _prefill(model, [4])
    sizes = [next(c for c in cache._layers.values() if isinstance(c, MlaCache)).latent.shape[1]]
    with torch.inference_mode():
        for t in range(28):
            model.model(ids[:, t % 4 : t % 4 + 1], cache=cache)
            size = next(c for c in cache._layers.values() if isinstance(c, MlaCache)).latent.shape[1]
            if size != sizes[-1]:
                sizes.append(size)
    assert sizes == [4, 8, 16, 32]


def test_prefill_with_an_all_padding_row(model):
    """A row without tokens (all padding) starts at the next position: the prefill and a decode step equal full
    forwards, for both rows."""
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    mask[1] = 0
    nxt = torch.tensor([[17], [23]])
    with torch.inference_mode():
        cache = GenerationCache(model)
        got = model.model(ids, mask, cache=cache)
        got_step = step(model, cache, nxt)[:, 0]
        want = model.model(ids, mask)
        want_step = model.model(torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones(2, 1).long()], 1))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_step, want_step[:, -1], rtol=0, atol=1e-5)


def test_bad_cache_uses(model):
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    with torch.inference_mode():
        with pytest.raises(CacheError, match="left-padded"):
            model.model(ids, torch.tensor([[1, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]]), cache=GenerationCache(model))
        cache = GenerationCache(model)
        model.model(ids, mask, cache=cache)
        with pytest.raises(CacheError, match="tokens only"):
            model.model(ids[:, :2], torch.tensor([[1, 1], [0, 1]]), cache=cache)
        with pytest.raises(CacheError, match="batch of 2 rows, the input has 1"):
            model.model(ids[:1, :1], torch.ones(1, 1).long(), cache=cache)
        with pytest.raises(CacheError, match="mark.. needs a prefilled cache"):
            GenerationCache(model).mark()
        cache.mark()
        model.model(ids[:, :3], cache=cache)
        with pytest.raises(CacheError, match="max_step_tokens=17"):
            model.model(ids[:, :1].repeat(1, 15), cache=cache)
    with pytest.raises(CacheError, match="part must be 'main' or 'mtp', got 'draft'"):
        GenerationCache(model, part="draft")
    with pytest.raises(CacheError, match="needs a model with MTP layers"):
        GenerationCache(model, part="mtp")
    with pytest.raises(CacheError, match="latent_dtype"):
        GenerationCache(model, latent_dtype=torch.float8_e4m3fn)


def test_rewind_through_the_users_forward(model):
    """mark, a user forward (model.model(..., cache=...)) of true then wrong tokens, rewind to the true ones, then
    more such forwards: the logits equal the full forward."""
    _, got, full, mask = verify_rewind_decode(
        model,
        lambda c, chunk: model.model(chunk, cache=c),
        lambda c, ids: model.model(ids[:, None], cache=c),
        [(1, 2), (3, 1), (2, 0)],
        P=9,
        N=10,
    )
    assert_matches_full(got, full, mask, 1e-5)
