"""glm53.peft LoRA: zero-B start, what a step changes, merged == unmerged for every target kind, freezing, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import glm53
from glm53.errors import ConfigError
from glm53.hooks import as_local, local_parts
from glm53.kernels import dispatch
from glm53.kernels.moe import (
    moe_experts_few_token,
    moe_experts_grouped,
    moe_experts_padded,
    moe_experts_reference,
)
from glm53.model.moe import Experts
from glm53.peft import LoraLinear, trainable_parameters
from tests.peft.helpers import (
    EPS32,
    EPS64,
    ids,
    randomize_adapters,
    rel_err,
    tiny_model,
)

RANK, ALPHA = 4, 8


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "per-head"])
def test_zero_B_at_init_gives_the_base_logits_exactly(absorb):
    model = tiny_model()
    model.set_numerics(mla_absorb=absorb)
    x = ids()
    with torch.no_grad():
        base = model(x).logits
    adapted = glm53.apply_lora(model, RANK, ALPHA)
    kinds = {type(m).__name__ for m in model.modules() if hasattr(m, "lora_rank")}
    assert kinds == {"LoraLinear", "Experts"} and len(adapted) == 43
    with torch.no_grad():
        assert torch.equal(model(x).logits, base)
    randomize_adapters(model)
    with torch.no_grad():  # the adapters are in the forward: non-zero B moves the logits
        assert rel_err(model(x).logits, base) > 1e-2


def _step(model, lr=1e-2):
    opt = torch.optim.AdamW(trainable_parameters(model), lr=lr)
    model.train()
    x = ids(T=17)
    loss = model(x, labels=x).loss
    loss.backward()
    opt.step()
    return opt


def test_one_step_changes_only_the_adapters():
    model = tiny_model()
    glm53.apply_lora(model, RANK, ALPHA)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _step(model)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if "lora_" not in name:
            assert p.grad is None and not p.requires_grad, name
            assert torch.equal(p, before[name]), name
    assert all(not torch.equal(params[n], before[n]) for n in params if "lora_B" in n)
    held = {id(p) for p in opt.state}
    assert held == {id(p) for n, p in params.items() if "lora_" in n}  # no optimizer state for the frozen base


def test_freeze_groups_leave_the_rest_training():
    model = tiny_model()
    glm53.apply_lora(model, RANK, ALPHA, freeze_base=False)
    frozen = set(glm53.freeze(model, ["embeddings", "lm_head", "attention", "experts", "mHC", "router"]))
    assert "model.embed_tokens.weight" in frozen and "model.layers.1.mlp.experts.gate_up_proj" in frozen
    assert "model.layers.0.attn_hc.fn" in frozen and "model.layers.1.mlp.gate.weight" in frozen
    assert "model.layers.1.self_attn.q_a_layernorm.weight" in frozen  # attention holds its norms
    assert not any("lora_" in n for n in frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model)
    params = dict(model.named_parameters())
    for name in frozen:
        assert torch.equal(params[name], before[name]) and params[name].grad is None, name
    # unfrozen base: the dense and shared-expert MLPs, the final norm
    for name in (
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.norm.weight",
    ):
        assert not torch.equal(params[name], before[name]), name


def test_freeze_norms_and_vision_groups_by_name():
    model = tiny_model()
    norms = set(glm53.freeze(model, "norms"))
    assert {
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.o_norm.weight",
        "model.layers.1.self_attn.indexer.k_norm.bias",
    } <= norms
    assert all("norm" in n for n in norms)
    assert glm53.freeze(model, ["vision_tower", "projector"]) == []  # known groups, absent from a text model


# ------------------------------------------------------------------------------- merged == unmerged (per kind)
def _linear_bound(module, x, n):
    """Elementwise rounding bound of either form: n eps (|W| |x| + s |B| |A| |x|), n the longest rounding chain
    (the I-long and r-long reductions plus the adds), computed in fp64 from absolute values."""
    W, A, B = (t.detach().double().abs() for t in (module.weight, module.lora_A.weight, module.lora_B.weight))
    ax = x.double().abs()
    return n * EPS32 * (ax @ W.T + module.lora_scale * (ax @ A.T) @ B.T)


def test_merged_equals_unmerged_linear():
    model = tiny_model()
    glm53.apply_lora(model, RANK, ALPHA, targets=["model.layers.1.self_attn.q_a_proj"])
    randomize_adapters(model)
    q_a = model.model.layers[1].self_attn.q_a_proj
    assert isinstance(q_a, LoraLinear)
    x = torch.randn(5, 36, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        unmerged = q_a(x)
        bound = _linear_bound(q_a, x, n=36 + RANK + 2)
        glm53.merge_lora(model)
        assert type(q_a) is torch.nn.Linear and not hasattr(q_a, "lora_A")
        merged = q_a(x)
    assert ((merged.double() - unmerged.double()).abs() <= bound).all()
    assert rel_err(merged, unmerged) > 0 or torch.equal(merged, unmerged)


def _expert_inputs(E=8, k=3, M=23, D=36, seed=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)])
    w = torch.rand(M, k, generator=gen)
    return x, idx, w


@pytest.mark.parametrize("backend", ["fast", "padded", "few_token", "reference"])
def test_merged_equals_unmerged_experts(backend):
    model = tiny_model()
    glm53.apply_lora(model, RANK, ALPHA, targets="experts")
    randomize_adapters(model)
    experts = model.model.layers[1].mlp.experts
    x, idx, w = _expert_inputs()
    with torch.no_grad(), dispatch.use_backend(backend, ["moe_experts"]):
        unmerged = experts(x, idx, w)
        glm53.merge_lora(model)
        merged = experts(x, idx, w)
    # fp32 rounding along the longest chain: the D-long and r-long gate_up reductions, the I-long and r-long down
    # ones, the k-term sum; relative to the output's scale (silu and the clamps are 1-Lipschitz up to 1.1)
    tol = (36 + 16 + 2 * RANK + 3) * EPS32
    assert rel_err(unmerged, merged) <= tol
    assert rel_err(unmerged, experts(x, idx, torch.zeros_like(w)) + 1) > 0


def test_expert_kernels_agree_with_the_loop_reference_forward_and_backward():
    """The grouped, padded and few-token kernels with LoRA terms == the per-expert loop, forward and every gradient."""
    gen = torch.Generator().manual_seed(3)
    E, D, I, r = 8, 36, 16, RANK
    x, idx, w = _expert_inputs()
    gate_up, down = torch.randn(E, 2 * I, D, generator=gen) / 6, torch.randn(E, D, I, generator=gen) / 4
    factors = [
        torch.randn(E, r, D, generator=gen) / 6,
        torch.randn(E, 2 * I, r, generator=gen) / 2,
        torch.randn(E, r, I, generator=gen) / 4,
        torch.randn(E, D, r, generator=gen) / 2,
    ]

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, gate_up, down, *factors)]
        xx, gu, dn, a1, b1, a2, b2 = leaves
        lora = (glm53.hooks.LowRank(a1, b1, 1.5), glm53.hooks.LowRank(a2, b2, 1.5))
        y = fn(xx, idx, w, gu, dn, 0.9, lora=lora)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(4)))
        return [y] + [t.grad for t in leaves]

    ref = run(moe_experts_reference)
    # reductions: D + r (gate_up), I + r (down), k; backward the same lengths transposed, plus the M*k rows summed
    # into the factor gradients (at most 23 * 3 / 8 per expert, ~ 10 here)
    tol = (36 + 16 + 2 * RANK + 3 + 10) * EPS32
    for fn in (moe_experts_grouped, moe_experts_padded, moe_experts_few_token):
        for got, want, label in zip(run(fn), ref, ["y", "x", "gate_up", "down", "A1", "B1", "A2", "B2"]):
            assert rel_err(got, want) <= tol, (fn.__name__, label)


def test_adapter_through_absorbed_attention_and_decode_weights():
    """The absorbed MLA form reads kv_b_proj's weight itself: it sees base + s B A, as the per-head form does."""
    model = tiny_model()
    glm53.apply_lora(model, RANK, ALPHA, targets=["kv_b_proj"])
    randomize_adapters(model)
    kv_b = model.model.layers[1].self_attn.kv_b_proj
    base, low_rank = local_parts(kv_b, "weight")
    assert base is kv_b.weight and low_rank is not None
    expected = kv_b.weight.double() + kv_b.lora_scale * kv_b.lora_B.weight.double() @ kv_b.lora_A.weight.double()
    assert rel_err(as_local(kv_b, "weight"), expected) <= (RANK + 2) * EPS32
    x = ids(T=19)
    with torch.no_grad():
        model.set_numerics(mla_absorb=True)
        absorbed = model(x).logits
        model.set_numerics(mla_absorb=False)
        per_head = model(x).logits
        glm53.merge_lora(model)
        merged = model(x).logits
        model.set_numerics(mla_absorb=True)
        merged_absorbed = model(x).logits
    # fp32: two rewrites of the same sums through a 4-layer stack; the base model's own absorbed-vs-per-head gap
    # is the scale of that rounding (the same forms without adapters), and the adapter must not widen it much
    with torch.no_grad():
        plain = tiny_model()
        plain.set_numerics(mla_absorb=True)
        gap_a = plain(x).logits
        plain.set_numerics(mla_absorb=False)
        base_gap = rel_err(gap_a, plain(x).logits)
    tol = max(4 * base_gap, 64 * EPS32)
    assert rel_err(absorbed, per_head) <= tol
    assert rel_err(absorbed, merged_absorbed) <= tol and rel_err(per_head, merged) <= tol
    assert rel_err(absorbed, gap_a) > 1e-3  # the adapter changed the output


def test_whole_model_merged_equals_unmerged_fp64():
    model = tiny_model(torch.float64)
    glm53.apply_lora(model, RANK, ALPHA, targets=["attention", "mlp", "shared_experts", "experts", "indexer"])
    randomize_adapters(model, std=0.1)
    x = ids(T=21)
    with torch.no_grad():
        unmerged = model(x).logits
        fp32 = tiny_model(torch.float32)
        glm53.apply_lora(fp32, RANK, ALPHA, targets=["attention", "mlp", "shared_experts", "experts", "indexer"])
        fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        rounding = rel_err(fp32(x).logits, unmerged)  # the stack's sensitivity to fp32 rounding
        glm53.merge_lora(model)
        merged = model(x).logits
    # merging re-rounds each weight once: a rounding-level change, at most what the fp32 forward's rounding does
    # scaled down to fp64 (times 4 for the extra rounding of the merged sum)
    assert rel_err(merged, unmerged) <= 4 * rounding * EPS64 / EPS32
    assert not any("lora_" in n for n, _ in model.named_parameters())


def test_generation_decodes_with_the_adapter():
    model = tiny_model()
    glm53.apply_lora(model, RANK, ALPHA)
    randomize_adapters(model, std=0.3)
    prompt = ids(B=2, T=7, seed=5)
    with torch.no_grad():
        adapted = model.generate(prompt, max_new_tokens=6, eos_token_id=[])
        logits = model(adapted).logits
        glm53.merge_lora(model)
        merged = model.generate(prompt, max_new_tokens=6, eos_token_id=[])
    # greedy decoding through the cache paths picks each step's argmax of the full forward
    assert torch.equal(adapted, merged)
    assert torch.equal(adapted[:, 7:], logits[:, 6:-1].argmax(-1))


# ------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("rank", [0, -2, 2.0, True, "4"])
def test_bad_rank(rank):
    with pytest.raises(ConfigError, match="rank"):
        glm53.apply_lora(tiny_model(), rank, 8)


@pytest.mark.parametrize("alpha", ["8", float("nan"), True, [8]])
def test_bad_alpha(alpha):
    with pytest.raises(ConfigError, match="alpha"):
        glm53.apply_lora(tiny_model(), 4, alpha)


@pytest.mark.parametrize("dropout", [1.0, -0.1, "0"])
def test_bad_dropout(dropout):
    with pytest.raises(ConfigError, match="dropout"):
        glm53.apply_lora(tiny_model(), 4, 8, dropout=dropout)


def test_targets_matching_nothing_are_named():
    with pytest.raises(ConfigError, match=r"\['no_such_proj', 'projector'\]"):
        glm53.apply_lora(tiny_model(), 4, 8, targets=["q_a_proj", "no_such_proj", "projector"])
    with pytest.raises(ConfigError, match="input_layernorm.*RMSNorm"):
        glm53.apply_lora(tiny_model(), 4, 8, targets=["model.layers.0.input_layernorm"])
    with pytest.raises(ConfigError, match="targets must be"):
        glm53.apply_lora(tiny_model(), 4, 8, targets=[])


def test_twice_and_unknown_freeze_group():
    model = tiny_model()
    glm53.apply_lora(model, 4, 8)
    with pytest.raises(ConfigError, match="already has LoRA"):
        glm53.apply_lora(model, 4, 8)
    with pytest.raises(ConfigError, match=r"unknown freeze groups \['attn'\]"):
        glm53.freeze(model, ["attention", "attn"])


def test_dropout_applies_in_training_only():
    model = tiny_model()
    glm53.apply_lora(model, RANK, ALPHA, dropout=0.5, targets=["q_a_proj"])
    randomize_adapters(model)
    q_a = model.model.layers[1].self_attn.q_a_proj
    x = torch.randn(4, 36)
    with torch.no_grad():
        full = F.linear(x, q_a.weight) + q_a.lora_scale * q_a.lora_B(q_a.lora_A(x))
        assert torch.equal(q_a(x), full)
        q_a.train()
        torch.manual_seed(0)
        assert not torch.equal(q_a(x), full)
    assert isinstance(model.model.layers[1].mlp.experts, Experts)
