"""The indexer's differentiable scores (`Indexer.score_and_select(..., grad=True)`, what the indexer KL loss
trains on) against transformers' index scores, and where their gradient goes.

Legend: B batch, T time, P pools, L tokens per pool.
The top-k tests in test_blocks.py compare selections only, which a positive rescaling of the scores (a dropped
K^-0.5 or H^-0.5) leaves unchanged; the KL loss reads the values. The oracle is built from transformers' own
projections and `get_pooled_states`, over its pool axis (pools complete in some row).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.models.glm5_next.modeling_glm5_next as hf

from glm53 import Glm53Config
from glm53.model.indexer import Indexer
from tests.model.test_blocks import padding, pair


def _transformers_scores(theirs, x, q_resid, mask):
    """[B, T, P'] index scores before any masking, as Glm5NextTextIndexer.forward computes them."""
    B, T = x.shape[:2]
    q = theirs.wq_b(q_resid).view(B, T, -1, theirs.head_dim)
    k = theirs.k_norm(theirs.wk(x))
    packed = torch.cat([k, F.linear(x, theirs.index_kpool_compress_gate), mask.to(k.dtype)[..., None]], dim=-1)
    pool_keys, _, _ = theirs.get_pooled_states(packed_states=packed)
    logits = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * theirs.softmax_scale)
    weights = theirs.weights_proj(x).float() * theirs.n_heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), logits).squeeze(-2)


@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_scores_with_gradient_equal_transformers_and_train_the_indexer_only(pad):
    T = 19  # pools of 4: the last one incomplete in every row
    config = Glm53Config.tiny(index_topk=8)
    ours, theirs = pair(config, hf.Glm5NextTextIndexer, Indexer, 3)
    x = torch.randn(2, T, config.hidden_size, requires_grad=True)
    q_resid = torch.randn(2, T, config.q_lora_rank, requires_grad=True)
    mask = padding(2, T, pad)
    _, scores, candidate, _ = ours.score_and_select(x, q_resid, mask, grad=True)
    _, _, complete = ours.pools(x, mask)
    keep = complete.any(0)
    with torch.no_grad():
        expected = _transformers_scores(theirs, x, q_resid, mask)
    assert scores.shape == (2, T, keep.numel()) and expected.shape == (2, T, int(keep.sum()))
    torch.testing.assert_close(scores[..., keep], expected, rtol=1e-5, atol=1e-6)
    assert candidate[..., ~keep].sum() == 0
    # the KL loss's gradient reaches the indexer's parameters and nothing upstream of it
    scores[candidate].sum().backward()
    assert x.grad is None and q_resid.grad is None
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_packed_selection_breaks_ties_to_the_lowest_pool():
    """All scores tied (ReLU scores are 0 often): a packed query picks its document's lowest candidate pools, so
    its choice does not depend on the other rows' pool counts (torch.topk's order among ties does)."""
    from glm53.model.indexer import kept_pools, select_pools

    kpool, topk, T = 2, 4, 24  # 2 pools per query
    valid = torch.ones(2, T, dtype=torch.bool)
    cu = torch.tensor([0, 13, 24, 48])  # row 0: documents of 13 and 11 tokens; row 1: one document of 24
    positions, complete = kept_pools(valid, kpool, cu)
    scores = torch.zeros(2, T, positions.shape[1])
    chosen, candidate, _ = select_pools(scores, positions, complete, valid, cu, 0, topk, kpool, False)
    for b, t in [(0, 12), (0, 23), (1, 23), (1, 9)]:
        doc_start = 13 if (b, t) == (0, 23) else 0
        first = sorted(i for i in chosen[b, t].tolist() if i >= 0)
        assert first == list(range(doc_start, doc_start + topk)), (b, t, first)
