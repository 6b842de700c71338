"""from_transformers_state_dict on keys outside the text model: vision keys are dropped, anything else is refused
with every offending key named; the conv split and the gate rename go to the right glm53 names. from_transformers
keeps the transformers model's dtype and refuses an incomplete state."""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import from_transformers_state_dict
from glm53.errors import CheckpointError
from tests.helpers.checkpoints import tiny_config
from tests.helpers.oracle import hf_model

T = "model.language_model."


def test_unknown_keys_are_refused_by_name():
    state = {
        "lm_head.weight": torch.zeros(2),
        "model.visual.blocks.0.w": torch.zeros(1),
        "transformer.h.0.w": torch.zeros(1),
        "model.other.w": torch.zeros(1),
    }
    with pytest.raises(
        CheckpointError,
        match=r"outside the text model and vision tower:\n  model\.other\.w\n  "
        r"transformer\.h\.0\.w$",
    ):
        from_transformers_state_dict(state)


def test_conv_thirds_and_gate_names():
    conv, dt_bias = torch.arange(12.0).view(6, 1, 2), torch.ones(2)  # conv: q rows 0-1, k rows 2-3, v rows 4-5
    state = {
        f"{T}layers.0.self_attn.conv1d.weight": conv,
        f"{T}layers.0.self_attn.forget_gate.dt_bias": dt_bias,
        "model.visual.patch.w": torch.zeros(1),
        "lm_head.weight": torch.zeros(3),
    }
    out = from_transformers_state_dict(state)
    attn = "model.layers.0.self_attn."
    assert sorted(out) == [
        "lm_head.weight",
        f"{attn}dt_bias",
        f"{attn}k_conv1d.weight",
        f"{attn}q_conv1d.weight",
        f"{attn}v_conv1d.weight",
    ]
    for i, part in enumerate("qkv"):
        assert torch.equal(out[f"model.layers.0.self_attn.{part}_conv1d.weight"], conv[2 * i : 2 * i + 2])
    assert out["model.layers.0.self_attn.dt_bias"] is dt_bias


@pytest.fixture(scope="module")
def hf_bf16():
    return hf_model(tiny_config(), seed=5).to(torch.bfloat16)


def test_from_transformers_takes_the_dtype_of_the_transformers_model(hf_bf16):
    model = Glm53ForCausalLM.from_transformers(hf_bf16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.A_log.dtype == torch.float32  # the fp32 keep-list (precision.py)
    assert torch.equal(model.lm_head.weight, hf_bf16.lm_head.weight)


def test_from_transformers_never_range_checks_the_memory_it_has_not_filled_yet(hf_bf16, monkeypatch):
    """to_empty's memory is whatever was there before (an inf now and then: once a failing run of the suite); the
    conversion must cast it without reading it and then hold the transformers values only."""
    to_empty = torch.nn.Module.to_empty

    def garbage(module, *, device, recurse=True):
        out = to_empty(module, device=device, recurse=recurse)
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.is_floating_point():
                    tensor.fill_(float("inf"))
        return out

    monkeypatch.setattr(torch.nn.Module, "to_empty", garbage)
    model = Glm53ForCausalLM.from_transformers(hf_bf16)
    assert torch.equal(model.lm_head.weight, hf_bf16.lm_head.weight)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("build", ["from_transformers", "from_config", "from_pretrained"])
def test_a_bf16_model_is_allocated_in_bf16(hf_bf16, monkeypatch, tmp_path, build):
    """The cast happens on the meta device: when to_empty allocates, every tensor already has its final dtype (bf16,
    the fp32 keep-list aside), so a bf16 model never takes the room of an fp32 copy."""
    seen = {}
    to_empty = torch.nn.Module.to_empty

    def recording(module, *, device, recurse=True):
        if not seen:  # the model itself (to_empty recurses through the children)
            seen.update({n: p.dtype for n, p in module.named_parameters()})
        return to_empty(module, device=device, recurse=recurse)

    monkeypatch.setattr(torch.nn.Module, "to_empty", recording)
    if build == "from_transformers":
        model = Glm53ForCausalLM.from_transformers(hf_bf16)
    elif build == "from_config":
        model = Glm53ForCausalLM.from_config(Glm53Config.from_dict(hf_bf16.config.to_dict()), dtype="bfloat16")
    else:
        hf_bf16.save_pretrained(tmp_path)
        model = Glm53ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert seen == {n: p.dtype for n, p in model.named_parameters()}
    assert seen["model.embed_tokens.weight"] == torch.bfloat16
    assert seen["model.layers.0.self_attn.A_log"] == torch.float32  # the fp32 keep-list


def test_from_transformers_refuses_an_incomplete_state(hf_bf16, monkeypatch):
    full = hf_bf16.state_dict()
    partial = {k: v for k, v in full.items() if k != "model.language_model.norm.weight"}
    monkeypatch.setattr(hf_bf16, "state_dict", lambda: partial)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"model\.norm\.weight\""):
        Glm53ForCausalLM.from_transformers(hf_bf16)
