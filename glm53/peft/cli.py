"""The LoRA / freeze / frozen-base flags of `glm53 train` and `glm53 generate`, and the steps they add.

The training CLI calls these through one-line hooks (training/cli.py, trainer.py, generation/cli.py):
`add_lora_arguments(parser)`; `build_model(args)` (the model to train, or None when no flag of this file is set);
`resume_state(args)` / `save_run(model, path, state)` (a LoRA run's checkpoint: the adapter in peft's format plus
`trainer_state.pt`, whose optimizer holds only the trainable parameters; the base is re-read from --init);
`export_merged(args, model)` (--export-merged: the merged official layout in bf16); `add_generate_arguments` /
`with_adapter(args, model)` for `glm53 generate --adapter`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import uuid

import torch

from ..checkpoint.atomic import atomic_directory
from ..config import Glm53Config
from ..errors import CheckpointError, ConfigError
from ..losses import Glm53ForCausalLM
from .files import CONFIG_FILE, WEIGHTS_FILE, load_lora, save_lora
from .fp8_storage import hold_bf16
from .load import BASE_DTYPES, fp8_placeholders, load_base
from .lora import LORA_MARK, apply_lora, freeze, has_lora, merge_lora
from .targets import DEFAULT_LORA_TARGETS, FREEZE_GROUPS

TRAINER_STATE = "trainer_state.pt"  # the same name as glm53.training.state's (this package does not import training)


def _rank(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lora-rank must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--lora-rank must be a positive integer, got {value}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lora-alpha must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"--lora-alpha must be a finite number, got {text!r}")
    return value


def _dropout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--lora-dropout must be a number in [0, 1), got {text!r}")
    return value


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parameter-efficient fine-tuning (glm53.peft)")
    g.add_argument("--lora-rank", type=_rank, default=None, help="train LoRA adapters of this rank on a frozen base")
    g.add_argument("--lora-alpha", type=_number, default=None, help="LoRA scaling alpha / rank (default alpha = rank)")
    g.add_argument("--lora-dropout", type=_dropout, default=0.0)
    g.add_argument(
        "--lora-targets",
        nargs="+",
        default=None,
        metavar="TARGET",
        help=f"group names or module-name patterns (default {' '.join(DEFAULT_LORA_TARGETS)})",
    )
    g.add_argument(
        "--base-dtype",
        choices=BASE_DTYPES,
        default=None,
        help="frozen base precision: bf16 (FP8 checkpoints dequantised) or fp8 (kept block-scaled)",
    )
    g.add_argument(
        "--quantize-base",
        action="store_true",
        help="with --base-dtype fp8: quantise a bf16/fp32 checkpoint to 128x128-block FP8 on load",
    )
    g.add_argument(
        "--freeze",
        nargs="+",
        default=None,
        metavar="GROUP",
        help=f"freeze these groups ({', '.join(FREEZE_GROUPS)}) or module-name patterns; with "
        "--lora-rank the rest of the base trains too (without it, the whole base is frozen)",
    )
    g.add_argument(
        "--export-merged",
        default=None,
        metavar="DIR",
        help="after training, fold the adapters into the base and write the official layout (bf16)",
    )


FLAGS = ("lora_rank", "lora_alpha", "lora_targets", "base_dtype", "freeze", "export_merged")


def enabled(args: argparse.Namespace) -> bool:
    """Whether any flag of this file is set (dropout and quantize-base count when non-default)."""
    return (
        any(getattr(args, f, None) is not None for f in FLAGS)
        or bool(getattr(args, "lora_dropout", 0))
        or bool(getattr(args, "quantize_base", False))
    )


def _check(args: argparse.Namespace) -> None:
    lora = args.lora_rank is not None
    if not lora and (args.lora_alpha is not None or args.lora_targets is not None or args.lora_dropout):
        raise ConfigError("--lora-alpha / --lora-targets / --lora-dropout need --lora-rank")
    if args.quantize_base and args.base_dtype != "fp8":
        raise ConfigError("--quantize-base needs --base-dtype fp8")
    if args.base_dtype is not None and not (getattr(args, "init", None) or getattr(args, "resume", None)):
        raise ConfigError("--base-dtype needs --init DIR (the checkpoint the frozen base is read from) or --resume")
    if args.export_merged is not None and not lora:
        raise ConfigError("--export-merged folds LoRA adapters into the base: it needs --lora-rank")
    if args.base_dtype == "fp8" and not lora and args.freeze is None:
        raise ConfigError("--base-dtype fp8 keeps the base frozen: add --lora-rank (or --freeze for the FP8 groups)")


def build_model(args: argparse.Namespace, preset=None, cls: type = Glm53ForCausalLM) -> Glm53ForCausalLM | None:
    """The model a run with these flags trains (None when no flag of this file is set): the base from --init
    (or the preset) in --base-dtype, the adapters from --resume (a LoRA run's checkpoint) or fresh, --freeze.
    `cls`: the model class (Glm53ForConditionalGeneration for image/video data, glm53/training/vl_finetune.py)."""
    if not enabled(args):
        return None
    _check(args)
    resume = getattr(args, "resume", None)
    base = getattr(args, "init", None) or (_recorded_base(resume) if resume else None)
    if base and args.base_dtype == "bf16":  # the frozen text linears and experts held in bf16 from the start
        held = set(_frozen_names(args, cls, base))
        model = load_base(cls, base, "bf16", dtype=torch.float32, hold=held.__contains__)
    elif base and args.base_dtype == "fp8":
        model = load_base(cls, base, "fp8", dtype=torch.float32, quantize=args.quantize_base)
    elif base:  # no --base-dtype: every parameter in the training precision, the checkpoint's values exactly
        model = cls.from_pretrained(base, dtype=torch.float32)
    else:
        model = cls.from_config(preset())
    return _adapt(args, model, base)


def _frozen_names(args: argparse.Namespace, cls: type, base: str) -> list[str]:
    """The parameters a run with these flags freezes (its adapters and --freeze applied to a meta model)."""
    with torch.device("meta"):
        probe = cls(Glm53Config.from_pretrained(base))
    _adapters_and_freeze(args, probe)
    return [n for n, p in probe.named_parameters() if not p.requires_grad]


def meta_base(args: argparse.Namespace, resuming_dcp: bool) -> str | None:
    """The checkpoint a torchrun run with these flags builds its model from on the meta device and loads per rank
    (`build_meta_model`, then glm53.parallel.load_pretrained; with --quantize-base it quantises the wider keys on
    read): --init, or the base a LoRA save names. None where `build_model` builds it whole: no base checkpoint, or a
    LoRA resume without DCP state (`resuming_dcp` False: the adapter values come from the save's adapter file)."""
    if not enabled(args):
        return None
    _check(args)
    resume = getattr(args, "resume", None)
    if resume and not resuming_dcp:
        return None
    return getattr(args, "init", None) or (_recorded_base(resume) if resume else None)


def build_meta_model(
    args: argparse.Namespace, base: str, cls: type = Glm53ForCausalLM, compute_dtype: torch.dtype = torch.float32
) -> Glm53ForCausalLM:
    """`build_model`'s model on the meta device, without values: the architecture of `base` with the adapters
    (fresh, or shaped as --resume's) and --freeze applied; with --base-dtype fp8 the weights `base` stores in FP8
    (every text linear and expert with --quantize-base) as meta FP8 values and block scales, with bf16 the frozen
    text linears and experts held in bf16; either is widened to `compute_dtype` (an FSDP policy's param dtype) per
    matmul. Fill it after parallelizing: the base with glm53.parallel.load_pretrained (skipping `is_adapter` names;
    each tensor keeps its dtype, FP8 read raw; quantize=args.quantize_base quantises the wider keys on read), fresh
    adapters with glm53.peft.fresh_adapters (a DCP resume fills them from its state)."""
    with torch.device("meta"):
        model = cls(Glm53Config.from_pretrained(base))
    if args.base_dtype == "fp8":
        fp8_placeholders(model, base, compute_dtype, quantize=args.quantize_base)
    model = _adapt(args, model, base)
    if args.base_dtype == "bf16":
        hold_bf16(model, compute_dtype)
    return model


def is_adapter(name: str) -> bool:
    return LORA_MARK in name


def _adapt(args: argparse.Namespace, model: Glm53ForCausalLM, base: str | None) -> Glm53ForCausalLM:
    """The adapters (from --resume, or fresh), --freeze and the router-bias rule of `build_model`."""
    _adapters_and_freeze(args, model)
    if base and has_lora(model):
        model.lora_settings["base"] = os.path.abspath(base)
    hold_frozen_router_bias(model, args)
    return model


def _adapters_and_freeze(args: argparse.Namespace, model: Glm53ForCausalLM) -> None:
    resume = getattr(args, "resume", None)
    if args.lora_rank is not None:
        if resume and os.path.isfile(os.path.join(resume, CONFIG_FILE)):
            load_lora(model, resume)
            if model.lora_settings["rank"] != args.lora_rank:
                raise ConfigError(
                    f"--resume {resume} holds rank-{model.lora_settings['rank']} adapters, "
                    f"--lora-rank is {args.lora_rank}"
                )
        else:
            apply_lora(
                model,
                args.lora_rank,
                args.lora_alpha,
                args.lora_dropout,
                targets=args.lora_targets,
                freeze_base=args.freeze is None,
            )
    if args.freeze is not None:
        freeze(model, args.freeze)


def hold_frozen_router_bias(model, args: argparse.Namespace) -> None:
    """A frozen router keeps its balancing bias as loaded (--bias-rate 0, said once): the bias is base state an
    adapter file does not hold, and every way of freezing the router (one process or torchrun, text or VL) agrees."""
    if any(not r.weight.requires_grad for r in model.routers()) and getattr(args, "bias_rate", 0):
        print("glm53 train: the router is frozen: its balancing bias stays as loaded (--bias-rate 0)", flush=True)
        args.bias_rate = 0.0


def _recorded_base(resume: str) -> str | None:
    """The base checkpoint a LoRA run's save names (adapter_config.json's base_model_name_or_path)."""
    file = os.path.join(resume, CONFIG_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f).get("base_model_name_or_path")


def resume_state(args: argparse.Namespace) -> dict | None:
    """A LoRA run's trainer state from --resume (None when this is not a LoRA resume)."""
    resume = getattr(args, "resume", None)
    if not (resume and getattr(args, "lora_rank", None) is not None):
        return None
    file = os.path.join(resume, TRAINER_STATE)
    if not os.path.isfile(os.path.join(resume, WEIGHTS_FILE)) or not os.path.isfile(file):
        raise CheckpointError(
            f"--resume {resume}: a LoRA run resumes from a directory a LoRA run saved "
            f"({WEIGHTS_FILE} + {TRAINER_STATE})"
        )
    try:
        state = torch.load(file, weights_only=True)
    except Exception as e:  # torch.load reports a bad file through many types
        raise CheckpointError(f"{file}: cannot be read as a trainer state ({type(e).__name__})") from e
    if not isinstance(state, dict) or "optimizer" not in state or "step" not in state:
        raise CheckpointError(f"{file} is not a trainer state saved by `glm53 train`")
    return state


DCP_STATE = "train_state"  # a torchrun save's DCP directory (glm53/parallel/run_checkpoint.py's DCP_DIR)
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE, TRAINER_STATE)  # what a LoRA save replaces (with DCP_STATE)


def save_run(model: torch.nn.Module, path: str, state: dict) -> bool:
    """Save a one-process LoRA run (adapter + trainer state, one atomic directory) -> True; False for other runs.
    A torchrun save's DCP state there is replaced too (a later resume would read it first)."""
    if not has_lora(model):
        return False
    with atomic_directory(path, overwrite=True, own=lambda n: n in (*ADAPTER_FILES, DCP_STATE)) as tmp:
        save_lora(model, tmp)
        torch.save({**state, "lora_save_id": uuid.uuid4().hex}, os.path.join(tmp, TRAINER_STATE))
    return True


def adapter_writer(model: torch.nn.Module):
    """For a torchrun LoRA save (glm53.parallel.run_checkpoint.save_run_state): -> (writer, the names it writes);
    the writer `(directory, full, write)` writes the adapter in peft's format, each factor read whole with `full`
    on every rank, the files by the rank with `write`."""
    return (lambda directory, full, write: save_lora(model, directory, full=full, write=write)), ADAPTER_FILES


# (parallelized model, directory) -> the directory: the torchrun --export-merged writer. glm53.training.distributed
# installs it (glm53.parallel is a layer above this package: tests/test_layout.py).
_SHARDED_EXPORT = None


def set_sharded_export(export) -> None:
    """Install the writer `export_merged` uses for a parallelized model (glm53.training.distributed does)."""
    global _SHARDED_EXPORT
    _SHARDED_EXPORT = export


def export_merged(args: argparse.Namespace, model: torch.nn.Module) -> str | None:
    """--export-merged DIR: the model with its adapters folded in (held bases widened) written in bf16. One process:
    a merged copy, saved. Under torchrun (sharded parameters): the installed writer (`set_sharded_export`;
    glm53.training.distributed's: every rank folds its adapters into its own shards of the trained model, the run
    being over, and the ranks write the official layout together, no rank gathering the model)."""
    target = getattr(args, "export_merged", None)
    if target is None:
        return None
    if any(hasattr(p, "device_mesh") for p in model.parameters()):  # DTensors: a parallelized model
        if _SHARDED_EXPORT is None:
            raise ConfigError("--export-merged of a parallelized model needs glm53.training.distributed's exporter")
        return _SHARDED_EXPORT(model, target)
    merged = copy.deepcopy(model)
    merge_lora(merged)
    return merged.save_pretrained(target, dtype=torch.bfloat16, overwrite=True)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adapter",
        default=None,
        metavar="DIR",
        help="a LoRA adapter directory (peft's format, glm53 or peft written), merged into --model",
    )


def with_adapter(args: argparse.Namespace, model: Glm53ForCausalLM) -> Glm53ForCausalLM:
    """--adapter DIR: load it and merge it into the base (decoding then runs on plain weights)."""
    if getattr(args, "adapter", None) is None:
        return model
    load_lora(model, args.adapter)
    dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n)
    merge_lora(model, dtype=dtype)
    return model


__all__ = [
    "add_lora_arguments",
    "build_model",
    "hold_frozen_router_bias",
    "meta_base",
    "build_meta_model",
    "is_adapter",
    "resume_state",
    "save_run",
    "adapter_writer",
    "set_sharded_export",
    "export_merged",
    "add_generate_arguments",
    "with_adapter",
    "enabled",
]
