"""Causal depthwise 1-D convolution (the short conv on KDA's q, k and v).

Legend: B batch, T time, W kernel width; the channels are H*K (one of KDA's q, k, v projections; the code's
locals call the channel count D).
x: [B, T, H*K]; weight: [H*K, W] (tap W-1 multiplies the current token); optional state: [B, H*K, W-1], the
last W-1 inputs before x (zeros when absent). Returns y [B, T, H*K] in fp32 and, if asked, the new state
[B, H*K, W-1] (the last W-1 inputs of cat(state, x)), in x's dtype. No bias, no activation: the caller applies them.
Packed documents (`cu_seqlens`, kernels/varlen.py): a tap that would read a token of an earlier document reads
zero instead, so every document starts from an empty history (no initial or final state then).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .dispatch import register
from .function import StandInContext, apply
from .opaque import HOST_READING
from .varlen import check_cu_seqlens, document_slices, position_in_document


def _history(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    """Validated history [B, H*K, W-1] in x's dtype (zeros without a state)."""
    B, T, D = x.shape
    W = weight.shape[-1]
    if weight.shape != (D, W):
        raise ValueError(f"conv weight has shape {tuple(weight.shape)}, expected ({D}, W)")
    if initial_state is None:
        return x.new_zeros(B, D, W - 1)
    if initial_state.shape != (B, D, W - 1):
        raise ValueError(f"conv state has shape {tuple(initial_state.shape)}, expected {(B, D, W - 1)}")
    return initial_state.to(x.dtype)


def _with_history(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    return torch.cat([_history(x, weight, initial_state), x.transpose(1, 2)], dim=-1)  # [B, H*K, W-1+T]


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y_t = sum_w weight[:, w] * x_{t - (W-1) + w}, tap by tap (with `cu_seqlens`: one document at a time)."""
    if cu_seqlens is not None:
        return _per_document(causal_conv1d_reference, x, weight, initial_state, output_final_state, cu_seqlens)
    T, W = x.shape[1], weight.shape[-1]
    full = _with_history(x, weight, initial_state)
    y = sum(weight[:, w, None].float() * full[:, :, w : w + T].float() for w in range(W))
    state = full[:, :, full.shape[-1] - (W - 1) :] if output_final_state else None
    return y.transpose(1, 2), state


def _per_document(conv, x, weight, initial_state, output_final_state, cu_seqlens):
    """Run `conv` on each document alone and put the outputs back in place (the references' packed form)."""
    _no_states(initial_state, output_final_state)
    B, T, D = x.shape
    cu = check_cu_seqlens(cu_seqlens, B, T)
    y = x.new_zeros(B, T, D, dtype=torch.float32)
    for b, s, e in document_slices(cu, T):
        y[b : b + 1, s:e] = conv(x[b : b + 1, s:e], weight)[0]
    return y, None


def _no_states(initial_state, output_final_state):
    if initial_state is not None or output_final_state:
        raise ValueError(
            "causal_conv1d: initial_state / output_final_state are not supported with cu_seqlens "
            "(every packed document starts from an empty history)"
        )


# (cu_seqlens tensor) -> (total, W, version, edges): the model hands one boundary tensor to every conv of a
# forward (and its backward), so the edge tokens are found once per tensor, not once per conv call
_EDGES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _edges(cu_seqlens: torch.Tensor, total: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens closer than W-1 to their document's start [n_e] and which of their taps stay inside it [n_e, W]."""
    if cu_seqlens.is_inference():  # no version counter to key a cache on: found again
        return _find_edges(cu_seqlens, total, W)
    cached = _EDGES.get(cu_seqlens)
    if cached is not None and cached[:3] == (total, W, cu_seqlens._version):
        return cached[3]
    edges = _find_edges(cu_seqlens, total, W)
    _EDGES[cu_seqlens] = (total, W, cu_seqlens._version, edges)
    return edges


def _find_edges(cu_seqlens: torch.Tensor, total: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = position_in_document(cu_seqlens, total)
    tok = torch.nonzero(pos < W - 1).flatten()  # NOTE: syncs; at most W-1 tokens per document
    lag = W - 1 - torch.arange(W, device=pos.device)  # tap w reads the token `lag[w]` steps back
    return tok, lag[None, :] <= pos[tok, None]


# Whether a compiled graph computes the depthwise conv as W shifted multiply-adds (`_depthwise`); read when tracing.
SHIFTED_WHEN_COMPILING = True
# Eager outputs this short take the W shifted multiply-adds too: oneDNN's conv2d costs ~40 us per call whatever the
# length (its setup), the shifted form ~16 us at one output (a decode step) and ~25 us at 16 (2 threads, 256 channels).
SHIFTED_MAX_LENGTH = 16


# A custom op only so that inductor keeps its output as a buffer: a plain w.t().contiguous() is inlined into the
# consumers, whose stride-W reads of w[:, tap] inductor's C++ then leaves scalar (not vectorised along channels).
@torch.library.custom_op("glm53::conv_taps_as_rows", mutates_args=())
def _taps_as_rows(w: torch.Tensor) -> torch.Tensor:
    """Conv weights w [C, W] -> their taps as rows [W, C], contiguous (no gradient: _CausalConv1d writes its own)."""
    return w.t().contiguous()


@_taps_as_rows.register_fake
def _(w):
    return w.new_empty(w.shape[1], w.shape[0])


def _depthwise(z: torch.Tensor, w: torch.Tensor, pad: int) -> torch.Tensor:
    """out_t = sum_w w[:, w] * z_{t+w} over z [B, L, C] zero-padded by `pad` on both ends of time -> [B, L', C].

    One depthwise conv2d whose [B, C, 1, L] operand is a channels-last view of z itself: oneDNN's NHWC depthwise
    kernel reads z once, where W shifted multiply-adds over [B, L, C] would take W passes (no copy, no transpose).
    While torch.compile traces (SHIFTED_WHEN_COMPILING), the shifted multiply-adds instead: inductor fuses them
    with their neighbours into one pass over [B, L, C], where the conv2d is an extern call whose operand inductor
    lays out as [B, C, 1, L] (a transposing copy, and transposed reads in the fused kernels around it). Eager, the
    same sum for at most SHIFTED_MAX_LENGTH outputs, where the conv2d's fixed cost dominates, as one product of the
    unfolded windows with the taps and one sum over them (~4 us at one output, against ~16 for W multiply-adds).
    """
    C, W = w.shape
    shifted = SHIFTED_WHEN_COMPILING and torch.compiler.is_compiling()
    short = z.shape[1] + 2 * pad - W + 1 <= SHIFTED_MAX_LENGTH  # a few outputs (decode, verify), or none
    if shifted or short or z.shape[1] == 0:  # or empty input
        zp = torch.nn.functional.pad(z, (0, 0, pad, pad)) if pad else z
        L = max(zp.shape[1] - W + 1, 0)
        if not shifted:  # eager: every window [B, L', C, W] times the taps, summed tap by tap (3 ops)
            return (zp.unfold(1, W, 1) * w).sum(-1) if L else zp.new_zeros(zp.shape[0], 0, C)
        out = zp.new_zeros(zp.shape[0], L, C)
        taps = _taps_as_rows(w)  # [W, C]
        for tap in range(W if L else 0):
            out.addcmul_(zp[:, tap : tap + L], taps[tap])
        return out
    nhwc = z.permute(0, 2, 1).unsqueeze(2)  # [B, C, 1, L], channels-last strides
    out = torch.nn.functional.conv2d(nhwc, w[:, None, None, :], padding=(0, pad), groups=C)  # [B, C, 1, L']
    return out.squeeze(2).permute(0, 2, 1)  # [B, L', C]


class _CausalConv1d(torch.autograd.Function):
    """Depthwise conv in the [B, T, H*K] layout, forward and hand-written backward.

    CPU autograd of a depthwise F.conv1d spends several times the forward in convolution_backward (and runs on
    [B, H*K, T] copies); here the forward and the input gradient are each one channels-last depthwise conv
    (`_depthwise`, the input gradient with the taps flipped) and the weight gradient W products reduced over
    (B, T). full = cat(history, x) along time [B, W-1+T, H*K] in fp32 is the one tensor kept.
    With `edges` (packed documents) the few tokens near a document start are recomputed with the taps that
    cross the boundary dropped (exactly: no subtraction), and excluded from the shifted form in backward.
    """

    @staticmethod
    def forward(ctx, x, weight, history, edges=None):
        W = weight.shape[-1]
        full = torch.cat([history.float(), x.float()], dim=1)  # [B, W-1+T, H*K]
        w = weight.float()
        y = _depthwise(full, w, 0)
        if edges is not None:
            tok, keep = edges
            taps = w.t()[None] * keep[..., None]  # [n_e, W, D] the edge tokens' taps, crossing ones zeroed
            y[:, tok] = (full[:, tok[:, None] + torch.arange(W, device=tok.device)] * taps).sum(2)
            ctx.edges = (tok, keep, taps)
        else:
            ctx.edges = None
        ctx.save_for_backward(full, weight)
        ctx.dtypes = (x.dtype, history.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        full, weight = ctx.saved_tensors
        T, W = dy.shape[1], weight.shape[-1]
        dy, w = dy.float(), weight.float()
        if ctx.edges is not None:
            tok, keep, taps = ctx.edges
            dy_edge = dy[:, tok]  # [B, n_e, D]
            dy = dy.index_fill(1, tok, 0.0)  # the shifted form below must not see the edge tokens
        d_full = _depthwise(dy, w.flip(-1), W - 1)  # d full_s = sum_tap dy_{s - tap} w_tap
        d_weight = torch.stack([(dy * full[:, tap : tap + T]).sum(dim=(0, 1)) for tap in range(W)], dim=-1)
        if ctx.edges is not None:
            idx = tok[:, None] + torch.arange(W, device=tok.device)  # [n_e, W] rows of full
            d_full.index_add_(1, idx.flatten(), (dy_edge[:, :, None] * taps).flatten(1, 2))
            d_weight += (dy_edge[:, :, None] * full[:, idx] * keep[..., None]).sum(dim=(0, 1)).t()
        x_dtype, history_dtype = ctx.dtypes
        return d_full[:, W - 1 :].to(x_dtype), d_weight.to(weight.dtype), d_full[:, : W - 1].to(history_dtype), None


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same sum as shifted multiply-adds in the [B, T, H*K] layout, with a hand-written backward.

    With `cu_seqlens` the rows are one flattened sequence whose boundary-crossing taps are dropped (no loop over
    documents, no per-document padding).
    """
    if cu_seqlens is not None:
        _no_states(initial_state, output_final_state)
        B, T, D = x.shape
        _history(x, weight, None)  # the weight's shape check
        y = _packed_conv_op(x.reshape(1, B * T, D), weight, check_cu_seqlens(cu_seqlens, B, T))
        return y.view(B, T, D), None
    history = _history(x, weight, initial_state).transpose(1, 2)  # [B, W-1, H*K]
    y = apply(_CausalConv1d, x, weight, history)  # [B, T, H*K] fp32
    if not output_final_state:
        return y, None
    recent = torch.cat([history, x], dim=1)[:, x.shape[1] :]  # the last W-1 inputs [B, W-1, H*K]
    return y, recent.transpose(1, 2)


def _packed_args(flat: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple:
    """_CausalConv1d's (history, edges) for flat [1, B*T, H*K] as one sequence: zero history, document starts."""
    return _history(flat, weight, None).transpose(1, 2), _edges(cu_seqlens, flat.shape[1], weight.shape[-1])


def _packed_conv(flat: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """flat [1, B*T, H*K] as one sequence, the taps crossing a document start dropped -> [1, B*T, H*K] fp32."""
    return apply(_CausalConv1d, flat, weight, *_packed_args(flat, weight, cu_seqlens))


# The packed form as a custom op (kernels/opaque.py): its edge tokens are found with nonzero (a data-dependent
# size), which torch.compile would break the graph on. Backward recomputes the forward (W multiply-adds) for the
# hand-written backward's saved tensors.
@torch.library.custom_op("glm53::causal_conv1d_packed", mutates_args=(), tags=HOST_READING)
def _packed_conv_op(flat: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return _packed_conv(flat, weight, cu_seqlens)


@_packed_conv_op.register_fake
def _(flat, weight, cu_seqlens):
    return flat.new_empty(flat.shape, dtype=torch.float32)


@torch.library.custom_op("glm53::causal_conv1d_packed_backward", mutates_args=(), tags=HOST_READING)
def _packed_conv_backward_op(
    flat: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = StandInContext()
    _CausalConv1d.forward(ctx, flat, weight, *_packed_args(flat, weight, cu_seqlens))
    dx, dw = _CausalConv1d.backward(ctx, dy)[:2]
    return dx.contiguous(), dw.contiguous()


@_packed_conv_backward_op.register_fake
def _(flat, weight, cu_seqlens, dy):
    return flat.new_empty(flat.shape), weight.new_empty(weight.shape)


def _packed_conv_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _packed_conv_grad(ctx, dy):
    return (*_packed_conv_backward_op(*ctx.saved_tensors, dy), None)


_packed_conv_op.register_autograd(_packed_conv_grad, setup_context=_packed_conv_setup)


register("causal_conv1d", "reference", causal_conv1d_reference)
register("causal_conv1d", "fast", causal_conv1d)
