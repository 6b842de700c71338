"""Whole model on the fast (eager) kernels: equal to transformers, and its gradients equal the reference path's."""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels import backends, chosen_backend, use_backend
from tests.helpers.oracle import hf_model

REL_TOL = 1e-4
FAST_OPS = (
    "kda",
    "sparse_attention",
    "sparse_mqa_attention",
    "moe_experts",
    "indexer_scores",
    "indexer_topk_pools",
    "hc_collapse",
    "hc_mix",
    "hc_project",
    "sinkhorn",
    "causal_conv1d",
    "rms_norm",
    "gated_rms_norm",
)

CASES = {
    # T=70 > one KDA chunk (64), not a multiple of it or of the k-pool (4); sparse since T >> index_topk (8)
    # 16 indexer heads: tie-free scores, so transformers' torch.topk and glm53's tie rule pick the same pools
    "bounded-gate-T70-leftpad": dict(config=dict(index_n_heads=16), T=70),
    "softplus-gate-T70-leftpad": dict(config=dict(linear_lower_bound=None, index_n_heads=16), T=70),
}


def make_inputs(vocab: int, T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, T), generator=gen)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, : T // 5] = 0  # left padding on the second row
    ids[mask == 0] = 0
    return ids, mask


def assert_close_on_valid(ours, ref, mask, rel=REL_TOL):
    valid = mask.bool()
    err = (ours - ref)[valid].abs().max().item()
    scale = ref[valid].abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3e} exceeds {rel:g} x {scale:.3e}"


def test_fast_backends_are_the_default():
    for op in FAST_OPS:
        assert "fast" in backends(op) and chosen_backend(op) == "fast", op


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fast_logits_match_transformers(tmp_path, case):
    spec = CASES[case]
    config = Glm53Config.tiny(**spec["config"])
    hf = hf_model(config, seed=1)
    hf.save_pretrained(tmp_path)
    ours = Glm53ForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = make_inputs(config.vocab_size, spec["T"])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert_close_on_valid(got, ref, mask)


def test_fast_training_gradients_match_reference_kernels():
    """One training step's loss and every parameter gradient: fast kernels vs the reference kernels."""
    config = Glm53Config.tiny(num_hidden_layers=4)
    model = Glm53ForCausalLM(config)
    ids, mask = make_inputs(config.vocab_size, 70)
    labels = ids.masked_fill(mask == 0, -100)

    def step():
        model.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fast_loss, fast_grads = step()
    with use_backend("reference"):
        ref_loss, ref_grads = step()
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert fast_grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(
            fast_grads[name],
            ref,
            rtol=1e-3,
            atol=1e-5 * max(1.0, ref.abs().max().item()),
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "per-head"])
def test_mla_absorbed_and_per_head_forms_agree(absorb):
    """Both MLA attention forms, fast kernels, equal the reference per-head form (forward and gradients)."""
    from glm53.model.context import ForwardContext
    from glm53.model.mla import MultiHeadLatentAttention

    config = Glm53Config.tiny()
    attn = MultiHeadLatentAttention(config, layer_idx=3)
    attn.init_weights()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 45, config.hidden_size, requires_grad=True)
    valid = torch.ones(2, 45, dtype=torch.bool)
    valid[1, :7] = False

    def run(absorbed, backend):
        attn.absorb = absorbed
        with use_backend(backend):
            out, topk = attn(x, ForwardContext(valid=valid))
        grad = torch.autograd.grad(out[valid].square().sum(), [x, *attn.parameters()], allow_unused=True)
        return out, topk, grad

    out, topk, grad = run(absorb, "fast")
    ref_out, ref_topk, ref_grad = run(False, "reference")
    assert torch.equal(topk.sort(-1).values, ref_topk.sort(-1).values) and (topk == -1).any()
    torch.testing.assert_close(out[valid], ref_out[valid], rtol=1e-4, atol=1e-5)
    for g, r in zip(grad, ref_grad):
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
