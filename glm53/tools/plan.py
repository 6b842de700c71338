"""`python -m glm53.tools.plan`: per-rank training memory of a (dp, cp, ep, tp) layout for the released config.

    python -m glm53.tools.plan --dp 16 --ep 8 --tp 1 --seq-len 4096 --batch 1 --activation-checkpointing \
        --dtype bf16 --device-gib 141
    python -m glm53.tools.plan --dp 4 --cp 16 --seq-len 131072 --activation-checkpointing --device-gib 141

Any combination of --dp, --cp, --ep and --tp (the mesh of glm53/parallel/mesh.py).
Legend: W = dp x cp x ep x tp ranks, D model width, N mHC streams, H heads, K/F head widths, R q_lora_rank, C
kv_lora_rank, E experts, k experts per token, I expert width, V vocabulary, J selected key slots, P k-pools.
The model is built on the meta device and the real `glm53.parallel.parallelize` is applied on a fake process
group of W ranks (glm53/parallel/memory.py), so the parameter, gradient and AdamW bytes are rank 0's actual local
shards (tensors in `--dtype`, the fp32 keep-list in fp32; AdamW's two states in each parameter's dtype, as torch
keeps them). The transient is the largest FSDP unit's all-gather output, counted twice: the unit computing and
the next one prefetched (its unsharded gradients in backward are the same size). Activations are an estimate:
the tensors each layer type keeps for backward per token (formulas below), times the tokens of one data rank
(batch x seq_len); with activation checkpointing only each block's input streams are kept, plus one block's
activations while it is recomputed.
Context parallelism (`--cp`): a data rank's sequences are split over cp ranks, so the per-token terms count
batch x seq_len / cp tokens; the parameters are FSDP-sharded over dp x cp. What does not shrink with cp: an MLA
block's queries still score the pools of the whole sequence (P = seq_len / index_kpool per query) and each MLA
block gathers the whole sequence's kv latent and the indexer's per-token keys and gate logits.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import torch

from ..config import Glm53Config
from ..parallel import parallelize
from ..parallel.memory import fake_world, largest_gather, layout_mesh, local_numel
from ..peft import memory as peft_memory
from ..precision import keeps_fp32
from ..training.args import positive_float, positive_int
from ..vision.model import model_class_for
from .comm_model import kda_layer_bytes, mla_layer_bytes, moe_layer_bytes

GIB = 1024**3
MAX_WORLD = 4096  # ranks the fake-process-group plan builds in about a minute on one core
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FP32 = 4  # bytes: router logits, indexer scores and the loss's logits are fp32
INDEX_BYTES = 8  # int64 top-k slot indices


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m glm53.tools.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel (FSDP) degree")
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel degree (must divide n_routed_experts)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree")
    p.add_argument("--cp", type=positive_int, default=1, help="context-parallel degree (ranks sharing each sequence)")
    p.add_argument("--seq-len", type=positive_int, default=4096, help="tokens per sequence")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per data rank (each dp x ep rank)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter / gradient / compute dtype")
    p.add_argument("--device-gib", type=positive_float, default=80.0, help="device memory to compare with (GiB)")
    peft_memory.add_plan_arguments(p)  # --lora-rank, --lora-targets, --base-dtype, --freeze
    args = p.parse_args(argv)
    world = args.dp * args.cp * args.ep * args.tp
    if world > MAX_WORLD:
        p.error(
            f"--dp {args.dp} x --cp {args.cp} x --ep {args.ep} x --tp {args.tp} = {world} ranks; the plan builds "
            f"the whole world on a fake process group (time grows with it: 4096 ranks take about a minute), so at "
            f"most {MAX_WORLD} ranks"
        )
    return args


# ------------------------------------------------------------------------------------- activations per token
def _hc(c: Glm53Config) -> int:
    """One mHC site: the N input streams, the collapsed branch input and the branch output."""
    return (c.hc_mult + 2) * c.hidden_size


def _kda(c: Glm53Config, tp: int) -> int:
    """The normed input, q/k/v before and after their convs, the forget gate, beta, the output, its gate and
    the gated norm's output (heads split over tp)."""
    HK, HV, H = c.linear_num_heads * c.linear_head_dim, c.linear_num_heads * c.linear_head_dim, c.linear_num_heads
    return c.hidden_size + (2 * (2 * HK + HV) + HK + H + 3 * HV) // tp


def _mla(c: Glm53Config, tp: int, seq_len: int, dtype_bytes: int) -> int:
    """In elements of the compute dtype: the normed input, q_a and kv_a latents (raw and normed), per-head q and
    kv, the attention output, the J selected slots (int64; the sparse-attention kernel recomputes its
    probabilities in backward) and the indexer's fp32 scores over the P pools."""
    H, K, F = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    R, C = c.q_lora_rank, c.kv_lora_rank
    heads = (H * K + H * (K + F) + H * F) // tp
    J, P = min(c.index_topk, seq_len), -(-seq_len // c.index_kpool)
    index = c.index_n_heads * c.index_head_dim + c.index_head_dim
    fp32 = (J * INDEX_BYTES + P * FP32) // dtype_bytes
    return c.hidden_size + 2 * R + 2 * C + heads + index + fp32


def _moe(c: Glm53Config, tp: int, ep: int, dtype_bytes: int) -> int:
    """The normed input, fp32 router logits, the k gathered rows, their gate/up projections and activations,
    the shared expert's, and under EP the rows sent and received by the all-to-alls."""
    k, I, D = c.num_experts_per_tok, c.moe_intermediate_size, c.hidden_size
    Is = c.moe_intermediate_size * c.n_shared_experts
    routed = k * D + k * 2 * I // (1 if ep > 1 else tp) + k * I // (1 if ep > 1 else tp) + k * D
    a2a = 2 * k * D if ep > 1 else 0
    return D + c.n_routed_experts * FP32 // dtype_bytes + routed + a2a + 3 * Is // tp


def _mlp(c: Glm53Config, tp: int) -> int:
    return c.hidden_size + 3 * c.intermediate_size // tp


def layer_kinds(c: Glm53Config) -> Counter:
    """How many blocks of each (attention, mlp) kind the config has (MTP layers are MLA + MoE blocks)."""
    kinds = Counter()
    for attn, mlp in zip(c.layer_types, c.mlp_layer_types):
        kinds[("kda" if attn == "linear_attention" else "mla", "moe" if mlp == "sparse" else "mlp")] += 1
    kinds[("mla", "moe")] += c.num_nextn_predict_layers
    return kinds


def gathered_elements(c: Glm53Config, seq_len: int) -> int:
    """Elements one MLA block gathers per sequence under context parallelism: the kv latent and the indexer's
    per-token keys and pooling-gate logits of every position."""
    return seq_len * (c.kv_lora_rank + 2 * c.index_head_dim)


def activation_elements(c: Glm53Config, kind: tuple[str, str], tp: int, ep: int, seq_len: int, dtype_bytes: int) -> int:
    """Elements kept per token by one block of `kind` (two mHC sites, attention, MLP)."""
    attn = _kda(c, tp) if kind[0] == "kda" else _mla(c, tp, seq_len, dtype_bytes)
    mlp = _moe(c, tp, ep, dtype_bytes) if kind[1] == "moe" else _mlp(c, tp)
    return 2 * _hc(c) + attn + mlp


# ----------------------------------------------------------------------------------- MoE communication
def moe_comm_bytes(c: Glm53Config, dp: int, ep: int, tokens: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes one rank sends for one MoE layer in one training step (forward + backward, FSDP resharding after
    forward, no activation checkpointing), counted as glm53/parallel/comm.py counts them.

    FSDP: the experts are all-gathered twice (forward, backward) and their gradients reduce-scattered once over
    the ranks that shard them (dp x ep without EP, dp with it), on 1/ep of the experts under EP; the router and
    shared expert likewise over all dp x ep ranks. EP: four all-to-alls of the tokens' k rows of width D
    (dispatch and combine, forward and backward) under uniform routing, plus the per-expert count exchange.
    """
    E, k, D, I = c.n_routed_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    experts = E // ep * 3 * I * D * dtype_bytes
    rest = E * D * FP32 + 3 * c.moe_intermediate_size * c.n_shared_experts * D * dtype_bytes
    shard_e, shard_r = (dp if ep > 1 else dp * ep), dp * ep
    out = {
        "all_gather": 2 * (experts * (shard_e - 1) // shard_e + rest * (shard_r - 1) // shard_r),
        "reduce_scatter": experts * (shard_e - 1) // shard_e + rest * (shard_r - 1) // shard_r,
        "all_to_all": 0,
    }
    if ep > 1:
        out["all_to_all"] = 4 * tokens * k * D * dtype_bytes * (ep - 1) // ep + E * INDEX_BYTES * (ep - 1) // ep
    return out


# ------------------------------------------------------------------------------------------------------ plan
def measure(c: Glm53Config, dp: int, ep: int, tp: int, dtype: torch.dtype, cp: int = 1, peft=None) -> dict:
    """Rank 0's parameter elements per dtype and the largest all-gather, from the real parallelize. `peft`: the
    parsed args with glm53.peft's flags (LoRA adapters, FP8 base, frozen groups: glm53/peft/memory.py)."""
    size = torch.tensor([], dtype=dtype).element_size()
    bytes_of = lambda fqn, numel: numel * (4 if keeps_fp32(fqn) else size)  # noqa: E731
    with fake_world(dp * cp * ep * tp):
        mesh = layout_mesh(dp, ep, tp, cp=cp)
        with torch.device("meta"):
            model = model_class_for(c)(c)  # a config declaring a vision tower counts the tower's parameters
        if peft is not None and peft_memory.enabled(peft):
            peft_memory.prepare(peft, model, dtype)
            bytes_of = peft_memory.bytes_of_dtype(model, size)
        parallelize(model, mesh)
        params = sum(bytes_of(n, local_numel(p)) for n, p in model.named_parameters())
        expert = sum(bytes_of(n, local_numel(p)) for n, p in model.named_parameters() if ".experts." in n)
        gather = largest_gather(model, bytes_of)
        total = sum(p.numel() for p in model.parameters())
        extra = {}
        if peft is not None and peft_memory.enabled(peft):
            extra = dict(
                peft_rows=peft_memory.rows(peft, model, size, gather.bytes),
                adapter_acts=peft_memory.adapter_activations(peft, model, size, 1),
            )
    return dict(params=params, expert=expert, gather=gather, total_params=total, **extra)


def plan(args: argparse.Namespace, config: Glm53Config | None = None) -> dict:
    c = config or Glm53Config()
    dtype = DTYPES[args.dtype]
    size = torch.tensor([], dtype=dtype).element_size()
    m = measure(c, args.dp, args.ep, args.tp, dtype, args.cp, peft=args)
    tokens = args.batch * -(-args.seq_len // args.cp)  # this rank's tokens
    gathered = args.batch * gathered_elements(c, args.seq_len) * size if args.cp > 1 else 0
    per_kind = {
        kind: activation_elements(c, kind, args.tp, args.ep, args.seq_len, size) * size * tokens
        + (gathered if kind[0] == "mla" else 0)
        for kind in layer_kinds(c)
    }
    counts = layer_kinds(c)
    head = tokens * (c.vocab_size // args.tp) * FP32 * 2  # fp32 logits and their gradient
    if args.activation_checkpointing:
        acts = sum(counts.values()) * c.hc_mult * c.hidden_size * size * tokens + max(per_kind.values())
    else:
        acts = sum(per_kind[k] * n for k, n in counts.items())
    rows = dict(
        params=m["params"],
        grads=m["params"],
        adamw=2 * m["params"],
        transient=2 * m["gather"].bytes,
        activations=acts + head,
    )
    if "peft_rows" in m:  # LoRA / frozen / FP8 base: glm53/peft/memory.py
        adapter = m["adapter_acts"] * tokens
        rows.update(
            m["peft_rows"],
            activations=acts
            + head
            + (adapter if not args.activation_checkpointing else adapter // max(1, sum(counts.values()))),
        )
    comm = moe_comm_bytes(c, args.dp, args.ep, tokens, size)
    layout = dict(tp=args.tp, cp=args.cp)
    layers = {
        "moe": moe_layer_bytes(c, args.dp, args.ep, tokens, size, **layout),
        "mla": mla_layer_bytes(
            c, args.dp, args.ep, args.batch, args.seq_len, size, **layout, indexer_kl=c.indexer_loss_weight > 0
        ),
        "kda": kda_layer_bytes(c, args.dp, args.ep, args.batch, args.seq_len, size, **layout),
    }
    return dict(
        rows=rows,
        total=sum(rows.values()),
        per_kind=per_kind,
        counts=counts,
        measured=m,
        head=head,
        comm=comm,
        tokens=tokens,
        layers=layers,
    )


def report(args: argparse.Namespace, result: dict, seconds: float) -> str:
    m, rows = result["measured"], result["rows"]
    world = args.dp * args.cp * args.ep * args.tp
    lines = [
        f"layout dp {args.dp} x cp {args.cp} x ep {args.ep} x tp {args.tp} = {world} ranks; "
        f"{m['total_params'] / 1e9:.1f}B parameters; {args.dtype}{_peft_label(args)}; batch {args.batch} x seq {args.seq_len} per "
        f"data rank ({result['tokens']} tokens per rank); activation checkpointing "
        f"{'on' if args.activation_checkpointing else 'off'}",
        "",
        "per rank (rank 0's local shards)      GiB",
    ]
    for name, value in rows.items():
        lines.append(f"  {name:<34} {value / GIB:9.2f}")
    lines.append(f"    of which routed experts (params) {m['expert'] / GIB:9.2f}")
    lines.append(f"    largest all-gather: {m['gather'].unit} ({m['gather'].bytes / GIB:.2f} GiB, counted twice)")
    lines.append("activation estimate per block (all tokens of a rank, no checkpointing)")
    for (attn, mlp), value in sorted(result["per_kind"].items()):
        lines.append(f"  {attn}+{mlp:<4} x{result['counts'][(attn, mlp)]:<3}{'':24} {value / GIB:9.2f}")
    lines.append(f"  logits + gradient (fp32){'':12} {result['head'] / GIB:9.2f}")
    lines.append("sent per rank per layer per step (GiB; uniform routing; glm53.tools.comm_model)")
    for layer, sent in result["layers"].items():
        cells = ", ".join(f"{kind} {value / GIB:.3f}" for kind, value in sent.items())
        lines.append(f"  {layer}: {cells}; total {sum(sent.values()) / GIB:.3f}")
    fits = "fits" if result["total"] <= args.device_gib * GIB else "does NOT fit"
    lines.append(f"total {result['total'] / GIB:.2f} GiB vs device {args.device_gib:g} GiB: {fits}  ({seconds:.1f} s)")
    return "\n".join(lines)


def _peft_label(args: argparse.Namespace) -> str:
    if not peft_memory.enabled(args):
        return ""
    lora = f" LoRA r{args.lora_rank} on {' '.join(args.lora_targets or ['default targets'])}" if args.lora_rank else ""
    frozen = f", frozen {' '.join(args.freeze)}" if args.freeze else ""
    return f";{lora}{frozen}, {args.base_dtype or 'bf16'} base"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in ("dp", "cp", "ep", "tp", "seq_len", "batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    began = time.perf_counter()
    try:
        result = plan(args)
    except ValueError as e:  # a layout parallelize rejects (experts or heads not divisible)
        raise SystemExit(f"glm53.tools.plan: {e}") from None
    print(report(args, result, time.perf_counter() - began))
    return 0 if result["total"] <= args.device_gib * GIB else 1


if __name__ == "__main__":
    sys.exit(main())
