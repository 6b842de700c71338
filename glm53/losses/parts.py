"""Training losses beyond next-token cross-entropy: expert balancing, router z-loss, DSA indexer KL.

Legend: B batch, T time (queries), S keys, H heads, K MLA query/key head width, E experts, k experts per token
(balance_loss's locals call it K), P k-pools, L tokens per pool, M = B * T tokens, Tq a block of queries,
D model width, vocab the vocabulary.
The semantics are in docs/training.md. (f_i and P_i below are DeepSeek-V3's symbols, not dimensions.)
- Sequence-wise balance loss (DeepSeek-V3 eq. 17-20): per sequence, f_i = E / (k T) * #tokens routed to i and
  P_i = mean over tokens of s_i / sum_j s_j (sigmoid scores); loss = sum_i f_i P_i, averaged over sequences.
- Router z-loss (ST-MoE eq. 5): mean over tokens of logsumexp(router logits)^2.
- Indexer KL (DeepSeek-V3.2 eq. 3-4, with GLM's k-pools): target = main attention probabilities summed over
  heads and within each pool, restricted to the candidate pools ("dense") or the selected pools ("sparse"),
  L1-normalised (the incomplete tail is never a candidate, so it is excluded); student = softmax of the index
  scores over the same pools; loss = KL(target || student), mean over query tokens that have such pools.
  A "full" indexer serving "shared" layers learns the average of the targets of every layer using its
  selection (itself included).
Model code fills a `LayerStats` per layer; the functions here turn them into losses.
Packed documents (glm53/model/packing.py): the balance loss is per document (`segment_ids`), and the indexer
target attends within the query's document over its document's pools (`cu_seqlens`).

Normalisation: each loss is a sum over its terms (target tokens, sequences, valid tokens, indexer query rows)
divided by a denominator: by default this batch's own count (a per-forward mean); given one (a `LossCounts`
field, loss_counts.py), the count of the whole global batch, so that gradients summed over micro-batches and
data-parallel ranks equal the gradient of one forward on the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ..hooks import as_local, as_plain, vocab_parallel_loss
from ..kernels.dispatch import kernel
from ..model.context import LayerStats
from ..model.inputs import check_token_ids
from .cp_balance import owned_document_balance

IGNORE_INDEX = -100  # label value that contributes no loss (transformers' convention)


# -------------------------------------------------------------------------------------------- next-token CE
def per_term(total: torch.Tensor, count: torch.Tensor, denominator: torch.Tensor | None) -> torch.Tensor:
    """total / denominator, or this batch's mean total / count when no denominator is given.

    A given denominator may be fractional (a global count divided by the data-parallel degree) and is zero only
    when every rank's total is zero, hence the tiny floor instead of 1.
    """
    if denominator is None:
        return total / count.clamp_min(1)
    return total / denominator.to(total.device, total.dtype).clamp_min(torch.finfo(total.dtype).tiny)


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Labels [B, T] aligned with input_ids -> the next-token targets [B, T] (IGNORE_INDEX past the end)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy in fp32, summed over targets / `num_targets` (default: the mean); labels are
    aligned with input_ids and shifted here, each in [0, vocab) or IGNORE_INDEX (else an InputError naming the value
    and where it is; a value check reads the labels on the host, skipped while compiling).

    With no target token (T = 1, or every label IGNORE_INDEX) the loss is 0 with zero gradients rather than
    0 / 0 = NaN, so such a micro-batch adds nothing to an accumulated gradient instead of poisoning it.
    """
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(logits.shape[:2])} like input_ids, got {tuple(labels.shape)}")
    check_token_ids("labels", labels, logits.shape[-1], logits.device, ignore=IGNORE_INDEX)
    shifted = next_token_targets(labels)
    # Under tensor parallelism the logits are vocab-sharded and the loss a replicated DTensor: as_plain hands it
    # back as a plain tensor so it adds to the losses computed from plain activations.
    total = F.cross_entropy(
        logits.float().flatten(0, 1), shifted.flatten().long(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return per_term(as_plain(total), (shifted != IGNORE_INDEX).sum(), num_targets)


def causal_lm_head_loss(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor,
    num_targets: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """`causal_lm_loss(lm_head(hidden), labels, num_targets)` without ever holding [B, T, vocab] logits.

    hidden [B, T, D] (what the head reads), lm_head an nn.Linear without bias, labels [B, T] aligned with
    input_ids. The head and the cross-entropy run as one `linear_cross_entropy` kernel (dispatch: "fast" walks the
    tokens in chunks keeping only per-token softmax statistics, "reference" is the plain full-logits form); the
    logits are computed in the head's dtype and the softmax in fp32, as `causal_lm_loss` does after `lm_head`.
    Under tensor parallelism the head is vocab-sharded and `glm53.hooks.vocab_parallel_loss` combines the ranks'
    statistics instead. Labels as `causal_lm_loss`'s; `check=False` skips their value check (one host read) for
    labels already checked, as Glm53ForCausalLM.forward does on entry.
    """
    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:2])} like input_ids, got {tuple(labels.shape)}")
    if check:
        check_token_ids("labels", labels, lm_head.weight.shape[0], hidden.device, ignore=IGNORE_INDEX)
    return head_target_loss(hidden, lm_head, next_token_targets(labels), num_targets, check=False)


def head_target_loss(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    num_targets: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """`causal_lm_head_loss` from targets [B, T] already aligned with hidden (position i predicts targets[i]; the
    labels context parallelism hands each rank). A target outside [0, vocab) and not IGNORE_INDEX is an InputError
    (unless `check=False`): the chunked and the vocab-parallel kernels would each mis-count it silently."""
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("causal_lm_head_loss takes a head without bias (lm_head.bias is set)")
    if check:
        check_token_ids("targets", targets, lm_head.weight.shape[0], hidden.device, ignore=IGNORE_INDEX)
    shifted = targets.flatten()
    flat = hidden.flatten(0, 1)  # [M, D]
    sharded = vocab_parallel_loss(lm_head)
    if sharded is not None:
        total = sharded(flat, shifted)
    else:
        total = kernel("linear_cross_entropy")(flat, as_local(lm_head, "weight"), shifted)
    return per_term(as_plain(total), (shifted != IGNORE_INDEX).sum(), num_targets)


# ----------------------------------------------------------------------------------------------- MoE balance
# Segment ids already checked against a document count, with that count and the tensor version: every MoE layer's
# balance loss of a step takes the same ids, so their maximum is read once per step, not once per layer (an
# in-place change bumps the version; inference tensors keep none and are checked every call).
_CHECKED_SEGMENTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _document_slots(segment_ids: torch.Tensor, num_documents: int | None) -> int:
    """The per-document sums' size: `num_documents`, checked eagerly against the ids (while compiling it is a size
    from cu_seqlens' shape, which the model made), or every token's own slot."""
    if num_documents is None:
        return segment_ids.numel()
    if torch.compiler.is_compiling():
        return num_documents
    if isinstance(num_documents, bool) or not isinstance(num_documents, int) or num_documents < 1:
        raise ValueError(f"num_documents must be a positive int, got {num_documents!r}")
    known = not segment_ids.is_inference() and _CHECKED_SEGMENTS.get(segment_ids) == (
        num_documents,
        segment_ids._version,
    )
    if known:
        return num_documents
    top = int(segment_ids.max()) if segment_ids.numel() else -1  # NOTE: syncs (once per ids tensor and count)
    if top >= num_documents:
        raise ValueError(f"num_documents={num_documents} is too small: segment_ids go up to {top}")
    if not segment_ids.is_inference():
        _CHECKED_SEGMENTS[segment_ids] = (num_documents, segment_ids._version)
    return num_documents


def balance_loss(
    logits: torch.Tensor,
    indices: torch.Tensor,
    valid: torch.Tensor,
    num_sequences: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    cp=None,
    num_documents: int | None = None,
) -> torch.Tensor:
    """Sequence-wise balance loss sum_i f_i P_i, summed over sequences with a valid token / `num_sequences`
    (default: their mean).

    logits [M, E] router logits, indices [M, k] chosen experts, valid [B, T] bool (padding is not counted);
    with `segment_ids` [B, T] (packed documents) every document is a sequence, and `num_documents` is a bound
    on their ids (ids < it: the document count n, from cu_seqlens' shape; default M). `cp` (a SequenceShards,
    context parallelism): this rank's share of the loss of the whole sequences (`sharded_balance_loss`).
    """
    if cp is not None:
        return sharded_balance_loss(logits, indices, valid, num_sequences, segment_ids, cp)
    if segment_ids is not None:
        n_docs = _document_slots(segment_ids, num_documents)
        return _document_balance_loss(logits, indices, valid, segment_ids, num_sequences, n_docs)
    B, T = valid.shape
    E, K = logits.shape[-1], indices.shape[-1]
    scores = logits.float().sigmoid().view(B, T, E)
    probs = scores / scores.sum(-1, keepdim=True)  # s'_i,t: scores normalised over all experts
    m = valid.float()  # [B, T]
    n = m.sum(-1)  # [B] tokens per sequence
    P = torch.einsum("bte,bt->be", probs, m) / n.clamp_min(1)[:, None]
    hits = m[:, :, None].expand(B, T, K).reshape(B, T * K)
    counts = torch.zeros(B, E, device=logits.device).scatter_add_(1, indices.view(B, T * K), hits)
    f = counts * E / (K * n.clamp_min(1))[:, None]
    per_seq = (f * P).sum(-1)
    has = (n > 0).float()
    return per_term((per_seq * has).sum(), has.sum(), num_sequences)


def _document_balance_loss(logits, indices, valid, segment_ids, num_sequences, n_docs: int):
    """`balance_loss` with one sequence per document: f and P summed per document by index_add into `n_docs`
    slots, a size from the shapes (a count read from the ids would sync and break a compiled graph); slots of no
    token have no valid token and drop out like empty documents."""
    E, K = logits.shape[-1], indices.shape[-1]
    seg = segment_ids.flatten()
    scores = logits.float().sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)  # [M, E]
    m = valid.flatten().float()
    n = torch.zeros(n_docs, device=logits.device).index_add_(0, seg, m)  # valid tokens per document
    P = torch.zeros(n_docs, E, device=logits.device).index_add_(0, seg, probs * m[:, None]) / n.clamp_min(1)[:, None]
    slots = (seg[:, None] * E + indices).flatten()  # (document, expert) of every routed slot
    counts = torch.zeros(n_docs * E, device=logits.device).index_add_(0, slots, m.repeat_interleave(K)).view(-1, E)
    f = counts * E / (K * n.clamp_min(1))[:, None]
    has = (n > 0).float()
    return per_term(((f * P).sum(-1) * has).sum(), has.sum(), num_sequences)


def sharded_balance_loss(logits, indices, valid, num_sequences, segment_ids, cp) -> torch.Tensor:
    """`balance_loss` of whole sequences split over context-parallel ranks: this rank's share (the shares sum to it).

    f and P are sums over a sequence's tokens, which several ranks hold: each rank sums its slice per row, the sums
    are stacked over the ranks (with gradient) and every rank computes the whole loss; as its share it returns
    loss / cp.size, and the stack's backward sends every rank's gradient to the tokens' ranks. Packed documents
    (global `segment_ids`): only the pieces crossing slice edges are stacked, and a document counts on the rank
    holding its first token (cp_balance.py; sizes from the shapes, no host read).
    """
    if segment_ids is not None:
        total, count = owned_document_balance(logits, indices, valid, segment_ids, cp)
        return per_term(total, count, num_sequences)
    B, T = valid.shape
    E, K = logits.shape[-1], indices.shape[-1]
    seq, n_seq = torch.arange(B, device=logits.device).repeat_interleave(T), B
    scores = logits.float().sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)  # [M, E]
    m = valid.flatten().float()
    tokens_and_probs = torch.cat([m[:, None], probs * m[:, None]], dim=-1)  # [M, 1 + E]
    sums = torch.zeros(n_seq, 1 + E, device=logits.device).index_add_(0, seq, tokens_and_probs)
    slots = (seq[:, None] * E + indices).flatten()
    counts = torch.zeros(n_seq * E, device=logits.device).index_add_(0, slots, m.repeat_interleave(K)).view(-1, E)
    total = cp.stack(torch.cat([sums, counts], dim=-1)).sum(0)  # [sequences, 1 + 2E] over the whole sequences
    n, P, counts = total[:, 0], total[:, 1 : 1 + E], total[:, 1 + E :]
    f = counts * E / (K * n.clamp_min(1))[:, None]
    has = (n > 0).float()
    loss = per_term(((f * P / n.clamp_min(1)[:, None]).sum(-1) * has).sum(), has.sum(), num_sequences)
    return loss / cp.size


def z_loss(logits: torch.Tensor, valid: torch.Tensor, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss: logsumexp_i(logits_i)^2 summed over valid tokens / `num_tokens` (default: the mean).
    logits [M, E], valid [B, T]."""
    m = valid.flatten().float()
    return per_term((torch.logsumexp(logits.float(), dim=-1).square() * m).sum(), m.sum(), num_tokens)


def router_aux_loss(
    records: list[tuple[LayerStats, torch.Tensor, int]],
    balance_coef: float,
    z_coef: float,
    denominators=None,
    segment_ids: torch.Tensor | None = None,
    cp=None,
    num_documents: int | None = None,
) -> torch.Tensor | None:
    """balance_coef * balance + z_coef * z, averaged over the MoE layers in `records` ((stats, valid, view)
    triples; view 0 is the main model, d the MTP depth d). `denominators` (a LossCounts) replaces each layer's
    own counts with its view's `sequences` and `tokens`; `segment_ids` [B, T]: packed documents, the balance
    loss per document (`num_documents`: see `balance_loss`); `cp`: context parallelism (`sharded_balance_loss`)."""
    terms = []
    for stats, valid, view in records:
        if stats.router_logits is None:
            continue
        seqs, toks = (None, None) if denominators is None else (denominators.sequences[view], denominators.tokens[view])
        term = stats.router_logits.new_zeros(())
        if balance_coef > 0:
            term = term + balance_coef * balance_loss(
                stats.router_logits, stats.router_indices, valid, seqs, segment_ids, cp, num_documents
            )
        if z_coef > 0:
            term = term + z_coef * z_loss(stats.router_logits, valid, toks)
        terms.append(term)
    if not terms or (balance_coef == 0 and z_coef == 0):
        return None
    return torch.stack(terms).mean()


# ------------------------------------------------------------------------------------------------ indexer KL
def normalized_target(mass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pool masses restricted to `mask` and L1-normalised per query: [B, T, P] (rows without pools stay 0)."""
    mass = mass.masked_fill(~mask, 0.0)
    return mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)


def pool_kl(
    scores: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    valid: torch.Tensor,
    num_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(target || softmax(scores over mask)), summed over valid queries with a pool in `mask` / `num_rows`
    (default: their mean; with dense and sparse masks alike those are the queries with a candidate pool).

    scores [B, T, P] (fp32 index scores), target [B, T, P] (sums to 1 over mask), mask [B, T, P], valid [B, T].
    """
    logp = scores.float().masked_fill(~mask, torch.finfo(torch.float32).min).log_softmax(-1)
    target = target.masked_fill(~mask, 0.0)
    kl = (torch.xlogy(target, target) - target * logp).sum(-1)  # [B, T]
    rows = (valid & mask.any(-1)).float()
    return per_term((kl * rows).sum(), rows.sum(), num_rows)


def chunked_pool_kl(
    scores: torch.Tensor,
    masses: list[torch.Tensor],
    mask: torch.Tensor,
    valid: torch.Tensor,
    num_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`pool_kl(scores, mean_i normalized_target(masses[i], mask), mask, valid, num_rows)`, computed KL_CHUNK query
    rows at a time in forward and backward: no [B, T, P] temporary beyond the inputs (the targets, the student's
    log-probabilities and their gradient exist one chunk at a time; the backward recomputes them)."""
    return _ChunkedPoolKl.apply(scores, mask, valid, num_rows, *masses)


KL_CHUNK = 256  # query rows per chunk of the indexer KL


def _kl_chunk(scores, masses, mask, valid, t0, t1):
    """Rows [t0, t1) -> (KL per row [B, Tq], row weight [B, Tq], student probabilities, target) ([B, Tq, P])."""
    return kl_rows(scores[:, t0:t1], [x[:, t0:t1] for x in masses], mask[:, t0:t1], valid[:, t0:t1])


def kl_rows(scores, masses, mask, valid):
    """A block of query rows: scores, masses [B, Tq, P], mask [B, Tq, P], valid [B, Tq] -> (KL per row [B, Tq],
    row weight [B, Tq], student log-probabilities, target [B, Tq, P]). The one form of the indexer KL's rows
    (chunked_pool_kl here and the recomputing op, losses/indexer_kl.py)."""
    target = torch.stack([normalized_target(x.float(), mask) for x in masses]).mean(0)
    logp = scores.float().masked_fill(~mask, torch.finfo(torch.float32).min).log_softmax(-1)
    kl = (torch.xlogy(target, target) - target * logp).sum(-1)
    return kl, (valid & mask.any(-1)).float(), logp, target


def kl_rows_grad(logp: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """d (sum of weight * KL per row) / d scores for `kl_rows`' logp, target, mask [B, Tq, P], weight [B, Tq]:
    p - target over the mask (target sums to 1 there), 0 off it."""
    d = (logp.exp() * target.sum(-1, keepdim=True) - target).masked_fill_(~mask, 0.0)
    return d * weight[..., None]


class _ChunkedPoolKl(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, mask, valid, num_rows, *masses):
        total, count = scores.new_zeros((), dtype=torch.float32), scores.new_zeros((), dtype=torch.float32)
        for t0 in range(0, scores.shape[1], KL_CHUNK):
            kl, rows, _, _ = _kl_chunk(scores, masses, mask, valid, t0, t0 + KL_CHUNK)
            total, count = total + (kl * rows).sum(), count + rows.sum()
        ctx.save_for_backward(scores, mask, valid, *masses)
        ctx.per_row = per_term(total.new_ones(()), count, num_rows)  # d loss / d total
        return total * ctx.per_row

    @staticmethod
    def backward(ctx, grad):
        scores, mask, valid, *masses = ctx.saved_tensors
        d_scores = torch.zeros_like(scores, dtype=torch.float32)
        for t0 in range(0, scores.shape[1], KL_CHUNK):
            _, rows, logp, target = _kl_chunk(scores, masses, mask, valid, t0, t0 + KL_CHUNK)
            d_scores[:, t0 : t0 + KL_CHUNK] = kl_rows_grad(
                logp, target, mask[:, t0 : t0 + KL_CHUNK], rows * grad * ctx.per_row
            )
        return (d_scores.to(scores.dtype), None, None, None, *(None for _ in masses))


__all__ = [
    "IGNORE_INDEX",
    "LayerStats",
    "causal_lm_loss",
    "causal_lm_head_loss",
    "balance_loss",
    "sharded_balance_loss",
    "head_target_loss",
    "kl_rows",
    "kl_rows_grad",
    "next_token_targets",
    "per_term",
    "normalized_target",
    "pool_kl",
    "router_aux_loss",
    "z_loss",
]
