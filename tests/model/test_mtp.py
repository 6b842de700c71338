"""MTP: loss value against a per-depth computation, shared layer across depths, official-layout load/save.

MTP on sequences shorter than its depth: depth d > T reads only padding (every position's token d ahead is
past the end), contributes no target, and must not change the shapes of the shifted inputs, labels and masks
(the forward's and the trainer's loss denominators', losses/counts.py).

Legend: B batch, T time, d depth (1-based).
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import iter_official_state, mtp_official_state
from glm53.model.context import ForwardContext

B, T = 2, 19  # T not a multiple of the k-pool size


def mtp_config(**overrides):
    base = dict(num_nextn_predict_layers=1, mtp_depth=2, router_aux_loss_coef=0.0)
    base.update(overrides)
    return Glm53Config.tiny(**base)


def test_mtp_loss_matches_per_depth_computation():
    model = Glm53ForCausalLM(mtp_config(mtp_loss_weight=0.3))
    ids = torch.randint(1, 320, (B, T))
    out = model(ids, labels=ids)
    layer = model.mtp.layers[0]
    embeds = model.model.embed_tokens(ids)
    h = out.last_hidden_state
    per_depth = []
    for d in (1, 2):
        # position i reads token i + d and predicts token i + d + 1
        e = torch.cat([embeds[:, d:], torch.zeros(B, d, embeds.shape[-1])], dim=1)
        valid = torch.ones(B, T, dtype=torch.bool)
        valid[:, T - d :] = False
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], dim=-1))
        x = x + layer.self_attn(layer.input_layernorm(x), ForwardContext(valid=valid))[0]
        h = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = model.lm_head(layer.shared_head.norm(h))
        per_depth.append(F.cross_entropy(logits[:, : T - d - 1].flatten(0, 1), ids[:, d + 1 :].flatten()))
    expected = torch.stack(per_depth).mean()
    torch.testing.assert_close(out.mtp_loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, out.lm_loss + 0.3 * expected, rtol=1e-5, atol=1e-6)


def test_one_layer_serves_every_depth_and_gets_both_gradients():
    model = Glm53ForCausalLM(mtp_config(mtp_depth=3))
    assert len(model.mtp.layers) == 1
    assert model.mtp.layer_for(1) is model.mtp.layer_for(3)
    ids = torch.randint(1, 320, (B, T))
    grads = []
    for depth in (1, 3):
        model.mtp.depth = depth
        model.zero_grad()
        model(ids, labels=ids).mtp_loss.backward()
        grads.append(model.mtp.layers[0].eh_proj.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])  # deeper depths reuse (and train) the same layer
    two = Glm53ForCausalLM(mtp_config(num_nextn_predict_layers=2, mtp_depth=3))
    assert [list(two.mtp.layers).index(two.mtp.layer_for(d)) for d in (1, 2, 3)] == [0, 1, 1]


def test_no_mtp_work_without_labels_and_logits_unchanged():
    torch.manual_seed(1)
    with_mtp = Glm53ForCausalLM(mtp_config())
    plain = Glm53ForCausalLM(Glm53Config.tiny(router_aux_loss_coef=0.0))
    plain.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    calls = []
    with_mtp.mtp.register_forward_hook(lambda mod, args, out: calls.append(len(out)))
    ids = torch.randint(1, 320, (B, T))
    for mode in ("eval", "train"):  # without labels the MTP layer never runs, whatever the mode
        getattr(with_mtp, mode)(), getattr(plain, mode)()
        a, b = with_mtp(ids), plain(ids)
        assert torch.equal(a.logits, b.logits) and a.mtp_loss is None and a.loss is None
    assert calls == []
    a, b = with_mtp(ids, labels=ids), plain(ids, labels=ids)  # with labels it runs (one call, mtp_depth 2 runs)
    assert calls == [2] and torch.equal(a.logits, b.logits) and torch.equal(a.lm_loss, b.lm_loss)
    assert b.mtp_loss is None and a.mtp_loss is not None


def _write(path, config, tensors):
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_official_dict(), f)


def test_official_layout_save_and_load(tmp_path):
    config = mtp_config()
    model = Glm53ForCausalLM(config)
    with torch.no_grad():
        model.mtp.layers[0].mlp.gate.e_score_correction_bias.normal_()
    keys = dict(mtp_official_state(model))
    n = config.num_hidden_layers
    prefix = f"model.language_model.layers.{n}."
    for name in (
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_a_proj.weight",
        "self_attn.indexer.wk.weight",
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.experts.7.down_proj.weight",
        "mlp.experts.0.up_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ):
        assert prefix + name in keys, name
    assert all(k.startswith(prefix) for k in keys)
    assert not any("hc_" in k for k in keys)  # the MTP block has no mHC
    assert set(keys) <= {k for k, _ in iter_official_state(model)}
    model.save_pretrained(tmp_path, overwrite=True)
    loaded = Glm53ForCausalLM.from_pretrained(tmp_path)
    assert loaded.mtp_checkpoint_keys == []
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1
    ids = torch.randint(1, 320, (B, T))
    assert torch.equal(model(ids, labels=ids).mtp_loss, loaded(ids, labels=ids).mtp_loss)


def test_checkpoint_without_mtp_tensors_or_without_mtp_module(tmp_path, caplog):
    config = mtp_config()
    model = Glm53ForCausalLM(config)
    state = dict(iter_official_state(model))
    mtp_keys = {k for k, _ in mtp_official_state(model)}
    # transformers drops MTP weights: the module is initialised, with a warning
    _write(tmp_path / "a", config, {k: v for k, v in state.items() if k not in mtp_keys})
    with caplog.at_level(logging.WARNING, logger="glm53.checkpoint"):
        loaded = Glm53ForCausalLM.from_pretrained(tmp_path / "a")
    assert "no MTP tensors" in caplog.text
    assert torch.equal(loaded.mtp.layers[0].hnorm.weight, torch.ones(config.hidden_size))
    # a partial MTP layer is an error naming the missing key
    some = {k: v for k, v in state.items() if not k.endswith(f"layers.{config.num_hidden_layers}.eh_proj.weight")}
    _write(tmp_path / "b", config, some)
    with pytest.raises(ValueError, match="eh_proj"):
        Glm53ForCausalLM.from_pretrained(tmp_path / "b")
    # a model without MTP sets the layer aside, as do shared embedding/head copies inside the MTP layer
    extra = {f"model.language_model.layers.{config.num_hidden_layers}.embed_tokens.weight": model.lm_head.weight}
    _write(tmp_path / "c", config.replace(num_nextn_predict_layers=0), {**state, **extra})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="glm53.checkpoint"):
        plain = Glm53ForCausalLM.from_pretrained(tmp_path / "c")
    assert plain.mtp is None and len(plain.mtp_checkpoint_keys) == len(mtp_keys) + 1
    # ... and says so, at load and again when a save drops them (it used to drop them without a word)
    assert f"holds {len(mtp_keys) + 1} MTP tensors" in caplog.text and "num_nextn_predict_layers=0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="glm53.checkpoint"):
        plain.save_pretrained(tmp_path / "c2")
    assert f"not writing the {len(mtp_keys) + 1} MTP tensors" in caplog.text
    caplog.clear()
    _write(tmp_path / "d", config, {**state, **extra})
    assert len(Glm53ForCausalLM.from_pretrained(tmp_path / "d").mtp_checkpoint_keys) == 1


def test_transformers_parity_unchanged_with_training_fields(tmp_path):
    """transformers' save_pretrained drops MTP; glm53 loads it, logits still equal transformers' eager path."""
    pytest.importorskip("transformers")
    from tests.helpers.oracle import hf_model

    config = Glm53Config.tiny(num_nextn_predict_layers=1, indexer_loss_weight=1.0, router_z_loss_coef=1e-3)
    hf = hf_model(config)
    hf.save_pretrained(tmp_path)
    model = Glm53ForCausalLM.from_pretrained(tmp_path)
    assert model.mtp is not None and model.config.indexer_loss_weight == 1.0
    ids = torch.randint(1, 320, (B, 24))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        for mode in (model.eval, model.train):
            mode()
            out = model(ids, attention_mask=mask, labels=ids)
            torch.testing.assert_close(out.logits[mask.bool()], expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------- sequences shorter than the depth
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
