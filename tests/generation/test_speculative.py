"""MTP speculative decoding: the same tokens as plain greedy decoding for k = 1, 2, 3, and acceptance 1.0 when the
MTP layer is built to predict exactly what the main model will pick next.

MTP speculative decoding, the parts the equal-to-greedy tests cannot see: acceptance counts only *leading* draft
matches of unfinished rows (forged drafts), and every step's first draft is the MTP layer's greedy pick over the whole
committed sequence (no stale draft-only positions left in the MTP cache, the right hidden states fed back).

Legend: B batch, P prompt length, s draft tokens per step, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import speculative
from glm53.model.context import ForwardContext
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


# -------------------------------------------------------------------------------------- what equal-to-greedy cannot see
NEW_DRAFTS = 8


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(num_nextn_predict_layers=1)
    ids, mask = left_padded(model.config.vocab_size, [9, 6], seed=4)
    return model, ids, mask


def _recording_drafter(monkeypatch, forge=None):
    """Wrap _Drafter.draft: record (n, drafts [B, s]) per step, n the position of the token the step verifies from
    (the prompt length first, then + the tokens the previous step committed); `forge(token [B], s)` replaces the
    drafts (the token is the last id the drafter reads: the one the step verifies from)."""
    calls, original, seen = [], speculative._Drafter.draft, [0]

    def draft(self, hidden, ids, valid, s):
        drafts = original(self, hidden, ids, valid, s)
        seen[0] += ids.shape[1]
        if forge is not None:
            drafts = forge(ids[:, -1], s)
        calls.append((seen[0], drafts.clone()))
        return drafts

    monkeypatch.setattr(speculative._Drafter, "draft", draft)
    return calls


def test_acceptance_counts_only_leading_matches_of_active_rows(monkeypatch):
    """The oracle model's next token is f(current token), so forged drafts control every match. Row 0 drafts the
    exact chain f(t), f(f(t)), .. (leading s) and meets EOS after k tokens; row 1 drafts a wrong x then f(x), ..
    (matches that do not lead: 0 accepted, the batch commits one token per verify). Accepted counts row 0's s per
    step while it is unfinished only."""
    model, s = oracle_mtp_model(), 3
    V = model.config.vocab_size
    ids, mask = left_padded(V, [9, 5], seed=3)
    with torch.no_grad():
        f = model(torch.arange(V)[:, None]).logits[:, -1].argmax(-1)  # [V]: the pick after each token
    plain = model.generate(ids, mask, max_new_tokens=NEW_DRAFTS)
    P, k = ids.shape[1], 4
    eos = int(plain[0, P + k])
    assert eos not in plain[0, P : P + k].tolist() and eos not in plain[1, P:].tolist()  # the setup's premise

    def forge(token, s):
        first = f[token].clone()
        first[1] = (first[1] + 1) % V
        chain = [first]
        for _ in range(s - 1):
            chain.append(f[chain[-1]])
        return torch.stack(chain, dim=1)

    _recording_drafter(monkeypatch, forge)
    fast, stats = model.generate(
        ids,
        mask,
        max_new_tokens=NEW_DRAFTS,
        eos_token_id=eos,
        speculative="mtp",
        num_speculative_tokens=s,
        return_stats=True,
    )
    assert torch.equal(fast, model.generate(ids, mask, max_new_tokens=NEW_DRAFTS, eos_token_id=eos))
    assert stats.verify_forwards == NEW_DRAFTS - 1  # a = 0 each step: the pick after the token only
    assert stats.accepted == s * k  # row 0 in steps 1 .. k (it emits EOS in step k)
    assert stats.drafted == s * (2 * k + (NEW_DRAFTS - 1 - k))


@torch.no_grad()
def _mtp_logits(model, seq: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """seq [B, n + 1] -> the MTP layer's logits [B, V] at its last position (h_{n-1}, t_n), uncached."""
    hidden = model.model(seq[:, :-1], valid[:, :-1].long())
    layer = model.mtp.layer_for(1)
    h = layer(hidden, model.model.embed_tokens(seq[:, 1:]), ForwardContext(valid=valid[:, :-1]))
    return model.lm_head(layer.shared_head.norm(h[:, -1])).float()


@pytest.mark.parametrize("s", [2, 3])
def test_first_draft_is_the_uncached_mtp_pick(setup, monkeypatch, s):
    model, ids, mask = setup
    calls = _recording_drafter(monkeypatch)
    fast = model.generate(ids, mask, max_new_tokens=NEW_DRAFTS, speculative="mtp", num_speculative_tokens=s)
    assert len(calls) >= 3  # several steps, so a rewind matters
    valid = torch.cat([mask, torch.ones(mask.shape[0], NEW_DRAFTS, dtype=mask.dtype)], dim=1).bool()
    for n, drafts in calls:
        logits = _mtp_logits(model, fast[:, : n + 1], valid[:, : n + 1])  # [B, V]
        # the drafted token's logit is the largest (up to rounding: no dependence on exact argmax ties)
        picked = logits.gather(1, drafts[:, :1]).squeeze(1)
        assert torch.all(picked >= logits.max(-1).values - 1e-4), (n, drafts[:, 0], logits.argmax(-1))
