"""MTP on sequences shorter than its depth: depth d > T reads only padding (every position's token d ahead is
past the end), contributes no target, and must not change the shapes of the shifted inputs, labels and masks
(the forward's and the trainer's loss denominators', losses/counts.py).

Legend: B batch, T time, d depth (1-based).
"""

from __future__ import annotations

import torch

from glm53 import Glm53Config, Glm53ForCausalLM


def test_depth_beyond_the_sequence_adds_nothing_and_runs_backward():
    torch.manual_seed(0)
    config = Glm53Config.tiny(num_nextn_predict_layers=1, mtp_depth=4, router_aux_loss_coef=0.0)
    model = Glm53ForCausalLM(config)
    ids = torch.randint(1, 320, (2, 3))  # depth 1 has one target per row (position 0 predicts token 2)
    model.mtp.depth = 1
    shallow = model(ids, labels=ids).mtp_loss
    model.mtp.depth = 4  # depths 2..4 have none; depth 4 > T
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.mtp_loss * 4, shallow, rtol=1e-5, atol=1e-6)  # the mean over depths
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    two = model(ids[:, :2], labels=ids[:, :2])  # no depth has a target
    assert two.mtp_loss == 0 and torch.isfinite(two.loss)
    counts = model.loss_counts(ids)  # views: the main head, then depths 1..4
    assert counts.targets.tolist() == [4, 2, 0, 0, 0]
    assert counts.tokens.tolist() == [6, 4, 2, 0, 0]  # valid tokens whose token d ahead exists


def test_mtp_norms_are_not_interchangeable():
    """enorm normalises the embeddings and hnorm the hidden states (the release's order in eh_proj's input), and
    each sub-block reads its own norm: with distinct norm weights (all init to ones, which hides a swap) the
    depth-1 loss is the hand-written one."""
    import torch.nn.functional as F

    from glm53.model.context import ForwardContext

    torch.manual_seed(1)
    model = Glm53ForCausalLM(Glm53Config.tiny(num_nextn_predict_layers=1, mtp_depth=1, router_aux_loss_coef=0.0))
    layer = model.mtp.layers[0]
    with torch.no_grad():
        for norm in (
            layer.enorm,
            layer.hnorm,
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.shared_head.norm,
        ):
            norm.weight.uniform_(0.5, 1.5)
    B, T = 2, 9
    ids = torch.randint(1, 320, (B, T))
    out = model(ids, labels=ids)
    e = torch.cat([model.model.embed_tokens(ids)[:, 1:], torch.zeros(B, 1, model.config.hidden_size)], dim=1)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[:, -1] = False
    x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(out.last_hidden_state)], dim=-1))
    x = x + layer.self_attn(layer.input_layernorm(x), ForwardContext(valid=valid))[0]
    h = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = model.lm_head(layer.shared_head.norm(h))
    expected = F.cross_entropy(logits[:, : T - 2].flatten(0, 1), ids[:, 2:].flatten())
    torch.testing.assert_close(out.mtp_loss, expected, rtol=1e-5, atol=1e-6)


def test_each_depth_reads_its_own_layers_shared_head_norm():
    """Two MTP layers: depth 2's logits come through layer 1's shared_head.norm. Zeroing that norm's weight makes
    depth 2's logits 0, so its loss is exactly log(vocab) and depth 1's is unchanged."""
    torch.manual_seed(2)
    config = Glm53Config.tiny(num_nextn_predict_layers=2, mtp_depth=2, router_aux_loss_coef=0.0)
    model = Glm53ForCausalLM(config)
    with torch.no_grad():
        model.mtp.layers[1].shared_head.norm.weight.zero_()
    ids = torch.randint(1, 320, (2, 9))
    model.mtp.depth = 1
    first = model(ids, labels=ids).mtp_loss
    model.mtp.depth = 2
    both = model(ids, labels=ids).mtp_loss
    torch.testing.assert_close(2 * both - first, torch.tensor(float(config.vocab_size)).log(), rtol=1e-5, atol=1e-5)
