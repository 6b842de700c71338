"""Edges of the T = 1 decode step (generation/step.py) the main cases do not reach: a bf16 model (the KDA gate
adds dt_bias outside the f_b linear when the weights are not fp32) and an indexer that does not always select the
tail of the pool being filled (k-pool 4).

Legend (glm53/model/__init__.py): B batch, P prompt tokens, N new tokens.
"""

from __future__ import annotations

import torch

from glm53.generation import GenerationCache, step
from tests.generation.test_incremental import REL_TOL
from tests.helpers.generation import assert_matches_full, left_padded, tiny_model

P, N = 9, 6
BF16_REL_TOL = 1e-2  # bf16 rounding of the step's own formula order (~4e-3 of the logits' scale on this case)


def _decoded(model, ids, mask) -> torch.Tensor:
    """Prefill P tokens, decode the next N -> their logits [B, N, vocab] (fp32)."""
    with torch.inference_mode():
        cache = GenerationCache(model)
        model.model(ids[:, :P], mask[:, :P], cache=cache)
        return torch.stack(
            [model.lm_head(step(model, cache, ids[:, t : t + 1]))[:, 0] for t in range(P, P + N)], 1
        ).float()


def test_decode_step_of_a_bf16_model():
    model = tiny_model(random_weights=False).to(torch.bfloat16)
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 3])
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits[:, P:].float()
    got = _decoded(model, ids, mask)
    assert (got - full).abs().max().item() <= BF16_REL_TOL * full.abs().max().item()


def test_decode_step_without_the_tail_selection():
    """index_kpool_always_select_tail False with k-pool 4: a query reads complete pools only."""
    model = tiny_model(random_weights=False, index_kpool_always_select_tail=False)
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 3])
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
    got = torch.cat([full[:, :P], _decoded(model, ids, mask)], dim=1)
    assert_matches_full(got, full, mask, REL_TOL)
