"""MLA's recorded pool mass (`ctx.stats.pool_mass`, the target of the indexer KL loss) against transformers'
attention probabilities.

Legend: B batch, T time, H heads, P pools, L tokens per pool.
With index_topk covering every visible key, transformers' eager sparse attention returns the dense causal
probabilities [B, H, T, T]; the pool mass of a query is those summed over heads and over each pool's tokens.
Both attention forms (absorbed into the latent, or per head) must record it from the per-head keys and the
attention's own scale: the outputs of the layer do not read it, so only this comparison sees it.
"""

from __future__ import annotations

import pytest
import torch
import transformers.models.glm5_next.modeling_glm5_next as hf

from glm53 import Glm53Config
from glm53.model.context import ForwardContext
from glm53.model.indexer import kept_pools
from glm53.model.mla import MultiHeadLatentAttention
from tests.model.test_blocks import padding, pair


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "per-head"])
@pytest.mark.parametrize("pad", ["left", "right"])
def test_recorded_pool_mass_is_transformers_attention_summed_over_pools(pad, absorb):
    T = 13
    config = Glm53Config.tiny(layer_types=["indexed_attention"] * 4, index_topk=16)  # every visible key
    ours, theirs = pair(config, hf.Glm5NextTextAttention, MultiHeadLatentAttention, 0)
    ours.absorb = absorb
    x = torch.randn(2, T, config.hidden_size)
    mask = padding(2, T, pad)
    ctx = ForwardContext(valid=mask, collect_stats=True, record_indexer=True).for_layer()
    with torch.no_grad():
        _, probs, _ = theirs(x, mask)  # [B, H, T, T]
        ours(x, ctx)
    positions, _ = kept_pools(mask, config.index_kpool)  # [B, P, L], -1 where invalid
    token_mass = probs.sum(1)  # [B, T, T]
    index = positions.clamp(min=0).flatten(1)[:, None, :].expand(-1, T, -1)
    expected = (token_mass.gather(-1, index) * (positions >= 0).flatten(1)[:, None]).view(2, T, -1, config.index_kpool)
    got = ctx.stats.pool_mass
    torch.testing.assert_close(got[mask], expected.sum(-1)[mask], rtol=1e-5, atol=1e-6)
    # every visible key lies in some pool (complete or not): each valid query's mass is one per head
    torch.testing.assert_close(got[mask].sum(-1), torch.full_like(got[mask][:, 0], config.num_attention_heads))
