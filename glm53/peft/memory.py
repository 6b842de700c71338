"""The memory planner's LoRA / frozen-base terms (`python -m glm53.tools.plan --lora-rank R --base-dtype fp8 ...`).

Legend: E experts (El this rank's), I expert width, D model width, r the adapter rank.
The planner builds the model on the meta device; `prepare(args, model)` gives it what a run with these flags has
(adapters from `apply_lora`, FP8 placeholders for the base a FP8 checkpoint holds in FP8, frozen groups) before
`parallelize`, and `rows(args, model, size, gather)` prices rank 0's local shards afterwards:
    params       frozen base in its own dtype (FP8: 1 byte + its fp32 scales; bf16-held text linears, experts,
                 embedding and head: 2 bytes; other frozen tensors the training dtype; the fp32 keep-list 4) plus the trainable parameters
                 in the training dtype
    grads, adamw only the trainable parameters (1x and 2x)
    transient    the largest FSDP all-gather (FP8 shards gathered as FP8) counted twice, plus with an FP8 base one
                 module's gathered base dequantised for its matmuls (the largest: a MoE layer's experts, this
                 rank's under EP: both projections in the compute dtype plus one fp32 product, dequantize_blocks);
                 with a bf16-held base under a wider training dtype, that module's weights widened (no product; the
                 head's too, for the loss)
The activation rows are the planner's (adapters add r numbers per adapted linear and token, counted here).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

from ..checkpoint import fp8 as fp8_format
from ..model.moe import Experts
from ..precision import keeps_fp32
from .fp8_storage import base_weights, fp8_modules, hold_bf16, vocab_tables
from .load import BASE_DTYPES, _meta_fp8
from .lora import apply_lora, freeze

FP32 = 4


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA adapters of this rank on a frozen base")
    p.add_argument("--lora-targets", nargs="+", default=None, help="LoRA target groups / patterns (default: all)")
    p.add_argument("--base-dtype", choices=BASE_DTYPES, default=None, help="frozen base precision (with --lora-rank)")
    p.add_argument("--freeze", nargs="+", default=None, help="frozen groups (glm53.peft.FREEZE_GROUPS)")


def enabled(args: argparse.Namespace) -> bool:
    return any(getattr(args, f, None) is not None for f in ("lora_rank", "base_dtype", "freeze"))


def prepare(args: argparse.Namespace, model: nn.Module, dtype: torch.dtype) -> None:
    """Adapters, FP8 placeholders and frozen groups on the meta model, as `glm53 train` would give it."""
    if not enabled(args):
        return
    if args.lora_rank is not None and args.lora_rank <= 0:
        raise ValueError(f"--lora-rank must be a positive integer, got {args.lora_rank}")
    if args.lora_rank is not None:
        apply_lora(model, args.lora_rank, targets=args.lora_targets, freeze_base=args.freeze is None)
    if args.freeze is not None:
        freeze(model, args.freeze)
    if args.base_dtype == "fp8":
        for module in fp8_modules(model).values():
            _meta_fp8(module, fp8_format.DEFAULT_BLOCK_SIZE, dtype)
    elif args.base_dtype == "bf16":  # the frozen text linears, experts, embedding and head, as glm53 train holds them
        hold_bf16(model, dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def rows(args: argparse.Namespace, model: nn.Module, size: int, gather_bytes: int) -> dict[str, int]:
    """The planner's parameter, gradient, AdamW and transient rows for a LoRA / frozen / FP8-base run."""
    trainable = frozen = 0
    for name, p in model.named_parameters():
        n = _local(p).numel()
        if p.requires_grad:
            trainable += n * (FP32 if keeps_fp32(name) else size)
        elif p.dtype in (fp8_format.FP8_DTYPE, torch.bfloat16):  # held FP8 / bf16 (prepare)
            frozen += n * p.element_size()
        else:
            frozen += n * (FP32 if keeps_fp32(name) else size)
    scales = sum(_local(b).numel() * FP32 for n, b in model.named_buffers() if n.endswith(fp8_format.SCALE_SUFFIX))
    dequant = 0
    widened = args.base_dtype == "fp8" or (args.base_dtype == "bf16" and size > 2)
    if widened:
        ep = getattr(args, "ep", 1)
        product = FP32 if args.base_dtype == "fp8" else 0  # dequantize_blocks' fp32 product; a cast has none
        # a bf16-held head is widened whole for the loss; the embedding widens only the rows it gathers
        tables = vocab_tables(model) if args.base_dtype == "bf16" else {}
        heads = {n: m for n, m in tables.items() if isinstance(m, nn.Linear) and not m.weight.requires_grad}
        for module in {**fp8_modules(model), **heads}.values():
            # the matmuls see the weights FSDP gathered: the whole tensor, this rank's experts under EP; the
            # experts' two projections are widened together (one fp32 product alive at a time)
            names = base_weights(module)
            split = ep if isinstance(module, Experts) else 1
            numels = [getattr(module, p).numel() // split for p in names]
            dequant = max(dequant, sum(numels) * size + max(numels) * product)
    return dict(
        params=frozen + scales + trainable, grads=trainable, adamw=2 * trainable, transient=2 * gather_bytes + dequant
    )


def adapter_activations(args: argparse.Namespace, model: nn.Module, size: int, tokens: int) -> int:
    """Bytes the adapters keep for backward: A x (r numbers) per adapted linear per token; routed experts per
    token-expert pair for both projections (k pairs per token). Without checkpointing, every block's."""
    if args.lora_rank is None:
        return 0
    k = getattr(model.config, "num_experts_per_tok", 1)
    per_token = 0
    for module in model.modules():
        if hasattr(module, "lora_rank"):
            per_token += module.lora_rank * (2 * k if isinstance(module, Experts) else 1)
    return per_token * size * tokens


def bytes_of_dtype(model: nn.Module, size: int):
    """The planner's `bytes_of(fqn, numel)` pricing each parameter at its own dtype (FP8 1 byte, held bf16 2)."""
    held = {
        n: p.element_size() for n, p in model.named_parameters() if p.dtype in (fp8_format.FP8_DTYPE, torch.bfloat16)
    }
    return lambda fqn, numel: numel * (held[fqn] if fqn in held else FP32 if keeps_fp32(fqn) else size)


__all__ = ["add_plan_arguments", "enabled", "prepare", "rows", "adapter_activations", "bytes_of_dtype"]
