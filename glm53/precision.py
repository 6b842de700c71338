"""The one fp32 keep-list: parameters and buffers that stay fp32 whatever the model's dtype.

transformers' `_keep_in_fp32_modules_strict` for glm5_next (router bias, KDA convs, dt_bias, A_log, mHC
base/scale) plus the two weights glm53 always reads in fp32 (the mHC projection `fn` and the router weight), so
a bf16 model loses nothing there. Used by the model cast (`cast_model`), the loader, the saver and the FSDP2
mixed-precision plan (glm53/parallel/parallelize.py gives exactly these tensors fp32 units; a test checks it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

FP32_KEEP = (
    "e_score_correction_bias",
    "q_conv1d.weight",
    "k_conv1d.weight",
    "v_conv1d.weight",
    "dt_bias",
    "A_log",
    "attn_hc.base",
    "attn_hc.scale",
    "ffn_hc.base",
    "ffn_hc.scale",  # transformers' keep-list
    "attn_hc.fn",
    "ffn_hc.fn",
    "mlp.gate.weight",  # read in fp32 by glm53's forward
)


MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def keeps_fp32(name: str) -> bool:
    """Whether the parameter or buffer `name` (a module path) stays fp32."""
    return name.endswith(FP32_KEEP)


def beyond_range(tensor: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The largest |value| of `tensor` when casting it to `dtype` would turn it into inf (fp16's range is +-65504),
    else None. Meta and empty tensors hold no values."""
    if not tensor.is_floating_point() or tensor.is_meta or tensor.numel() == 0:
        return None
    limit = torch.finfo(dtype).max
    if torch.finfo(tensor.dtype).max <= limit:
        return None
    peak = tensor.detach().abs().amax().item()  # NOTE: syncs (once per tensor; casts are one-off)
    return peak if peak > limit else None


def range_error(overflows: dict[str, float], dtype: torch.dtype, action: str) -> str:
    """The message for tensors whose values `dtype` cannot hold (`overflows`: name -> largest |value|)."""
    shown = [f"{name} (max |x| {peak:.3g})" for name, peak in list(overflows.items())[:10]]
    more = f" ... ({len(overflows)} in all)" if len(overflows) > 10 else ""
    return (
        f"{action} {str(dtype).removeprefix('torch.')} would turn values beyond its range "
        f"(+-{torch.finfo(dtype).max:.6g}) into inf in {', '.join(shown)}{more}; use bfloat16 or float32"
    )


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to `dtype` (a floating dtype or its name), keeping the FP32_KEEP ones
    in fp32. Values the dtype cannot hold raise a ValueError naming the tensors, before anything is cast. A model
    still on the meta device holds no values: the loaders cast it there, before `to_empty` allocates its memory."""
    dtype = resolve_dtype(dtype)
    named = list(model.named_parameters()) + list(model.named_buffers())
    overflows = {n: p for n, t in named if not keeps_fp32(n) and (p := beyond_range(t, dtype)) is not None}
    if overflows:
        raise ValueError(range_error(overflows, dtype, "casting to"))
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point():
                target = torch.float32 if keeps_fp32(name) else dtype
                if tensor.dtype != target:
                    tensor.data = tensor.data.to(target)
    return model


def resolve_dtype(dtype: torch.dtype | str, what: str = "dtype") -> torch.dtype:
    """A floating torch.dtype from a dtype or its name ("bfloat16", "torch.bfloat16"); else TypeError naming
    `what` (the argument) and the value."""
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise TypeError(f"{what}={dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype or its name, got {dtype!r} ({type(dtype).__name__})")
    if not dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating dtype (weights are real numbers), got {dtype}")
    if dtype not in MODEL_DTYPES:
        # FP8 (and narrower) weights need per-block scales: checkpoints holding them are dequantised on load
        # (glm53.checkpoint.fp8); a plain cast to them would give a model that neither trains nor loads back.
        raise TypeError(
            f"{what} must be one of {[str(d).removeprefix('torch.') for d in MODEL_DTYPES]} "
            f"(the dtypes a glm53 model holds its weights in), got {dtype}"
        )
    return dtype


def resolve_device(device: torch.device | str | int, what: str = "device") -> torch.device:
    """A torch.device from a device, its name ("cpu", "cuda:1") or a CUDA index; else TypeError naming `what`."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"{what} must be a torch.device, a device name or an index, got {device!r} ({type(device).__name__})"
        )
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise TypeError(f"{what}={device!r} is not a device ({e})") from None


__all__ = [
    "FP32_KEEP",
    "FP32_MATMUL_MODES",
    "MODEL_DTYPES",
    "keeps_fp32",
    "cast_model",
    "resolve_device",
    "resolve_dtype",
    "set_fp32_matmul_mode",
    "fp32_matmul_mode",
    "using_fp32_matmul_mode",
]


# ---------------------------------------------------------------------------------- fp32 islands on a GPU
# The fp32 islands (the router, the mHC projection, the KDA and sparse-attention kernels, which compute in fp32
# whatever the model dtype) run their matmuls in full fp32 by default ("ieee"): exact, but 8-16x slower than the
# tensor cores on a GPU. Opt in to faster operands, process-wide (torch.set_float32_matmul_precision):
#   "tf32": the operands rounded to TF32 (10-bit mantissa, relative error 2^-11 each), products accumulated in
#           fp32: a K-long dot product's relative error grows to about 2^-11 * sqrt(K) (1.6e-2 of |q||k| at
#           K = 256), far below bf16 activations' own 2^-8 rounding, but no longer bit-comparable with the CPU;
#   "bf16": operands rounded to bf16 (8-bit mantissa, 2^-9), fp32 accumulation; what a bf16 model's GEMMs do.
# Elementwise work, reductions, softmax and the triangular solves stay fp32 either way. The parity tests run in
# "ieee" (their tolerances assume it); the choice never changes a module's formulas.
FP32_MATMUL_MODES = {"ieee": "highest", "tf32": "high", "bf16": "medium"}


def set_fp32_matmul_mode(mode: str) -> None:
    """Operand precision of fp32 matmuls, process-wide: "ieee" (default), "tf32" or "bf16" (see above)."""
    if mode not in FP32_MATMUL_MODES:
        raise ValueError(f"fp32 matmul mode must be one of {sorted(FP32_MATMUL_MODES)}, got {mode!r}")
    torch.set_float32_matmul_precision(FP32_MATMUL_MODES[mode])


def fp32_matmul_mode() -> str:
    """The current mode's name ("ieee", "tf32" or "bf16")."""
    current = torch.get_float32_matmul_precision()
    return next(name for name, value in FP32_MATMUL_MODES.items() if value == current)


@contextlib.contextmanager
def using_fp32_matmul_mode(mode: str) -> Iterator[None]:
    """`set_fp32_matmul_mode` inside the block, restoring the previous mode on exit."""
    saved = fp32_matmul_mode()
    set_fp32_matmul_mode(mode)
    try:
        yield
    finally:
        set_fp32_matmul_mode(saved)
