"""Routed experts: each token's hidden state goes through its top-k experts' clamped SwiGLU, weighted.

Legend: M tokens, D model width, I expert width, E experts, k experts per token (the grouped form's
locals call the token count N).
x: [M, D]; topk_idx: [M, k] int; topk_weight: [M, k]; gate_up: [E, 2I, D] (gate rows first, then up);
down: [E, D, I]. Returns [M, D] in x's dtype. Optional `lora` (glm53.peft): per-expert low-rank terms
(ExpertLoRA below), run through the same grouped matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..hooks import LowRank
from .dispatch import register
from .function import apply

# Optional LoRA terms of the two expert projections (glm53.peft): (gate_up's, down's), each LowRank or None, with
# A [E, r, in] and B [E, out, r]; computed through the same grouped matmuls as the base, never as a dense delta.
ExpertLoRA = tuple[LowRank | None, LowRank | None]


def _clamped_swiglu_forward(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _clamped_swiglu_backward(grad, gate, up, limit, d_gate, d_up) -> None:
    """Writes the gradients of `_clamped_swiglu_forward` into d_gate and d_up (views of one buffer allowed).

    With g = min(gate, L): d up = grad * silu(g) where |up| <= L, else 0; d gate = silu'(g) * grad * clamp(up)
    where gate <= L, else 0 (silu' by ATen's fused silu_backward, one pass).
    """
    g = gate.clamp(max=limit)
    if torch.compiler.is_compiling():  # traced: `out=` views are not allowed, and the compiler fuses anyway
        d_up.copy_((grad * F.silu(g)).masked_fill(up.abs() > limit, 0))
        d_gate.copy_(torch.ops.aten.silu_backward(grad * up.clamp(-limit, limit), g).masked_fill(gate > limit, 0))
        return
    torch.mul(grad, F.silu(g), out=d_up).masked_fill_(up.abs() > limit, 0)
    torch.ops.aten.silu_backward.grad_input(grad * up.clamp(-limit, limit), g, grad_input=d_gate)
    d_gate.masked_fill_(gate > limit, 0)


class _ClampedSwiGLU(torch.autograd.Function):
    """Saves only gate and up and recomputes the rest in backward; autograd would keep the clamped gate, its silu,
    the clamped up and masks: ~3x the activation memory."""

    @staticmethod
    def forward(ctx, gate, up, limit):
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        return _clamped_swiglu_forward(gate, up, limit)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        _clamped_swiglu_backward(grad, gate, up, ctx.limit, d_gate, d_up)
        return d_gate, d_up, None


class _PackedClampedSwiGLU(torch.autograd.Function):
    """The same op on one [..., 2I] projection output (gate columns first): saves it once and returns its gradient
    as one [..., 2I] tensor, so autograd does not concatenate two halves in backward."""

    @staticmethod
    def forward(ctx, gate_up, limit):
        ctx.save_for_backward(gate_up)
        ctx.limit = limit
        return _clamped_swiglu_forward(*gate_up.chunk(2, dim=-1), limit)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        d_gate_up = torch.empty_like(gate_up)
        _clamped_swiglu_backward(grad, *gate_up.chunk(2, dim=-1), ctx.limit, *d_gate_up.chunk(2, dim=-1))
        return d_gate_up, None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): GLM-5.3's SwiGLU everywhere (memory-lean backward)."""
    return apply(_ClampedSwiGLU, gate, up, limit)


def clamped_swiglu_packed(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """clamped_swiglu(*gate_up.chunk(2, -1), limit) for one packed [..., 2I] projection output."""
    return apply(_PackedClampedSwiGLU, gate_up, limit)


def moe_experts_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """One expert at a time over the tokens routed to it (the per-expert loop)."""
    gate_up_lr, down_lr = lora if lora is not None else (None, None)
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(topk_idx == e)
        if token.numel() == 0:
            continue
        gate, up = _expert_linear(x[token], gate_up, gate_up_lr, e).chunk(2, dim=-1)
        y = _expert_linear(clamped_swiglu(gate, up, limit), down, down_lr, e) * topk_weight[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out


def _expert_linear(a: torch.Tensor, w: torch.Tensor, low_rank: LowRank | None, e: int) -> torch.Tensor:
    """Expert e's projection a w[e]^T, plus its low-rank term scale * (dropout(a) A[e]^T) B[e]^T."""
    y = F.linear(a, w[e])
    if low_rank is None:
        return y
    a = F.dropout(a, low_rank.dropout) if low_rank.dropout > 0 else a
    return y + F.linear(F.linear(a, low_rank.A[e]), low_rank.B[e]) * low_rank.scale


# ------------------------------------------------------------------------------------------------ grouped form
# Token-expert pairs are sorted by expert once; each projection is then ONE grouped matmul over the contiguous
# per-expert row blocks: torch._grouped_mm where this build has it for the dtype and alignment (it wants 16-byte
# aligned rows and fp32/bf16/fp16), otherwise a padded batched matmul [E, capacity, *] (capacity = the busiest
# expert's load). No Python loop over experts on either path.
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GROUPED_MM_ALIGN_BYTES = 16


# On CUDA, torch's grouped GEMM has its fast kernels (CUTLASS) for bf16 on SM 9.0 (Hopper) and 10.0 (Blackwell)
# only; elsewhere it loops over the experts with a host sync, slower than the padded bmm. The CPU build's loop is
# in C++ without a sync (kept, as before, for every dtype in GROUPED_MM_DTYPES).
GROUPED_MM_CUDA_CAPABILITIES = ((9, 0), (10, 0))


def grouped_mm_supported(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether torch._grouped_mm is the fast path for `dtype` on a device of `device_type` (and CUDA `capability`)."""
    if device_type == "cpu":
        return dtype in GROUPED_MM_DTYPES
    if device_type == "cuda":
        return dtype == torch.bfloat16 and capability in GROUPED_MM_CUDA_CAPABILITIES
    return False


def _grouped_mm_usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    capability = torch.cuda.get_device_capability(x.device) if x.device.type == "cuda" else None
    if not grouped_mm_supported(x.device.type, x.dtype, capability):
        return False
    if any(w.dtype != x.dtype for w in weights):
        return False
    return all(
        (w.shape[-1] * x.element_size()) % GROUPED_MM_ALIGN_BYTES == 0
        and (w.shape[-2] * x.element_size()) % GROUPED_MM_ALIGN_BYTES == 0
        for w in weights
    )


@torch.library.custom_op("glm53::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [M, In] (rows grouped by expert), b [E, In, Out], offs [E] int32 cumulative rows -> [M, Out].

    torch._grouped_mm as a custom op: torch 2.13's meta registration accepts only bf16, so torch.compile could
    not trace the fp32 CPU op; the fake implementation below gives the shape for every dtype.
    """
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


def _grouped_mm_setup(ctx, inputs, output) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()  # the eager op rejects stride-0 (expanded) gradients
    d_a = grouped_mm(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    d_b = _grouped_mm_weight_grad(a, grad, offs) if ctx.needs_input_grad[1] else None
    return d_a, d_b, None


@torch.library.custom_op("glm53::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """sum over each expert's rows of a^T grad: [M, In], [M, Out] -> [E, In, Out] (empty experts give 0)."""
    return torch._grouped_mm(a.t(), grad, offs=offs)


@_grouped_mm_weight_grad.register_fake
def _(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(offs.shape[0], a.shape[1], grad.shape[1])


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _padded_mm(
    rows: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor, slot: torch.Tensor, capacity: int
) -> torch.Tensor:
    """rows [M*k, in] sorted by expert, weight [E, out, in] -> [M*k, out] via one bmm over [E, capacity, in]."""
    padded = rows.new_zeros(weight.shape[0], capacity, rows.shape[-1])
    padded = padded.index_put((expert, slot), rows)
    return torch.bmm(padded, weight.transpose(1, 2))[expert, slot]


def _with_low_rank(project, low_rank: LowRank | None):
    """`project` (rows, w [E, out, in]) -> rows w[e]^T, extended by the low-rank term: two more grouped matmuls
    through the rank-r bottleneck (A [E, r, in], then B [E, out, r])."""
    if low_rank is None:
        return project

    def run(a, w):
        dropped = F.dropout(a, low_rank.dropout) if low_rank.dropout > 0 else a
        return project(a, w) + project(project(dropped, low_rank.A).contiguous(), low_rank.B) * low_rank.scale

    return run


def _moe_experts_grouped(x, topk_idx, topk_weight, gate_up, down, limit, use_grouped_mm: bool, lora=None):
    N, k = topk_idx.shape
    E = gate_up.shape[0]
    expert_of = topk_idx.flatten()
    order = torch.argsort(expert_of, stable=True)  # [M*k] pairs sorted by expert
    token = order // k
    expert = expert_of[order]
    counts = torch.zeros(E, dtype=torch.long, device=x.device).index_add_(0, expert_of, torch.ones_like(expert_of))
    rows = x.index_select(0, token)  # [M*k, D]; backward: index_add_ (x[token] would use a slow accumulate index_put_)
    if use_grouped_mm:
        offs = counts.cumsum(0).to(torch.int32)
        project = lambda a, w: grouped_mm(a, w.transpose(-2, -1), offs)  # noqa: E731
    else:
        starts = counts.cumsum(0) - counts
        slot = torch.arange(expert.numel(), device=x.device) - starts[expert]
        capacity = int(counts.max()) if expert.numel() else 0  # NOTE: syncs
        project = lambda a, w: _padded_mm(a, w, expert, slot, capacity)  # noqa: E731
    # The routing weight scales the I-wide activation before the down projection (linear, so the same sum up to
    # rounding): backward then keeps no extra [M*k, D] tensor for the weight's gradient.
    gate_up_lr, down_lr = lora if lora is not None else (None, None)
    act = clamped_swiglu_packed(_with_low_rank(project, gate_up_lr)(rows, gate_up), limit)
    act = act * topk_weight.flatten()[order, None]
    y = _with_low_rank(project, down_lr)(act.to(rows.dtype).contiguous(), down)  # [M*k, D]
    return torch.zeros_like(x).index_add(0, token, y.to(x.dtype))


def moe_experts_grouped(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """Sorted tokens, one grouped matmul per projection (torch._grouped_mm when usable); same signature."""
    factors = [t for lr in (lora or ()) if lr is not None for t in (lr.A, lr.B)]
    return _moe_experts_grouped(
        x, topk_idx, topk_weight, gate_up, down, limit, _grouped_mm_usable(x, gate_up, down, *factors), lora
    )


def moe_experts_padded(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """The padded-bmm fallback of `moe_experts_grouped` on every dtype (registered so tests can force it)."""
    return _moe_experts_grouped(x, topk_idx, topk_weight, gate_up, down, limit, False, lora)


# ------------------------------------------------------------------------------------------- few-token form
# A decode or verify step routes only a few (token, expert) pairs. Sorting them into per-expert groups costs a host
# read on every device but the CPU (the padded form's capacity; torch's grouped GEMM off bf16 Hopper/Blackwell), once
# per MoE layer per token. The few-token form instead gathers each pair's expert weights ([M*k, 2I, D] and
# [M*k, D, I]) and runs one batched matmul per projection: no sort, no count, no host read, and shapes from M and k
# alone (torch.compile and CUDA graphs take it as it is). It copies each pair's weights, so it suits up to
# FEW_TOKEN_PAIRS pairs (the generation cache path prefers it there: model/moe.py); beyond that the grouped form,
# which reads each expert's weights once, is cheaper.
FEW_TOKEN_PAIRS = 32  # (token, expert) pairs: a decode step of 4 rows at k = 8, a verify of 4 tokens for one row


def moe_experts_few_token(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """Each (token, slot) pair through its own gathered expert weights, batched; same signature."""
    M, k = topk_idx.shape
    expert = topk_idx.flatten()  # [M*k]: pair p = (token p // k, slot p % k)

    def project(a, w):  # a [M*k, 1, in], w [E, out, in] -> [M*k, 1, out] through each pair's expert
        return torch.bmm(a, w.index_select(0, expert).transpose(1, 2))

    gate_up_lr, down_lr = lora if lora is not None else (None, None)
    rows = x[:, None].expand(M, k, x.shape[-1]).reshape(M * k, 1, x.shape[-1])
    act = clamped_swiglu_packed(_with_low_rank(project, gate_up_lr)(rows, gate_up), limit)
    act = act * topk_weight.reshape(M * k, 1, 1)  # the routing weight before the down projection, as grouped
    y = _with_low_rank(project, down_lr)(act.to(rows.dtype), down)  # [M*k, 1, D]
    return y.view(M, k, -1).to(x.dtype).sum(1)


register("moe_experts", "reference", moe_experts_reference)
register("moe_experts", "padded", moe_experts_padded)
register("moe_experts", "few_token", moe_experts_few_token)
register("moe_experts", "fast", moe_experts_grouped)
