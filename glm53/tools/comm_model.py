"""Analytic bytes one rank sends per MoE layer and per attention layer in one training step, on any dp x cp x ep x tp
layout (glm53/parallel/mesh.py), counted as glm53/parallel/comm.py counts them (what leaves the rank: all-gather
(W - 1) x its shard, reduce-scatter and all-reduce (W - 1) / W and 2 (W - 1) / W x the tensor, all-to-all what
it does not keep). Forward + backward, FSDP resharding after forward, no activation checkpointing (which repeats
the forward's collectives except FSDP's); uniform routing.

Legend: N tokens on this rank (batch x seq_len / cp), S tokens of this rank's whole sequences (batch x seq_len),
D model width, E experts, k experts per token, I expert width, Is shared-expert width, R q_lora_rank, C
kv_lora_rank, Ki indexer head width, J selected key slots, HK / HV KDA key / value widths of all heads, b bytes per
element of the compute dtype, F = dp x cp x ep the FSDP ranks of non-expert parameters, Fe = dp x cp those of the
routed experts under EP (F without it).

- FSDP: a layer's parameters (their tp shard) all-gathered in forward and again in backward, gradients
  reduce-scattered once, over F (routed experts over Fe, on E / ep of them).
- EP: four all-to-alls of the k rows of width D per token (dispatch and combine, forward and backward), plus the
  per-expert count exchange. Under tp x ep every tp rank of a group dispatches the group's (replicated) tokens.
- TP: an all-reduce of [N, D] where a rowwise layer ends (o_proj, down_proj, the routed experts' exit) and, in
  backward, of the input gradient of each colwise layer fed by replicated activations; MLA's absorbed latent
  (whole on every tp rank, its gradient a partial sum over heads) and, with the indexer KL, the attention mass
  over the selected slots (fp32, [N, J]) are all-reduced too.
- CP: MLA all-gathers the latent and the indexer's keys and gate logits of every position (the gradients come
  back as a reduce-scatter of S rows: the latent's, and the indexer's with its KL loss), plus the uint8 mask
  (packed documents add their int64 ids); KDA passes its conv halos and a K x K transition and K x V state per
  head between ranks (summaries, independent of N).
"""

from __future__ import annotations

from ..config import Glm53Config

FP32 = 4
INDEX_BYTES = 8


def _ag(shard: int, world: int) -> int:
    return shard * (world - 1)


def _rs(whole: int, world: int) -> int:
    return whole * (world - 1) // world


def _ar(whole: int, world: int) -> int:
    return 2 * whole * (world - 1) // world


def _fsdp(local: int, world: int) -> dict[str, int]:
    """FSDP traffic of `local` bytes (this tp rank's unsharded parameters of a layer) over `world` ranks."""
    return {"all_gather": 2 * _ag(local // world, world) if world > 1 else 0, "reduce_scatter": _rs(local, world)}


def _add(*parts: dict[str, int]) -> dict[str, int]:
    out = {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 0, "all_reduce": 0}
    for part in parts:
        for kind, value in part.items():
            out[kind] += value
    return out


def moe_layer_bytes(
    c: Glm53Config, dp: int, ep: int, tokens: int, dtype_bytes: int, tp: int = 1, cp: int = 1, fsdp: bool = True
) -> dict[str, int]:
    """Bytes one rank sends for one MoE layer in one training step (`tokens`: N, this rank's); `fsdp=False`:
    the model-parallel collectives only (EP, TP)."""
    E, k, D, I = c.n_routed_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    Is, b = c.moe_intermediate_size * c.n_shared_experts, dtype_bytes
    experts = E // ep * 3 * I * D * b // tp
    router, shared = E * D * FP32, 3 * Is * D * b // tp
    F, Fe = dp * cp * ep, dp * cp if ep > 1 else dp * cp * ep
    parts = [_fsdp(experts, Fe), _fsdp(router + shared, F)] if fsdp else []
    if ep > 1:
        parts.append({"all_to_all": 4 * tokens * k * D * b * (ep - 1) // ep + E * INDEX_BYTES * (ep - 1) // ep})
    if tp > 1:  # forward: experts' exit, shared down_proj; backward: experts' input and weights, shared gate/up
        parts.append({"all_reduce": _ar(tokens * D * b, tp) * 5 + _ar(tokens * k * FP32, tp)})
    return _add(*parts)


def mla_params(c: Glm53Config, tp: int, indexer: bool) -> int:
    """Elements of one MLA layer's parameters on a tp rank (heads split, latents and the indexer whole)."""
    H, K, F = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    R, C, D = c.q_lora_rank, c.kv_lora_rank, c.hidden_size
    whole = R * D + R + (C + c.qk_rope_head_dim) * D + C
    split = (H * K * R + H * (K - c.qk_rope_head_dim + F) * C + D * H * F) // tp
    if indexer:
        Ki = c.index_head_dim
        whole += c.index_n_heads * Ki * R + Ki * D + 2 * Ki + c.index_n_heads * D + Ki * D + c.index_kpool * Ki
    return whole + split


def kda_params(c: Glm53Config, tp: int) -> int:
    """Elements of one KDA layer's parameters on a tp rank."""
    D, H, K, W = c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    HK = HV = H * K
    r = c.linear_head_dim  # the low-rank gate width (f_a / g_a)
    split = (2 * HK * D + HV * D + r * HK + H * D + r * HV + D * HV + (2 * HK + HV) * W + 2 * H) // tp
    return split + 2 * D * r + K


def mla_layer_bytes(
    c: Glm53Config,
    dp: int,
    ep: int,
    batch: int,
    seq_len: int,
    dtype_bytes: int,
    tp: int = 1,
    cp: int = 1,
    indexer: bool = True,
    indexer_kl: bool = False,
    fsdp: bool = True,
) -> dict[str, int]:
    """Bytes one rank sends for one MLA layer (with its own indexer when `indexer`) in one training step."""
    b, D, R, C, Ki = dtype_bytes, c.hidden_size, c.q_lora_rank, c.kv_lora_rank, c.index_head_dim
    N, S = batch * -(-seq_len // cp), batch * seq_len
    parts = [_fsdp(mla_params(c, tp, indexer) * b, dp * cp * ep)] if fsdp else []
    if tp > 1:
        latent_rows = N * cp  # the gathered latent under cp
        slots = N * min(c.index_topk, seq_len) * FP32 if indexer and indexer_kl else 0
        parts.append(
            {"all_reduce": _ar(N * D * b, tp) + _ar(N * R * b, tp) + _ar(latent_rows * C * b, tp) + _ar(slots, tp)}
        )
    if cp > 1:  # the latent and the indexer's keys and gate (+ the uint8 mask); gradients: the latent's, and
        # the indexer's with its KL loss (the indexer runs without gradient otherwise)
        width = C + (2 * Ki if indexer else 0)
        grad_width = C + (2 * Ki if indexer and indexer_kl else 0)
        parts.append({"all_gather": _ag(N * width * b + N, cp), "reduce_scatter": _rs(S * grad_width * b, cp)})
    return _add(*parts)


def kda_layer_bytes(
    c: Glm53Config,
    dp: int,
    ep: int,
    batch: int,
    seq_len: int,
    dtype_bytes: int,
    tp: int = 1,
    cp: int = 1,
    fsdp: bool = True,
) -> dict[str, int]:
    """Bytes one rank sends for one KDA layer in one training step."""
    b, D, H, K = dtype_bytes, c.hidden_size, c.linear_num_heads, c.linear_head_dim
    N = batch * -(-seq_len // cp)
    parts = [_fsdp(kda_params(c, tp) * b, dp * cp * ep)] if fsdp else []
    if tp > 1:  # forward o_proj; backward the input of q/k/v/b and of the low-rank f_b/g_b
        parts.append({"all_reduce": _ar(N * D * b, tp) * 5 + _ar(N * K * b, tp) * 2})
    if cp > 1:  # the convs' halos and each local head's K x K transition and K x V state; back as reduce-scatters
        halo = batch * (c.linear_conv_kernel_dim - 1) * 3 * H * K * b // tp
        state = batch * 2 * H * K * K * b // tp
        parts.append({"all_gather": _ag(halo + state, cp), "reduce_scatter": _ag(halo + state, cp)})
    return _add(*parts)


__all__ = ["moe_layer_bytes", "mla_layer_bytes", "kda_layer_bytes", "mla_params", "kda_params"]
