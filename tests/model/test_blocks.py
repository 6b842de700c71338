"""Every glm53 block against its transformers 5.23.0 counterpart, with identical random weights.

Each test builds the transformers module from the same Glm53Config, randomises every parameter and buffer
(tests/helpers/oracle.py `randomize`: A_log, dt_bias, hc base/scale, e_score_correction_bias, norm weights and biases,
indexer ape/gate ...), copies them into the glm53 module by name and compares outputs in fp32.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as hf

from glm53 import Glm53Config
from glm53.kernels import use_backend
from glm53.model.block import DecoderBlock
from glm53.model.context import ForwardContext
from glm53.model.hyper_connection import HyperConnection
from glm53.model.indexer import Indexer
from glm53.model.kda import KimiDeltaAttention
from glm53.model.mla import MultiHeadLatentAttention
from glm53.model.mlp import MLP
from glm53.model.moe import MoE
from glm53.model.norm import GatedRMSNorm, RMSNorm
from tests.helpers.oracle import hf_text_kwargs, randomize

RTOL, ATOL = 1e-5, 1e-5


def hf_config(config: Glm53Config):
    from transformers import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(**hf_text_kwargs(config))
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the per-expert loop, not grouped_mm
    return cfg


def hf_to_glm53_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory names -> glm53 names (forget_gate.* flattened, conv1d split into q/k/v)."""
    out = {}
    for name, t in state.items():
        if name.endswith("conv1d.weight"):
            prefix = name[: -len("conv1d.weight")]
            for part, chunk in zip("qkv", t.chunk(3, dim=0)):
                out[f"{prefix}{part}_conv1d.weight"] = chunk.clone()
        else:
            out[name.replace("forget_gate.", "")] = t.clone()
    return out


def copy_weights(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    state = hf_to_glm53_state(theirs.state_dict())
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)


def pair(config: Glm53Config, hf_cls, our_cls, layer_idx: int | None = None, seed: int = 0):
    """(glm53 module, transformers module) with the same random weights; layer_idx for per-layer modules."""
    hf_args = () if layer_idx is None else (layer_idx,)
    our_args = (layer_idx,) if our_cls in (MultiHeadLatentAttention, DecoderBlock) else ()
    theirs = hf_cls(hf_config(config), *hf_args).eval()
    # randomize() recognises mHC parameters by their "hc" prefix; give a bare mHC module that prefix
    randomize(torch.nn.ModuleDict({"attn_hc": theirs}) if hf_cls is hf.Glm5NextTextHyperConnection else theirs, seed)
    ours = our_cls(config, *our_args).eval()
    copy_weights(ours, theirs)
    return ours, theirs


def padding(B: int, T: int, kind: str) -> torch.Tensor:
    """[B, T] bool: row 0 full, row 1 padded on the `kind` side (and row 2, if any, padded on both)."""
    mask = torch.ones(B, T, dtype=torch.bool)
    if kind == "left":
        mask[1, :5] = False
    elif kind == "right":
        mask[1, -6:] = False
    elif kind != "none":
        raise ValueError(kind)
    return mask


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm(dtype):
    theirs = hf.Glm5NextTextRMSNorm(24, eps=1e-5)
    randomize(theirs, 0)
    ours = RMSNorm(24, eps=1e-5)
    copy_weights(ours, theirs)
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = (torch.randn(3, 5, 24) * 4).to(dtype)
    actual, expected = ours(x), theirs(x)
    assert actual.dtype == expected.dtype == dtype
    assert torch.equal(actual, expected)  # same op order: normalise in fp32, cast back, then scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_rms_norm(dtype):
    theirs = hf.Glm5NextTextRMSNormGated(8, eps=1e-5)
    randomize(theirs, 0)
    ours = GatedRMSNorm(8, eps=1e-5)
    copy_weights(ours, theirs)
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x, gate = (torch.randn(3, 5, 2, 8) * 4).to(dtype), torch.randn(3, 5, 2, 8).to(dtype)
    actual, expected = ours(x, gate), theirs(x, gate)
    assert actual.dtype == expected.dtype == dtype
    assert_close(actual, expected, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------- mHC
@pytest.mark.parametrize("hc_mult", [1, 2, 4], ids=lambda n: f"N{n}")
def test_hyper_connection_coefficients(hc_mult):
    config = Glm53Config.tiny(hc_mult=hc_mult)
    ours, theirs = pair(config, hf.Glm5NextTextHyperConnection, HyperConnection)
    streams = torch.randn(2, 7, hc_mult, config.hidden_size)
    pre, post, comb = ours.coefficients(streams)
    hf_post, hf_comb, hf_collapsed = theirs(streams)
    assert_close(post, hf_post)
    assert_close(comb, hf_comb)
    assert_close(torch.einsum("btn,btnd->btd", pre, streams), hf_collapsed)
    # Sinkhorn ends with a column normalisation: columns sum to 1, rows nearly; pre is not trivially 1
    assert_close(comb.sum(-2), torch.ones(2, 7, hc_mult), rtol=0, atol=1e-4)
    assert_close(comb.sum(-1), torch.ones(2, 7, hc_mult), rtol=0, atol=0.1)
    assert not torch.allclose(pre, torch.ones_like(pre))
    assert (ours.scale - 1).abs().max() < 2 and ours.scale.std() > 0  # scale randomised around 1, like a trained one


@pytest.mark.parametrize("hc_mult", [1, 2, 4], ids=lambda n: f"N{n}")
def test_hyper_connection_site(hc_mult):
    """out = post * block(pre . streams) + comb^T @ streams, as in Glm5NextTextDecoderLayer.forward."""
    config = Glm53Config.tiny(hc_mult=hc_mult)
    ours, theirs = pair(config, hf.Glm5NextTextHyperConnection, HyperConnection)
    block = torch.nn.Sequential(torch.nn.Linear(config.hidden_size, config.hidden_size), torch.nn.Tanh())
    streams = torch.randn(2, 5, hc_mult, config.hidden_size)
    post, comb, collapsed = theirs(streams)
    expected = post.unsqueeze(-1) * block(collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    collapsed, mix = ours.enter(streams)
    assert_close(ours.exit(streams, block(collapsed), mix), expected)


def test_hyper_connection_one_stream_is_a_residual():
    """N = 1, fn = 0, scales 1, pre base large, post base 0: out = block(x) + x up to the eps floors."""
    config = Glm53Config.tiny(hc_mult=1)
    hc = HyperConnection(config)
    with torch.no_grad():
        hc.fn.zero_()
        hc.scale.fill_(1.0)
        hc.base.copy_(torch.tensor([30.0, 0.0, 0.7]))  # pre, post, comb logits
    block = torch.nn.Linear(config.hidden_size, config.hidden_size)
    x = torch.randn(2, 5, 1, config.hidden_size)
    collapsed, mix = hc.enter(x)
    torch.testing.assert_close(
        hc.exit(x, block(collapsed), mix), block(x[:, :, 0])[:, :, None] + x, rtol=1e-5, atol=1e-5
    )


# ----------------------------------------------------------------------------------------------------- KDA
KDA_SHAPES = [(1, "none"), (13, "none"), (13, "left"), (70, "none"), (70, "left"), (70, "right")]


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bound-5", "softplus"])
@pytest.mark.parametrize("T,pad", KDA_SHAPES, ids=[f"T{t}-pad-{p}" for t, p in KDA_SHAPES])
def test_kda_layer(T, pad, lower_bound):
    config = Glm53Config.tiny(linear_lower_bound=lower_bound)
    ours, theirs = pair(config, hf.Glm5NextTextLinearAttention, KimiDeltaAttention, 0)
    x = torch.randn(2, T, config.hidden_size)
    mask = padding(2, T, pad)
    with torch.no_grad():
        expected = theirs(x, attention_mask=None if pad == "none" else mask)
        actual = ours(x, None if pad == "none" else ForwardContext(valid=mask))
    assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    if pad != "none":
        # the mask matters: right padding changes only the padded outputs; left padding changes the padded
        # outputs and the first valid ones (the zeroed prefix no longer enters the conv and the state)
        with torch.no_grad():
            unpadded = ours(x)
        changed = ~torch.isclose(unpadded[1], actual[1], rtol=1e-4, atol=1e-5).all(-1)
        if pad == "right":
            assert torch.equal(changed, ~mask[1])
        else:
            assert changed[:6].all()


def test_kda_layer_bf16():
    """bf16 weights (conv, dt_bias, A_log kept fp32 as transformers keeps them): q, k are L2-normalised in fp32
    and must not be rounded to bf16 before the delta rule (fla and transformers keep them fp32)."""
    config = Glm53Config.tiny(hidden_size=64, linear_num_heads=4, linear_head_dim=32)
    ours, theirs = pair(config, hf.Glm5NextTextLinearAttention, KimiDeltaAttention, 0)
    keep_fp32 = ("conv1d.weight", "dt_bias", "A_log")
    for module in (ours, theirs):
        for name, p in module.named_parameters():
            p.data = p.data.to(torch.float32 if name.endswith(keep_fp32) else torch.bfloat16)
    x = torch.randn(2, 80, config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        actual, expected = ours(x), theirs(x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    relative = (actual.float() - expected.float()).norm() / expected.float().norm()
    assert relative < 5e-4, f"bf16 KDA layer differs from transformers by {relative:.1e} (relative L2)"


def test_kda_layer_recurrent_backend_matches():
    """The layer gives the same output whichever KDA implementation is dispatched."""
    config = Glm53Config.tiny()
    ours, theirs = pair(config, hf.Glm5NextTextLinearAttention, KimiDeltaAttention, 0)
    x = torch.randn(2, 21, config.hidden_size)
    with torch.no_grad():
        expected = theirs(x)
        with use_backend("reference", ["kda"]):
            actual = ours(x)
    assert_close(actual, expected, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------- indexer
def topk_sets(topk: torch.Tensor) -> list[list[frozenset[int]]]:
    return [[frozenset(i for i in row.tolist() if i >= 0) for row in seq] for seq in topk]


INDEXER_CASES = {
    # id: (T, padding, index_topk, tail)
    "T23-sparse-nopad-tail": (23, "none", 8, True),
    "T23-sparse-left-tail": (23, "left", 8, True),
    "T23-sparse-right-tail": (23, "right", 8, True),
    "T22-sparse-left-notail": (22, "left", 8, False),
    "T21-sparse-right-notail": (21, "right", 8, False),
    "T10-dense-left-tail": (10, "left", 16, True),
}


@pytest.mark.parametrize("case", INDEXER_CASES.values(), ids=INDEXER_CASES.keys())
def test_indexer_topk_sets(case):
    T, pad, index_topk, tail = case
    # 16 indexer heads: tie-free ReLU scores, where torch.topk's order and glm53's one tie rule (ties to the earliest
    # pool, tests/model/test_indexer.py) agree; ties are tested on purpose there
    config = Glm53Config.tiny(index_topk=index_topk, index_kpool_always_select_tail=tail, index_n_heads=16)
    ours, theirs = pair(config, hf.Glm5NextTextIndexer, Indexer, 3)
    x = torch.randn(2, T, config.hidden_size)
    q_resid = torch.randn(2, T, config.q_lora_rank)
    mask = padding(2, T, pad)
    expected = theirs(x, q_resid, mask, None)
    actual = ours(x, q_resid, mask)
    assert actual.shape == expected.shape == (2, T, index_topk + (config.index_kpool - 1 if tail else 0))
    got, want = topk_sets(actual), topk_sets(expected)
    for b in range(2):
        for t in range(T):
            assert got[b][t] == want[b][t], f"batch {b} query {t}: {sorted(got[b][t])} != {sorted(want[b][t])}"
    # every selection is causal, avoids padding, and padding queries select nothing
    for b in range(2):
        for t in range(T):
            assert all(i <= t and mask[b, i] for i in got[b][t])
            if not mask[b, t]:
                assert not got[b][t]
    if T > index_topk + config.index_kpool:
        # the sparse regime really is sparse: the last query of the full row sees fewer keys than are visible
        assert len(got[0][T - 1]) < T


def test_indexer_odd_masks():
    """A row padded on both sides and a row of padding only (it selects nothing)."""
    T = 14
    config = Glm53Config.tiny(index_topk=4)
    ours, theirs = pair(config, hf.Glm5NextTextIndexer, Indexer, 3)
    x, q_resid = torch.randn(3, T, config.hidden_size), torch.randn(3, T, config.q_lora_rank)
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, :3] = mask[1, -2:] = False
    mask[2] = False
    actual = ours(x, q_resid, mask)
    assert topk_sets(actual) == topk_sets(theirs(x, q_resid, mask, None))
    assert (actual[2] == -1).all()
    assert set(topk_sets(actual)[1][T - 3]) <= set(range(3, T - 2)) and topk_sets(actual)[1][T - 3]


# ----------------------------------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_mla_full_indexer(pad, bias):
    T = 19
    config = Glm53Config.tiny(layer_types=["indexed_attention"] * 4, attention_bias=bias)
    ours, theirs = pair(config, hf.Glm5NextTextAttention, MultiHeadLatentAttention, 0)
    x = torch.randn(2, T, config.hidden_size)
    mask = padding(2, T, pad)
    with torch.no_grad():
        expected, _, _ = theirs(x, mask)
        actual, topk = ours(x, ForwardContext(valid=mask))
    assert_close(actual[mask], expected[mask])
    assert (ours.q_a_proj.bias is not None) == bias
    assert topk_sets(topk) == topk_sets(theirs.indexer(x, theirs.q_a_layernorm(theirs.q_a_proj(x)), mask, None))


def test_mla_shared_indexer_uses_given_topk():
    T = 15
    config = Glm53Config.tiny(layer_types=["indexed_attention"] * 4, indexer_types=["full", "shared", "full", "full"])
    ours, theirs = pair(config, hf.Glm5NextTextAttention, MultiHeadLatentAttention, 1)
    assert ours.indexer is None and theirs.indexer is None
    x = torch.randn(2, T, config.hidden_size)
    mask = torch.ones(2, T, dtype=torch.bool)
    # a random causal selection: each query keeps a random half of its visible keys, -1 elsewhere
    keep = (torch.rand(2, T, T) < 0.5).tril() | torch.eye(T, dtype=torch.bool)
    topk = torch.where(keep, torch.arange(T), -1)
    with torch.no_grad():
        expected, _, _ = theirs(x, mask, prev_topk_indices=topk)
        actual, returned = ours(x, ForwardContext(valid=mask, shared_topk=topk))
    assert returned is topk
    assert_close(actual, expected)
    with pytest.raises(ValueError, match="shared"):
        ours(x, ForwardContext(valid=mask))


# ----------------------------------------------------------------------------------------------------- MoE
MOE_CASES = {
    "groups4-top2-norm-limit10": dict(n_group=4, topk_group=2, norm_topk_prob=True, swiglu_limit=10.0),
    "groups4-top2-nonorm-limit0.05": dict(n_group=4, topk_group=2, norm_topk_prob=False, swiglu_limit=0.05),
    "groups2-top1-norm-limit0.05": dict(n_group=2, topk_group=1, norm_topk_prob=True, swiglu_limit=0.05),
    "groups1-nonorm-k3": dict(num_experts_per_tok=3, norm_topk_prob=False, routed_scaling_factor=1.5),
}


@pytest.mark.parametrize("overrides", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_router(overrides):
    config = Glm53Config.tiny(**overrides)
    ours, theirs = pair(config, hf.Glm5NextTextMoE, MoE)
    x = torch.randn(40, config.hidden_size)
    logits, weights, indices = ours.gate(x)
    hf_logits, hf_weights, hf_indices = theirs.gate(x)
    assert_close(logits, hf_logits)
    order, hf_order = indices.argsort(-1), hf_indices.argsort(-1)
    assert torch.equal(indices.gather(1, order), hf_indices.gather(1, hf_order))
    assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    if config.n_group > 1:
        # group-limited routing: the experts of each token lie in at most topk_group groups
        groups = indices // (config.n_routed_experts // config.n_group)
        assert max(len(set(row)) for row in groups.tolist()) <= config.topk_group


@pytest.mark.parametrize("overrides", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_moe(overrides):
    config = Glm53Config.tiny(**overrides)
    ours, theirs = pair(config, hf.Glm5NextTextMoE, MoE)
    x = torch.randn(2, 9, config.hidden_size) * 3
    with torch.no_grad():
        assert_close(ours(x), theirs(x))


def test_moe_limit_really_clamps():
    """The small swiglu_limit used above changes the result (so the clamp is exercised)."""
    config = Glm53Config.tiny(swiglu_limit=0.05)
    ours, _ = pair(config, hf.Glm5NextTextMoE, MoE)
    loose = MoE(config.replace(swiglu_limit=1e6))
    loose.load_state_dict(ours.state_dict())
    x = torch.randn(2, 9, config.hidden_size) * 3
    with torch.no_grad():
        assert not torch.allclose(ours(x), loose(x), atol=1e-3)


# --------------------------------------------------------------------------------------------------- dense
@pytest.mark.parametrize("limit", [10.0, 0.05], ids=["limit10", "limit0.05"])
def test_dense_mlp(limit):
    config = Glm53Config.tiny(swiglu_limit=limit)
    ours, theirs = pair(config, hf.Glm5NextTextMLP, MLP)
    x = torch.randn(2, 9, config.hidden_size) * 3
    with torch.no_grad():
        assert_close(ours(x), theirs(x))


# ------------------------------------------------------------------------------------------- decoder block
@pytest.mark.parametrize("layer_idx", [0, 1, 3], ids=["KDA-dense", "KDA-MoE", "MLA-MoE"])
def test_decoder_block(layer_idx):
    T = 18
    config = Glm53Config.tiny(index_topk=4, index_n_heads=16)  # tie-free indexer scores (test_indexer_topk_sets)
    ours, theirs = pair(config, hf.Glm5NextTextDecoderLayer, DecoderBlock, layer_idx)
    streams = torch.randn(2, T, config.hc_mult, config.hidden_size)
    mask = padding(2, T, "left")
    with torch.no_grad():
        expected, _ = theirs(streams, attention_mask=mask)
        actual, topk = ours(streams, ForwardContext(valid=mask))
    assert (topk is None) == (layer_idx != 3)
    assert_close(actual[mask], expected[mask], rtol=1e-4, atol=1e-5)
