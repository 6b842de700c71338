"""The "fla" backend of the "kda" op: flash-linear-attention's Triton `chunk_kda` (CUDA only), registered when
the package is installed and chosen explicitly per device (dispatch.set_device_backend("kda", "cuda", "fla")).

Same contract as the fast kernel (chunk.py `kda_chunk`): q, k already l2-normalised, g the per-channel log decay,
beta [B, T, H], scale K^-0.5 by default, layout [B, T, H, *] (fla's default, not head-first); packed documents as
`cu_seqlens` over the flattened B * T tokens, which is fla's varlen convention on a batch of one. `gate_floor`
is the fast kernel's hint and means nothing here (fla's kernel has no data-dependent path choice). fla computes in
fp32 inside; tests/kernels/test_device_backends.py checks it against the recurrent reference on a GPU.
"""

from __future__ import annotations

import importlib.util

import torch

from ..dispatch import register

AVAILABLE = importlib.util.find_spec("fla") is not None


def kda_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    gate_floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from fla.ops.kda import chunk_kda  # the optional package (pip install flash-linear-attention)

    if q.device.type != "cuda":
        raise RuntimeError(
            f"the fla KDA backend runs on CUDA tensors only, got {q.device}; choose it per device "
            f"with dispatch.set_device_backend('kda', 'cuda', 'fla')"
        )
    B, T = q.shape[:2]
    if cu_seqlens is None:
        return chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state
        )
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, S = chunk_kda(
        *flat,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens.long(),
    )
    return o.view(B, T, *o.shape[2:]), S


if AVAILABLE:
    register("kda", "fla", kda_fla)

__all__ = ["AVAILABLE", "kda_fla"]
