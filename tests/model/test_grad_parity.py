"""Gradients equal transformers 5.23.0's: per block (KDA, MLA + indexer, MoE with a grouped router, mHC) and for
the whole model's `lm_loss`, w.r.t. the inputs and every parameter, fp32, randomised weights, left padding,
dense and sparse indexer regimes.

Legend: B batch, T time, N streams, D model width.
Each block is fed the same input and given the same random cotangent on its valid positions (padding positions
are where glm53 and transformers are allowed to differ, README "Padding rows in sparse attention"), then every
gradient is compared by relative L2 error. transformers' fp32 KDA path rounds differently from glm53's chunked
one; the tolerances sit a few times above the error measured on these seeds and far below any wrong term.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as hf

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint.convert import from_transformers_state_dict
from glm53.model.context import ForwardContext
from glm53.model.hyper_connection import HyperConnection
from glm53.model.kda import KimiDeltaAttention
from glm53.model.mla import MultiHeadLatentAttention
from glm53.model.moe import MoE
from tests.helpers.oracle import hf_model
from tests.model.test_blocks import hf_to_glm53_state, padding, pair

BLOCK_RTOL = 1e-5  # relative L2 error of one gradient tensor (MLA, MoE, mHC: measured <= 7e-7)
KDA_RTOL = 1e-4  # KDA: two different fp32 chunked forms (measured <= 1e-5, on dt_bias / A_log)
MODEL_RTOL = 5e-4  # the whole model: the KDA rounding amplified through four layers (measured <= 8e-5)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def assert_grads_match(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], rtol: float):
    """Same names with a non-zero gradient on both sides, and each within `rtol` relative L2 error."""
    nonzero = lambda g: {n for n, t in g.items() if t.abs().max() > 0}  # noqa: E731
    assert nonzero(ours) == nonzero(theirs), nonzero(ours) ^ nonzero(theirs)
    assert nonzero(ours), "nothing got a gradient"
    errors = {n: rel_l2(ours[n], theirs[n]) for n in nonzero(ours)}
    bad = {n: f"{e:.1e}" for n, e in errors.items() if e > rtol}
    assert not bad, f"gradients differ from transformers (relative L2): {bad}"


def block_grads(module: torch.nn.Module, x: torch.Tensor, run, cot: torch.Tensor, rename=None) -> dict:
    """Backward of sum(run(module, x) * cot) -> {"input": dx, parameter name: grad} (names mapped by `rename`)."""
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    (run(module, x) * cot).sum().backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in module.named_parameters()}
    return {"input": x.grad, **(rename(grads) if rename is not None else grads)}


def cotangent(shape, valid: torch.Tensor, seed: int = 7) -> torch.Tensor:
    """A random cotangent, zero at padding positions (valid [B, T])."""
    gen = torch.Generator().manual_seed(seed)
    cot = torch.randn(shape, generator=gen)
    return cot * valid.view(*valid.shape, *([1] * (len(shape) - 2)))


# ----------------------------------------------------------------------------------------------------- KDA
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bound-5", "softplus"])
@pytest.mark.parametrize("T,pad", [(70, "left"), (23, "right")], ids=["T70-left", "T23-right"])
def test_kda_gradients(T, pad, lower_bound):
    config = Glm53Config.tiny(linear_lower_bound=lower_bound)
    ours, theirs = pair(config, hf.Glm5NextTextLinearAttention, KimiDeltaAttention, 0)
    mask = padding(2, T, pad)
    x = torch.randn(2, T, config.hidden_size)
    cot = cotangent(x.shape, mask)
    got = block_grads(ours, x, lambda m, x: m(x, ForwardContext(valid=mask)), cot)
    want = block_grads(theirs, x, lambda m, x: m(x, attention_mask=mask), cot, rename=hf_to_glm53_state)
    assert_grads_match(got, want, KDA_RTOL)
    assert all(got[n].abs().max() > 0 for n in ("A_log", "dt_bias", "q_conv1d.weight", "v_conv1d.weight"))


# ------------------------------------------------------------------------------------------ MLA + indexer
MLA_CASES = {"sparse-T23-left": (23, 8), "dense-T19-left": (19, 64)}  # (T, index_topk)


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "per-head"])
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_with_indexer_gradients(case, absorb):
    T, topk = MLA_CASES[case]
    config = Glm53Config.tiny(layer_types=["indexed_attention"] * 4, index_topk=topk, index_n_heads=16)  # tie-free
    ours, theirs = pair(config, hf.Glm5NextTextAttention, MultiHeadLatentAttention, 0)
    ours.absorb = absorb
    mask = padding(2, T, "left")
    x = torch.randn(2, T, config.hidden_size)
    cot = cotangent(x.shape, mask)
    got = block_grads(ours, x, lambda m, x: m(x, ForwardContext(valid=mask))[0], cot)
    want = block_grads(theirs, x, lambda m, x: m(x, mask)[0], cot)
    assert_grads_match(got, want, BLOCK_RTOL)
    # the indexer is trained only by its KL loss (absent here) in glm53 and never in transformers
    assert all(not g.any() for n, g in got.items() if n.startswith("indexer."))
    selected = ours.indexer(x, ours.q_a_layernorm(ours.q_a_proj(x)), mask)
    sparse = bool(((selected[0] >= 0).sum(-1) < torch.arange(1, T + 1)).any())  # row 0 has no padding
    assert sparse == (topk < T), "the case must be in the regime its name says"


# ----------------------------------------------------------------------------------- MoE, grouped router
MOE_CASES = {
    "groups4-top2-norm": dict(n_group=4, topk_group=2, norm_topk_prob=True, swiglu_limit=0.5),
    "groups2-top1-nonorm-k3": dict(
        n_group=2, topk_group=1, norm_topk_prob=False, num_experts_per_tok=3, routed_scaling_factor=1.5
    ),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_gradients(case):
    config = Glm53Config.tiny(**MOE_CASES[case])
    ours, theirs = pair(config, hf.Glm5NextTextMoE, MoE)
    x = torch.randn(2, 9, config.hidden_size) * 3
    cot = cotangent(x.shape, torch.ones(2, 9, dtype=torch.bool))
    got = block_grads(ours, x, lambda m, x: m(x), cot)
    want = block_grads(theirs, x, lambda m, x: m(x), cot)
    assert_grads_match(got, want, BLOCK_RTOL)
    assert got["gate.weight"].abs().max() > 0  # the routing weights carry a gradient to the router


# ----------------------------------------------------------------------------------------------------- mHC
def run_site(m, streams):
    """One mHC site around m["block"]: enter, the block, exit."""
    x, mix = m["hc"].enter(streams)
    return m["hc"].exit(streams, m["block"](x), mix)


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
@pytest.mark.parametrize("hc_mult", [2, 4], ids=lambda n: f"N{n}")
def test_hyper_connection_site_gradients(hc_mult, recompute):
    """out = post * block(pre . streams) + comb^T @ streams against transformers' coefficients."""
    config = Glm53Config.tiny(hc_mult=hc_mult)
    ours, theirs = pair(config, hf.Glm5NextTextHyperConnection, HyperConnection)
    ours.recompute = recompute
    torch.manual_seed(3)
    block = torch.nn.Sequential(torch.nn.Linear(config.hidden_size, config.hidden_size), torch.nn.Tanh())
    ours_site = torch.nn.ModuleDict({"hc": ours, "block": block})
    theirs_site = torch.nn.ModuleDict({"hc": theirs, "block": block})

    def theirs_run(m, streams):
        post, comb, collapsed = m["hc"](streams)
        return post.unsqueeze(-1) * m["block"](collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)

    streams = torch.randn(2, 6, hc_mult, config.hidden_size)
    cot = cotangent(streams.shape, torch.ones(2, 6, dtype=torch.bool))
    got = block_grads(ours_site, streams, run_site, cot)
    want = block_grads(theirs_site, streams, theirs_run, cot)
    assert_grads_match(got, want, BLOCK_RTOL)


# ----------------------------------------------------------------------------------------------- whole model
def model_pair(overrides: dict, seed: int = 1):
    theirs = hf_model(Glm53Config.tiny(**overrides), seed=seed)
    return Glm53ForCausalLM.from_transformers(theirs), theirs


def left_padded(vocab: int, T: int, pad_id: int, n: int = 7, seed: int = 0):
    """ids [2, T] with row 1 left-padded by n pad tokens, its mask, and labels (-100 at padding)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, T), generator=gen)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :n] = 0
    ids = ids.masked_fill(mask == 0, pad_id)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def model_grads(ours, theirs, ids, mask, labels):
    loss = ours(ids, attention_mask=mask, labels=labels).lm_loss
    loss.backward()
    ref = theirs(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    got = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ours.named_parameters()}
    text = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in theirs.named_parameters()}
    want = from_transformers_state_dict(text)
    assert set(want) == set(got)
    return loss, ref, got, want


@pytest.mark.parametrize("regime", ["sparse", "dense"])
def test_lm_loss_gradients_match_transformers(regime):
    """Every parameter's gradient of lm_loss, left padding; the first real token after the padding is not a
    target (the pad position predicting it reads a padding query, where the two sparse attentions differ)."""
    T, overrides = (24, {}) if regime == "sparse" else (20, dict(index_topk=64))
    ours, theirs = model_pair(overrides)
    ids, mask, labels = left_padded(ours.config.vocab_size, T, ours.config.pad_token_id)
    labels[1, 7] = -100
    loss, ref, got, want = model_grads(ours, theirs, ids, mask, labels)
    torch.testing.assert_close(loss, ref, rtol=2e-6, atol=0)
    assert_grads_match(got, want, MODEL_RTOL)
    assert got["model.embed_tokens.weight"][ours.config.pad_token_id].abs().max() == 0


def test_pad_row_gets_no_gradient_like_transformers():
    """With labels on every real token, the last pad position predicts the first real token: its logits read the
    pad embedding, yet the pad row gets no gradient in either model (padding_idx semantics)."""
    ours, theirs = model_pair({})
    pad = ours.config.pad_token_id
    ids, mask, labels = left_padded(ours.config.vocab_size, 24, pad)
    _, _, got, want = model_grads(ours, theirs, ids, mask, labels)
    assert want["model.embed_tokens.weight"][pad].abs().max() == 0
    assert got["model.embed_tokens.weight"][pad].abs().max() == 0
    assert got["model.embed_tokens.weight"][ids[0, 0]].abs().max() > 0  # the other rows do train
    # the pad embedding does reach the loss: moving it changes lm_loss, only its gradient is suppressed
    with torch.no_grad():
        before = ours(ids, attention_mask=mask, labels=labels).lm_loss
        ours.model.embed_tokens.weight[pad] += 1.0
        after = ours(ids, attention_mask=mask, labels=labels).lm_loss
    assert after != before
