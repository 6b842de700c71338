"""Activation checkpointing: identical losses, gradients, expert loads and bias updates; blocks really recompute."""

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.model.hyper_connection import HyperConnection

KDA, MLA = "linear_attention", "indexed_attention"


def all_losses_config():
    return Glm53Config.tiny(
        layer_types=[KDA, MLA, KDA, MLA],
        indexer_types=["full", "full", "full", "shared"],
        num_nextn_predict_layers=1,
        mtp_depth=2,
        indexer_loss_weight=1.0,
        router_z_loss_coef=1e-3,
    )


def run(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    loads = [r.counted_load.clone() for r in model.routers()]
    model.update_router_bias(rate=0.01)
    biases = [r.e_score_correction_bias.clone() for r in model.routers()]
    return out, grads, loads, biases


def test_checkpointing_gives_identical_losses_gradients_and_loads():
    model = Glm53ForCausalLM(all_losses_config())
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, 320, (2, 18))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    plain = run(model, ids, mask)
    model.load_state_dict(state)
    model.gradient_checkpointing_enable()
    calls = []
    for module in model.modules():
        if isinstance(module, HyperConnection):
            module.register_forward_pre_hook(lambda *_: calls.append(1))
    ckpt = run(model, ids, mask)
    n_sites = 2 * model.config.num_hidden_layers
    assert len(calls) == 2 * n_sites  # every mHC site ran again in backward: blocks were recomputed
    for part in ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss"):
        assert torch.equal(getattr(plain[0], part), getattr(ckpt[0], part)), part
    for name, grad in plain[1].items():
        torch.testing.assert_close(ckpt[1][name], grad, rtol=1e-6, atol=1e-9, msg=name)
    for a, b in zip(plain[2], ckpt[2]):
        assert torch.equal(a, b)  # counts are not doubled by recomputation
    for a, b in zip(plain[3], ckpt[3]):
        assert torch.equal(a, b)
    model.gradient_checkpointing_disable()
    assert not model.model.gradient_checkpointing and not model.mtp.gradient_checkpointing


def test_checkpointing_is_inactive_without_grad():
    model = Glm53ForCausalLM(Glm53Config.tiny())
    model.gradient_checkpointing_enable()
    ids = torch.randint(1, 320, (1, 12))
    with torch.no_grad():
        out = model(ids)
    model.gradient_checkpointing_disable()
    with torch.no_grad():
        assert torch.equal(out.logits, model(ids).logits)
