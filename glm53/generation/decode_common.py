"""Helpers shared by the decode step (decode.py), its MoE part (decode_moe.py) and the verify step (verify.py):
dtype casts without a call, RMS norms in their cheapest CPU form, weights derived once per module, and the absorbed
attention of queries that each read their own selected latent rows.

Legend (glm53/model/__init__.py): D model width (the normalised width of an RMS norm); N queries (a decode step's
rows, a verify step's B*T tokens), H heads, K/V head dims, J selected rows, Z kv_lora_rank.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..boundary import as_local


def _weight(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = None if linear.bias is None else as_local(linear, "bias")
    return as_local(linear, "weight"), bias


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype) without the call when x already has it (a decode step is made of small ops: calls count)."""
    return x if x.dtype == dtype else x.to(dtype)


def _absorbed_attention(p, q: torch.Tensor, kv: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """MLA's absorbed form (p: decode.py's _Mla) for N queries, each over its own rows: q [N, H, K], latent rows
    kv [N, J, Z], filled [N, J] -> [N, H, V]; scores and softmax in fp32 (fp64 inputs stay fp64)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_abs = _as(torch.bmm(q.transpose(0, 1), p.w_uk).transpose(0, 1), dtype)  # [N, H, Z]
    kv = _as(kv, dtype)
    scores = torch.bmm(q_abs, kv.transpose(1, 2)) * p.scale  # [N, H, J]
    probs = torch.softmax(scores.masked_fill(~filled[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    o_latent = _as(torch.bmm(probs, kv), q.dtype)  # [N, H, Z]
    return torch.bmm(o_latent.transpose(0, 1), p.w_uv_t).transpose(0, 1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as kernels/rms_norm.py: w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        scaled, root = _rms_constants(weight, eps)
        return _unit_rms(x, root).mul_(scaled)
    # F.rms_norm without a weight is the same x * rsqrt(mean(x^2) + eps), in one call
    return weight * _as(F.rms_norm(_as(x, torch.float32), (x.shape[-1],), None, eps), x.dtype)


def _unit_rms(x: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + root^2) over the last dim (fp32): rms_norm(x, eps) / sqrt(D) for root = sqrt(D eps),
    l2norm for root = sqrt(eps). A norm and a hypot are two cheap calls where F.rms_norm on the CPU is several."""
    return x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), root)


_RMS: dict = {}  # id(weight) -> (weakref to it, (version, eps), constants): tensors compare by value, not identity


def _rms_constants(weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * sqrt(D), sqrt(D eps)) for _unit_rms, kept per weight tensor (rebuilt when it changed in place)."""
    key = (weight.data_ptr(), weight._version, eps)
    hit = _RMS.get(id(weight))
    if hit is None or hit[0]() is not weight or hit[1] != key:
        D = weight.shape[-1]
        drop = lambda _, k=id(weight): _RMS.pop(k, None)  # noqa: E731 (the entry goes with its weight)
        constants = (weight.detach() * D**0.5, torch.tensor((D * eps) ** 0.5, device=weight.device))
        hit = (weakref.ref(weight, drop), key, constants)
        _RMS[id(weight)] = hit
    return hit[2]


_DERIVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _derived(module: nn.Module, tag: str, sources: list[torch.Tensor], build) -> object:
    """build(), kept per module (not per cache: one copy of derived weights however many caches) and rebuilt when
    a source weight changed in place (its version moved)."""
    versions = tuple((t.data_ptr(), t._version) for t in sources)
    kept = _DERIVED.setdefault(module, {})
    hit = kept.get(tag)
    if hit is not None and hit[0] == versions:
        return hit[1]
    with torch.no_grad():  # constants of the inference steps: no graph back to the weights
        value = build()
    kept[tag] = (versions, value)
    return value


def _packed_linears(module: nn.Module, tag: str, proj: list) -> tuple:
    """Linears that read the same input, stacked into one (weight, bias, sizes) (kept per module: _derived)."""

    def build() -> tuple:
        bias = None
        if any(b is not None for _, b in proj):
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in proj])
        return torch.cat([w for w, _ in proj]), bias, [w.shape[0] for w, _ in proj]

    return _derived(module, tag, [w for w, _ in proj] + [b for _, b in proj if b is not None], build)


__all__ = ["_as", "_derived", "_packed_linears", "_rms", "_unit_rms", "_weight"]
