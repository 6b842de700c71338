"""Edges of the decode and verify steps the main cases do not reach: rows at the same k-pool phase (every row
completes a pool at once, inside a verify chunk), linears with biases (packed with bias-free ones), and a query
whose selected slots are all empty.

Legend (glm53/model/__init__.py): B batch, P prompt tokens, N new tokens, T tokens per verify step, H heads,
K/V head dims, J selected slots, Z kv_lora_rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from glm53.generation import decode as D
from glm53.generation.decode import decode_step
from glm53.generation.decode_common import _absorbed_attention
from glm53.generation.verify import verify_step
from tests.generation.test_decode import _prefilled
from tests.generation.test_incremental import CASES, REL_TOL, REL_TOL_RANDOM
from tests.generation.test_verify import _pool_ends_inside_a_chunk
from tests.helpers.generation import assert_matches_full, case_inputs, left_padded, tiny_model


def test_verify_rows_at_the_same_pool_phase():
    """Both rows unpadded: all complete the same pools at the same step, so the last query of a chunk sees every
    pool while an earlier one does not; the earlier queries must still not read the pool filled after them."""
    T = 3
    model, ids, mask, P, N = case_inputs(CASES["sparse-P13-N12"], shorter_by=0)
    assert bool(mask.all()) and _pool_ends_inside_a_chunk(mask, model.config.index_kpool, P, N, T)
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache, first = _prefilled(model, ids, mask, P)
        steps = [first] + [model.lm_head(verify_step(model, cache, ids[:, t : t + T])) for t in range(P, P + N, T)]
    assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL)


def test_decode_and_verify_with_attention_biases():
    """attention_bias: q_a and kv_a carry biases (random here), packed with the indexer's bias-free linears."""
    model = tiny_model(random_weights=True, attention_bias=True)
    biases = [m.bias for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert biases and all(b.abs().max() > 0.1 for b in biases)
    P, N = 9, 6
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 3])
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache, first = _prefilled(model, ids, mask, P)
        steps = [first, model.lm_head(verify_step(model, cache, ids[:, P : P + 3]))]
        steps += [model.lm_head(decode_step(model, cache, ids[:, t]))[:, None] for t in range(P + 3, P + N)]
    assert_matches_full(torch.cat(steps, dim=1), full, mask, REL_TOL_RANDOM)


def test_absorbed_attention_of_a_query_without_rows_is_zero():
    """A query with no filled slot gets a zero output (as layers._softmax_slots), not NaN; the others attend over
    their filled rows only."""
    g = torch.Generator().manual_seed(0)
    N, H, K, J, Z, V = 3, 2, 4, 5, 6, 3
    p = SimpleNamespace(w_uk=torch.randn(H, K, Z, generator=g), w_uv_t=torch.randn(H, Z, V, generator=g), scale=0.5)
    q, kv = torch.randn(N, H, K, generator=g), torch.randn(N, J, Z, generator=g)
    filled = torch.tensor([[True, False, True, True, False], [False] * J, [True] * J])
    got = _absorbed_attention(p, q, kv, filled)
    scores = torch.einsum("nhk,hkz,njz->nhj", q, p.w_uk, kv) * p.scale
    probs = torch.softmax(scores.masked_fill(~filled[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    want = torch.einsum("nhj,njz,hzv->nhv", probs, kv, p.w_uv_t)
    assert (got[1] == 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_moe_step_with_expert_groups_equals_module():
    """Group-limited routing (n_group 4, topk_group 2): one token takes the router module and visits its experts
    sorted, so its routing weights must be reordered with them; several tokens take the per-expert loop."""
    model = tiny_model(random_weights=True, n_group=4, topk_group=2)
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    gen = torch.Generator().manual_seed(3)
    unsorted = 0
    with torch.inference_mode():
        for moe in moes:
            for B in (1, 1, 1, 1, 3):
                x = torch.randn(B, model.config.hidden_size, generator=gen)
                unsorted += int((moe.gate(x)[2].diff(dim=-1) < 0).any())
                want = moe(x[:, None, :])[:, 0]
                got = D._moe_step(D._moe(moe), x)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert unsorted  # some token's router order is not the expert order
