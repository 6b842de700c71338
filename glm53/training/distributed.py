"""The model of a `glm53 train` run under torchrun: which weights it starts from, on which device and in which
precision (trainer.py calls `init_parallel_model(args, mesh)`; the single-process run builds its model itself).

    LoRA / --freeze / --base-dtype from a base checkpoint (--init, or the one a LoRA save names): glm53.peft builds
                               it on meta (adapters, --freeze), parallelize, `load_pretrained` (own slices only,
                               adapters skipped; --base-dtype bf16: the frozen linears and experts held in bf16,
                               fp8: the FP8-stored ones held as FP8 values + block scales, read raw, or with
                               --quantize-base every one, the wider keys quantised on read one tensor at a time,
                               so their shards are bf16 / FP8); fresh adapters take apply_lora's values
                               (`fresh_adapters`, the same RNG draws as one process), a LoRA resume's DCP state
                               fills the trainable parameters and their optimizer state
    a LoRA resume without DCP state: glm53.peft builds the model whole on every rank (the save's adapter
                               file), then parallelize
    --resume DIR (a DCP run)   build on meta, parallelize; the DCP state fills it (any saved layout)
    --init DIR                 build on meta, parallelize, `glm53.parallel.load_pretrained` (own slices only)
    otherwise                  the preset, seeded identically on every rank, then parallelize
--bf16 runs FSDP2 with a bf16 MixedPrecisionPolicy (glm53.precision's fp32 keep-list stays fp32; a held bf16 / FP8
base widened to bf16, FP8 values held as their uint8 bits, which the policy does not cast); --device cuda
puts the shards on this rank's GPU (nccl); --compile BACKEND compiles every block (parallelize's compile option).
With --cp > 1 every micro-batch's forward takes this rank's slice of each sequence (`forward_inputs`).
Legend: dp/cp/ep/tp the mesh dimensions (glm53.parallel.init_mesh; glm53/parallel/mesh.py).
"""

from __future__ import annotations

import argparse

import torch

from ..config import Glm53Config
from ..losses import Glm53ForCausalLM
from ..parallel import context_parallel_inputs, load_pretrained, parallelize
from ..parallel.export import export_pretrained
from ..parallel.load import fill_from_full
from ..parallel.lora_merge import merge_lora_sharded
from ..parallel.run_checkpoint import bf16_policy, has_run_state, parallel_model
from ..peft import cli as peft_cli
from ..peft import freeze, has_lora
from ..peft.fp8 import hold_for_policy
from ..peft.load import fresh_adapters


def init_parallel_model(
    args: argparse.Namespace, mesh, preset, model_class: type = Glm53ForCausalLM
) -> Glm53ForCausalLM:
    """The parallelized model a torchrun run starts from (see the module docstring); `preset` builds the config;
    `model_class` is Glm53ForConditionalGeneration for a VL run (from --init or --resume only)."""
    options = dict(
        bf16=args.bf16,
        activation_checkpointing=args.activation_checkpointing,
        compile=args.compile,
        model_class=model_class,
    )
    resuming = bool(args.resume and has_run_state(args.resume))
    if peft_cli.enabled(args) and (args.lora_rank is not None or not resuming):
        # LoRA / frozen groups / a frozen base: on meta with per-rank reads, or (a LoRA resume without DCP state)
        # whole, then sharded
        base = peft_cli.meta_base(args, resuming)
        if base is not None:
            return _meta_peft_model(args, mesh, base, model_class, resuming)
        model = peft_cli.build_model(args, preset)
        return _parallelize(_for_policy(model.to(mesh.device_type), args), mesh, args)
    if resuming:
        model = parallel_model(Glm53Config.from_pretrained(args.resume), mesh, **options)
        if getattr(args, "freeze", None) is not None:  # a --freeze run (no adapters) saved the whole model
            freeze(model, args.freeze)
        return model
    if args.init:
        return parallel_model(Glm53Config.from_pretrained(args.init), mesh, init=args.init, **options)
    if args.resume:  # an official-layout checkpoint with a trainer_state.pt of the old format
        model = Glm53ForCausalLM.from_pretrained(args.resume)
    else:
        model = Glm53ForCausalLM(preset())
    return _parallelize(model.to(mesh.device_type), mesh, args)


def _meta_peft_model(args: argparse.Namespace, mesh, base: str, model_class: type, resuming: bool):
    """A LoRA / --freeze model built on meta and parallelized; each rank reads its own slices of `base`, and
    fills its part of every fresh adapter (a DCP resume's state overwrites them, so they are zeroed there)."""
    model = _parallelize(_for_policy(peft_cli.build_meta_model(args, base, model_class), args), mesh, args)
    load_pretrained(model, base, skip=peft_cli.is_adapter, quantize=bool(getattr(args, "quantize_base", False)))
    params = dict(model.named_parameters())
    if resuming:
        for name in filter(peft_cli.is_adapter, params):
            fill_from_full(params[name], torch.zeros(params[name].shape, dtype=params[name].dtype))
    elif has_lora(model):
        for name, value in fresh_adapters(model):
            fill_from_full(params[name], value)
    return model


def export_merged_sharded(model: Glm53ForCausalLM, path: str) -> str:
    """--export-merged under torchrun (every rank): each rank folds its adapters into its own shards of the trained
    model (glm53.parallel.lora_merge; the model is for export afterwards) and the ranks write the bf16 official
    layout together (`export_pretrained`)."""
    merge_lora_sharded(model)
    return export_pretrained(model, path, dtype=torch.bfloat16, overwrite=True)


peft_cli.set_sharded_export(export_merged_sharded)


def _for_policy(model: Glm53ForCausalLM, args: argparse.Namespace) -> Glm53ForCausalLM:
    """Under --bf16 (FSDP's bf16 policy) a held bf16 / FP8 base is widened to bf16, FP8 values held as their bits."""
    if args.bf16:
        hold_for_policy(model, torch.bfloat16)
    return model


def _parallelize(model: Glm53ForCausalLM, mesh, args: argparse.Namespace) -> Glm53ForCausalLM:
    return parallelize(
        model,
        mesh,
        mp_policy=bf16_policy() if args.bf16 else None,
        activation_checkpointing=args.activation_checkpointing,
        compile=args.compile is not None,
        compile_backend=args.compile or "inductor",
    )


def forward_inputs(model: Glm53ForCausalLM, inputs: dict[str, torch.Tensor], loss_denominators, cp: int) -> dict:
    """The keyword arguments of one micro-batch's forward: `inputs` (whole sequences, with labels) and the global
    batch's `loss_denominators`; with `cp` > 1 this rank's slice of every sequence instead
    (`glm53.parallel.context_parallel_inputs`: next-token targets, per-document positions, padding when cp
    does not divide the length)."""
    if cp == 1:
        return dict(inputs, loss_denominators=loss_denominators)
    return context_parallel_inputs(model, **inputs, loss_denominators=loss_denominators)


__all__ = ["init_parallel_model", "forward_inputs", "export_merged_sharded"]
