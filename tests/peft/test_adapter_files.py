"""Adapter files in peft's format: glm53 -> peft on transformers' glm5_next, peft -> glm53, glm53's round trip,
bad input. Tiny models whose base weights come from transformers (tests/helpers/oracle.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import glm53
from glm53 import Glm53ForCausalLM
from glm53.errors import CheckpointError, ConfigError
from glm53.peft.files import CONFIG_FILE, WEIGHTS_FILE
from tests.helpers.checkpoints import tiny_config
from tests.helpers.oracle import hf_model
from tests.model.test_model_parity import (
    REL_TOL,  # the whole-model transformers parity tolerance
)
from tests.peft.helpers import ids, randomize_adapters, rel_err

peft = pytest.importorskip("peft")

TEXT_TARGETS = (
    r"model\.language_model\..*\.(q_a_proj|kv_b_proj|o_proj|q_proj|f_a_proj|g_b_proj|gate_proj"
    r"|down_proj|wq_b)"
)


def _pair(seed: int = 1):
    hf = hf_model(tiny_config(), seed=seed)
    return hf, Glm53ForCausalLM.from_transformers(hf).eval()


def test_glm53_adapter_loads_in_peft_with_the_same_logits(tmp_path):
    hf, model = _pair()
    glm53.apply_lora(model, 4, 8)  # attention (MLA + KDA), dense + shared MLPs, routed experts
    randomize_adapters(model)
    x = ids(T=17)
    with torch.no_grad():
        ours = model(x).logits
    glm53.save_lora(model, tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert "model.language_model.layers.0.self_attn.forget_gate.f_a_proj" in config["target_modules"]
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in config["target_parameters"]
    wrapped = peft.PeftModel.from_pretrained(hf, tmp_path)
    with torch.no_grad():
        theirs = wrapped(input_ids=x).logits
        base = wrapped.get_base_model()
        with wrapped.disable_adapter():
            plain = base(input_ids=x).logits
    assert rel_err(ours, theirs) <= REL_TOL
    assert rel_err(theirs, plain) > 1e-2  # peft applied the adapters (experts included)


def test_peft_adapter_loads_in_glm53_with_peft_logits(tmp_path):
    hf, model = _pair(seed=2)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=16,
        target_modules=TEXT_TARGETS,
        init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    wrapped = peft.get_peft_model(hf, config)
    x = ids(T=19, seed=3)
    with torch.no_grad():
        theirs = wrapped(input_ids=x).logits
    wrapped.save_pretrained(tmp_path)
    names = glm53.load_lora(model, tmp_path)
    assert "model.layers.0.self_attn.f_a_proj" in names and "model.layers.1.mlp.experts" in names
    assert "model.layers.1.self_attn.indexer.wq_b" in names
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj_lora_B.abs().min() > 0  # peft's non-zero B arrived, per expert
    with torch.no_grad():
        ours = model(x).logits
    assert rel_err(ours, theirs) <= REL_TOL


def test_peft_adapter_on_one_expert_parameter(tmp_path):
    hf, model = _pair(seed=4)
    config = peft.LoraConfig(
        r=2, lora_alpha=2, target_modules=None, init_lora_weights=False, target_parameters=["mlp.experts.down_proj"]
    )
    wrapped = peft.get_peft_model(hf, config)
    x = ids(T=11, seed=5)
    with torch.no_grad():
        theirs = wrapped(input_ids=x).logits
    wrapped.save_pretrained(tmp_path)
    glm53.load_lora(model, tmp_path)
    experts = model.model.layers[1].mlp.experts
    assert hasattr(experts, "down_proj_lora_A") and not hasattr(experts, "gate_up_proj_lora_A")
    with torch.no_grad():
        assert rel_err(model(x).logits, theirs) <= REL_TOL


def test_glm53_round_trip_is_exact(tmp_path):
    _, model = _pair()
    glm53.apply_lora(model, 3, 5.5, targets=["attention", "experts", "shared_experts"])
    randomize_adapters(model)
    glm53.save_lora(model, tmp_path)
    _, fresh = _pair()
    glm53.load_lora(fresh, tmp_path)
    saved = {n: p for n, p in model.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in fresh.named_parameters() if "lora_" in n}
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[n], loaded[n]) for n in saved)
    assert fresh.lora_settings["alpha"] == 5.5 and not any(
        p.requires_grad for n, p in fresh.named_parameters() if "lora_" not in n
    )
    x = ids()
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, model(x).logits)
    glm53.load_lora(fresh, tmp_path)  # into matching adapters: allowed, same values


def test_adapter_for_another_model_or_rank(tmp_path):
    _, model = _pair()
    glm53.apply_lora(model, 4, 8, targets=["q_a_proj", "experts"])
    glm53.save_lora(model, tmp_path)
    other = Glm53ForCausalLM.from_config(tiny_config(q_lora_rank=24))  # q_a_proj is 24 x 36 there
    with pytest.raises(CheckpointError, match=r"q_a_proj: lora_B has shape \(20, 4\).*\(24, 4\)"):
        glm53.load_lora(other, tmp_path)
    ranked = Glm53ForCausalLM.from_config(tiny_config())
    glm53.apply_lora(ranked, 2, 8, targets=["q_a_proj", "experts"])
    with pytest.raises(CheckpointError, match="rank r=4.*rank 2"):
        glm53.load_lora(ranked, tmp_path)
    shallow = Glm53ForCausalLM.from_config(
        tiny_config(
            num_hidden_layers=2,
            layer_types=["linear_attention", "indexed_attention"],
            indexer_types=["full", "full"],
            mlp_layer_types=["dense", "sparse"],
        )
    )
    with pytest.raises(CheckpointError, match=r"(?s)does not have.*language_model\.layers\.2\."):
        glm53.load_lora(shallow, tmp_path)


def test_bad_adapter_files(tmp_path):
    _, model = _pair()
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        glm53.load_lora(model, tmp_path / "missing")
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        glm53.save_lora(model, tmp_path / "none")
    glm53.apply_lora(model, 4, 8, targets=["q_a_proj"])
    glm53.save_lora(model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    for key, value, message in [
        ("use_dora", True, "use_dora"),
        ("peft_type", "IA3", "peft_type"),
        ("rank_pattern", {"q_a_proj": 8}, "rank_pattern"),
        ("bias", "all", "bias"),
    ]:
        (tmp_path / "b").mkdir(exist_ok=True)
        (tmp_path / "b" / CONFIG_FILE).write_text(json.dumps({**config, key: value}))
        os.replace(tmp_path / "a" / WEIGHTS_FILE, tmp_path / "b" / WEIGHTS_FILE) if not (
            tmp_path / "b" / WEIGHTS_FILE
        ).exists() else None
        fresh = Glm53ForCausalLM.from_config(tiny_config())
        with pytest.raises(CheckpointError, match=message):
            glm53.load_lora(fresh, tmp_path / "b")
