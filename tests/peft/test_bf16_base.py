"""A frozen base held in bf16 (glm53.peft.hold_bf16, load_base(cls, dir, "bf16", dtype=torch.float32),
`glm53 train --base-dtype bf16`): the frozen text linears and experts at 2 bytes a weight in memory, the same numbers
as the fp32-held model of the same bf16 values, the held set chosen by what the run freezes, the merged export, and
the one-process CLI run. Checkpoints: tests/helpers/checkpoints.py's tiny config (hidden 36), saved in bf16."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.nn.functional as F

import glm53
from glm53 import Glm53ForCausalLM
from glm53.__main__ import main
from glm53.peft import cli as peft_cli
from glm53.peft import load_base, load_lora
from glm53.peft.files import WEIGHTS_FILE
from glm53.peft.fp8_storage import base_weights, fp8_modules, held_parameters, hold_bf16, vocab_tables
from glm53.precision import keeps_fp32
from glm53.training import trainer
from tests.helpers.checkpoints import random_model, read_all, tiny_config
from tests.peft.helpers import EPS32, ids, randomize_adapters, rel_err

RANK, ALPHA, D = 4, 8, 36  # adapters; D: the tiny config's hidden size (the longest reduction of a linear)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16") / "ckpt"
    random_model(tiny_config(), seed=3).save_pretrained(path, dtype=torch.bfloat16)
    return path


@pytest.fixture(scope="module")
def pair(bf16_ckpt):
    """(the bf16-held model, the fp32-held model of the same checkpoint)."""
    return (
        load_base(Glm53ForCausalLM, bf16_ckpt, "bf16", dtype=torch.float32),
        Glm53ForCausalLM.from_pretrained(bf16_ckpt, dtype=torch.float32).eval(),
    )


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _eligible(model) -> set[str]:
    """What hold_bf16 may hold: the weights an FP8 release stores in FP8, the text embedding and the head."""
    modules = {**fp8_modules(model), **vocab_tables(model)}
    return {f"{m}.{p}" for m, module in modules.items() for p in base_weights(module)}


def test_frozen_base_is_held_in_bf16(pair):
    model, ref = pair
    held = held_parameters(model, "bf16")
    assert set(held) == _eligible(model) and len(held) > 40
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(held)  # the vocab tables too (untied here)
    assert sum(n.endswith(".mlp.experts.gate_up_proj") for n in held) == 3  # the 3 MoE layers' fused experts
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in held.values())
    numel = sum(p.numel() for p in held.values())
    # exactly the held weights went from 4 bytes to 2; norms, router, keep-list stay fp32
    assert _bytes(model) == _bytes(ref) - 2 * numel
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == (torch.bfloat16 if name in held else torch.float32), name
        assert torch.equal(p.float(), ref_params[name]), name  # the checkpoint's values, exactly
    tied = random_model(tiny_config(tie_word_embeddings=True))
    tied.requires_grad_(False)
    held_tied = hold_bf16(tied)  # one table in two modules: holding it in one would untie them
    assert held_tied and not {"model.embed_tokens.weight", "lm_head.weight"} & set(held_tied)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    adapted = copy.deepcopy(model)
    glm53.apply_lora(adapted, RANK, ALPHA)
    assert {p.dtype for n, p in adapted.named_parameters() if "lora_" in n} == {torch.float32}


def test_forward_and_adapter_gradients_equal_the_fp32_held_model(pair):
    model, ref = (copy.deepcopy(m) for m in pair)
    x = ids(T=17)
    with torch.no_grad():
        # bf16 -> fp32 is exact: the widened weight IS the fp32 model's weight, through the same matmuls (the
        # embedding's rows gathered in bf16 and widened, the head's matmul on the widened table)
        rows = model.model.embed_tokens(x)
        assert rows.dtype == torch.float32 and torch.equal(rows, ref.model.embed_tokens(x))
        assert torch.equal(model(x).logits, ref(x).logits)
        assert torch.equal(model(x, labels=x).loss, ref(x, labels=x).loss)  # the chunked head + loss kernel
    grads = []
    for m in (model, ref):
        torch.manual_seed(0)
        glm53.apply_lora(m, RANK, ALPHA)
        randomize_adapters(m)
        m.train()
        m(x, labels=x).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    n_modules = len(model.lora_settings["modules"])
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 43 + 2 * 3 and n_modules == 43
    # the held linear's backward is the same matmul (grad @ W) on the same W; an order of summation that differs
    # costs one fp32 rounding per reduction step over the D + r long sums: (D + r) eps relative
    for name in grads[0]:
        assert grads[0][name].abs().max() > 0, name
        assert rel_err(grads[0][name], grads[1][name]) <= (D + RANK) * EPS32, name


def test_held_linear_saves_only_bf16_for_backward():
    model = random_model(tiny_config())
    model.requires_grad_(False)
    hold_bf16(model)
    q_a = model.model.layers[1].self_attn.q_a_proj
    x = torch.randn(5, D, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = q_a(x)
    assert [t.dtype for t in saved] == [torch.bfloat16]  # the held weight itself: no fp32 copy kept
    assert y.dtype == torch.float32
    y.backward(torch.ones_like(y))
    x2 = x.detach().clone().requires_grad_()
    F.linear(x2, q_a.weight.float()).backward(torch.ones_like(y))
    assert torch.equal(x.grad, x2.grad)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--init")
    p.add_argument("--bias-rate", type=float, default=0.0)
    peft_cli.add_lora_arguments(p)
    return p.parse_args(argv)


def test_what_is_held_follows_what_the_run_freezes(tmp_path):
    """An fp32 checkpoint: held weights are its values rounded to bf16 once; weights that train keep them exactly."""
    random_model(tiny_config(), seed=4).save_pretrained(tmp_path / "fp32", dtype=torch.float32)
    stored = {k: v for k, v in Glm53ForCausalLM.from_pretrained(tmp_path / "fp32").named_parameters()}
    init = str(tmp_path / "fp32")
    # LoRA with --freeze experts: only the experts are frozen, so only they are held; attention trains in fp32
    model = peft_cli.build_model(
        _args("--init", init, "--lora-rank", "2", "--base-dtype", "bf16", "--freeze", "experts")
    )
    held = held_parameters(model, "bf16")
    assert sorted(held) == sorted(n for n in _eligible(model) if ".mlp.experts." in n) and len(held) == 6
    for name, p in model.named_parameters():
        if name in held:
            assert torch.equal(p, stored[name].to(torch.bfloat16)), name
        elif "lora_" not in name:
            assert p.dtype == torch.float32 and torch.equal(p, stored[name]), name
    q_a = model.model.layers[1].self_attn.q_a_proj.weight
    assert q_a.requires_grad and q_a.dtype == torch.float32
    # LoRA alone: the whole base is frozen, every eligible weight held
    model = peft_cli.build_model(_args("--init", init, "--lora-rank", "2", "--base-dtype", "bf16"))
    assert set(held_parameters(model, "bf16")) == _eligible(model)
    # --freeze with --base-dtype bf16: the frozen groups' weights held
    model = peft_cli.build_model(_args("--init", init, "--freeze", "attention", "--base-dtype", "bf16"))
    held = held_parameters(model, "bf16")
    assert held and all(".self_attn." in n for n in held)
    # the decision for no --base-dtype: frozen groups stay in the training precision (fp32), the checkpoint exactly
    for argv in (["--freeze", "attention"], ["--lora-rank", "2"]):
        model = peft_cli.build_model(_args("--init", init, *argv))
        assert not held_parameters(model, "bf16") and all(p.dtype == torch.float32 for p in model.parameters())


def test_merged_export_from_bf16_base(pair, tmp_path):
    model = copy.deepcopy(pair[0])
    glm53.apply_lora(model, RANK, ALPHA)
    randomize_adapters(model)
    x = ids(T=9)
    with torch.no_grad():
        unmerged = model(x).logits
        exact = copy.deepcopy(model)
        glm53.merge_lora(exact, dtype=torch.float32)
        # merged W + s B A in fp32 vs the two matmuls: (D + r) roundings per linear, through a 4-layer stack
        assert rel_err(exact(x).logits, unmerged) <= 4 * (D + RANK) * EPS32
    kv_b = model.model.layers[1].self_attn.kv_b_proj
    expected = (kv_b.weight.float() + kv_b.lora_scale * kv_b.lora_B.weight @ kv_b.lora_A.weight).to(torch.bfloat16)
    glm53.merge_lora(model)  # widen, merge, bf16
    assert kv_b.weight.dtype == torch.bfloat16 and torch.equal(kv_b.weight, expected)
    assert not held_parameters(model, "bf16") and not hasattr(kv_b, "lora_A")
    stored = read_all(model.save_pretrained(tmp_path / "merged"))
    assert torch.equal(stored["model.language_model.layers.1.self_attn.kv_b_proj.weight"], kv_b.weight)


def test_bf16_base_cli_run_holds_bf16_and_exports_merged(bf16_ckpt, tmp_path, monkeypatch, capsys):
    seen = {}
    run = trainer.Trainer.run

    def recording(self):
        params = dict(self.model.named_parameters())
        seen.update(
            held=set(held_parameters(self.model, "bf16")),
            eligible=_eligible(self.model),
            dtypes={n: p.dtype for n, p in params.items()},
            optimized={id(p) for g in self.optimizer.param_groups for p in g["params"]},
            adapters={id(p) for n, p in params.items() if "lora_" in n},
        )
        return run(self)

    monkeypatch.setattr(trainer.Trainer, "run", recording)
    argv = ["train", "--init", str(bf16_ckpt), "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--steps", "2"]
    argv += ["--batch-size", "2", "--seq-len", "16", "--save", str(tmp_path / "a")]
    assert main([*argv, "--base-dtype", "bf16", "--export-merged", str(tmp_path / "merged")]) == 0
    assert seen["held"] == seen["eligible"] and len(seen["held"]) > 40
    assert all(d == (torch.bfloat16 if n in seen["held"] else torch.float32) for n, d in seen["dtypes"].items())
    assert seen["optimized"] == seen["adapters"]  # AdamW holds only the fp32 adapters
    # the merged export is the saved adapter folded into the bf16 base (widened, W + s B A in fp32, rounded once)
    model = load_base(Glm53ForCausalLM, bf16_ckpt, "bf16", dtype=torch.float32)
    load_lora(model, tmp_path / "a")
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    glm53.merge_lora(model)
    merged = dict(Glm53ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).named_parameters())
    base = dict(Glm53ForCausalLM.from_pretrained(bf16_ckpt, dtype=torch.float32).named_parameters())
    for name, p in model.named_parameters():
        want = p if keeps_fp32(name) else p.to(torch.bfloat16).float()  # the saver keeps the keep-list fp32
        assert torch.equal(merged[name], want), name
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    assert not torch.equal(merged[kv_b], base[kv_b])  # the adapter moved it
    # resume (the base re-read from the path the adapter config records, no --init): held in bf16 again
    seen.clear()
    resume = ["train", "--resume", str(tmp_path / "a"), "--lora-rank", str(RANK), "--base-dtype", "bf16"]
    assert main([*resume, "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--save", str(tmp_path / "b")]) == 0
    assert seen["held"] == seen["eligible"] and seen["optimized"] == seen["adapters"]
    assert (tmp_path / "b" / WEIGHTS_FILE).is_file()
    capsys.readouterr()
