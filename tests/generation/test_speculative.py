"""MTP speculative decoding: the same tokens as plain greedy decoding for k = 1, 2, 3, and acceptance 1.0 when the
MTP layer is built to predict exactly what the main model will pick next."""

from __future__ import annotations

import pytest
import torch

from tests.generation.test_incremental import GLM_SHARED, KDA_ONLY
from tests.helpers.generation import left_padded, tiny_model

NEW = 10


@pytest.fixture(scope="module")
def greedy_run():
    """A model with a random MTP layer, a left-padded prompt batch, an EOS that row 0 meets after 7 new tokens (rows
    finish at different steps) and the plain greedy output."""
    model = tiny_model(num_nextn_predict_layers=1)
    ids, mask = left_padded(model.config.vocab_size, [11, 6])
    eos = int(model.generate(ids, mask, max_new_tokens=NEW)[0, ids.shape[1] + 6])
    return model, ids, mask, eos, model.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_equals_greedy(greedy_run, k):
    """Sparse regime (index_topk 8), left-padded batch, per-row EOS."""
    model, ids, mask, eos, plain = greedy_run
    fast, stats = model.generate(
        ids, mask, max_new_tokens=NEW, eos_token_id=eos, speculative="mtp", num_speculative_tokens=k, return_stats=True
    )
    assert torch.equal(fast, plain)
    assert stats.drafted > 0 and 0.0 <= stats.acceptance_rate <= 1.0


def oracle_mtp_model(index_topk: int = 4):
    """Main model whose blocks add nothing (every o_proj and down projection zero): its hidden state is
    norm(embed(t)), so its next token is a function f(t) of the current token. The MTP layer then reduces to
    shared_head.norm(enorm(embed(t_next))) = norm(embed(t_next)) (eh_proj keeps only the embedding half; its
    attention and MoE add nothing), which predicts f(t_next): the main model's pick after the draft's input."""
    model = tiny_model(num_nextn_predict_layers=1, index_topk=index_topk)
    D = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight") or "down_proj" in name:
                p.zero_()
        layer = model.mtp.layers[0]
        layer.eh_proj.weight.copy_(torch.cat([torch.eye(D), torch.zeros(D, D)], dim=1))
        layer.enorm.weight.fill_(1.0)
        layer.shared_head.norm.weight.copy_(model.model.norm.weight)
    return model


@pytest.mark.parametrize("k", [1, 2, 3])
def test_acceptance_is_one_with_an_exact_draft_model(k):
    model = oracle_mtp_model()
    ids, mask = left_padded(model.config.vocab_size, [9, 5], seed=3)
    plain = model.generate(ids, mask, max_new_tokens=NEW)
    fast, stats = model.generate(
        ids, mask, max_new_tokens=NEW, speculative="mtp", num_speculative_tokens=k, return_stats=True
    )
    assert torch.equal(fast, plain)
    assert stats.acceptance_rate == 1.0
    # the first token comes from the prefill, then k + 1 per verify forward
    assert stats.verify_forwards == -(-(NEW - 1) // (k + 1))


@pytest.mark.parametrize("config", [KDA_ONLY, GLM_SHARED], ids=["kda-only", "shared-across-kda"])
def test_speculative_equals_greedy_other_stacks(config):
    """A main model of KDA layers only, and a hybrid whose shared-indexer layer reuses a top-k across a KDA layer:
    speculative output equals plain greedy for k = 1, 2, 3 (left-padded batch; rows cross pool boundaries)."""
    model = tiny_model(num_nextn_predict_layers=1, **config)
    ids, mask = left_padded(model.config.vocab_size, [9, 6], seed=5)
    plain = model.generate(ids, mask, max_new_tokens=NEW)
    for k in (1, 2, 3):
        assert torch.equal(
            model.generate(ids, mask, max_new_tokens=NEW, speculative="mtp", num_speculative_tokens=k), plain
        )
