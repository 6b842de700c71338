"""torch.compile of the whole Glm53ForCausalLM on a packed batch (`cu_seqlens`): no graph break in the forward
(eval, and training with labels and every loss part: MTP, indexer KL, per-document balance, z-loss; the backward
is AOT autograd's of that one graph), and logits, every loss part, every gradient and the expert loads equal to
the eager model.

Legend: B batch, T time, n documents.
Eager drops duplicate boundaries and runs a batch of one document per row unpacked; compiled, the boundaries
keep their duplicates as empty documents and the packed path always runs (model/packing.py), so the
comparison also checks that every consumer skips empty documents and that packed equals unpacked.
Graph breaks are counted under fullgraph=False (fullgraph=True would accept data-dependent sizes silently; see
tests/compile/test_compile_model.py) and by torch._dynamo.explain, on backend "aot_eager" (no code generation).
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.losses import balance_loss
from glm53.model.packing import document_boundaries, segment_ids
from tests.helpers.modules import PACKED_LOSS_PARTS, assert_same_packed_run, packed_loss_batch, packed_loss_model

LOSS_PARTS = PACKED_LOSS_PARTS
B, T = 2, 19
# An empty document (5, 5), row start 19 given by the caller too, the final boundary twice: every duplicate is an
# empty document in the compiled graph. T = 19 > index_topk 8: sparse selection, incomplete pools.
PACKED = [0, 5, 5, 19, 30, 38, 38]
# One document per row, as many boundaries as PACKED (static shapes: the same compiled graphs run it): eager drops
# the duplicates and runs unpacked, compiled runs packed.
ROWS = [0, 0, 19, 19, 19, 38, 38]
CASES = {"packed-with-empty-documents": PACKED, "one-document-per-row": ROWS}


@pytest.fixture(scope="module")
def model() -> Glm53ForCausalLM:
    return packed_loss_model()


@pytest.fixture(scope="module")
def eager(model) -> dict[str, dict[str, object]]:
    """The eager results of both cases, computed before anything compiles: an eager kernel logging its first use
    changes a global the compiled graphs guard on (glm53/kernels/dispatch.py), which would recompile them."""
    return {name: run(model, model, cu) for name, cu in CASES.items()}


@pytest.fixture(scope="module")
def compiled(model, eager):
    torch._dynamo.reset()
    return torch.compile(model, backend="aot_eager")


def batch(vocab: int) -> dict[str, torch.Tensor]:
    return packed_loss_batch(vocab, B, T)


def run(model: Glm53ForCausalLM, fn, cu: list[int]) -> dict[str, object]:
    """An eval forward without labels, then a training forward+backward with labels, through `fn`."""
    inputs = batch(model.config.vocab_size)
    labels = inputs.pop("labels")
    cu_seqlens = torch.tensor(cu)
    for router in model.routers():
        router.counted_load = None
    model.eval()
    with torch.no_grad():
        logits = fn(**inputs, cu_seqlens=cu_seqlens).logits
    model.train()
    out = fn(**inputs, labels=labels, cu_seqlens=cu_seqlens)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    loads = [r.counted_load for r in model.routers() if r.counted_load is not None]
    return dict(
        logits=logits, train_logits=out.logits, grads=grads, loads=loads, **{k: getattr(out, k) for k in LOSS_PARTS}
    )


@pytest.mark.parametrize("case", CASES)
def test_whole_model_on_packed_batch_compiles_without_breaks_and_matches_eager(model, eager, compiled, case):
    ref = eager[case]
    torch._dynamo.utils.counters.clear()
    got = run(model, compiled, CASES[case])
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0  # forward and backward
    assert_same_packed_run(got, ref)


def test_explain_counts_no_graph_break_on_the_packed_training_forward(model):
    """torch._dynamo.explain on the forward with labels and every loss part, then its backward (one graph), whose
    top-k is the blocked selection (glm53::select_pools_blocked, no [B, T, P] scores)."""
    inputs = batch(model.config.vocab_size)
    model.train()

    def loss(input_ids, attention_mask, labels, cu_seqlens):
        return model(input_ids, attention_mask, labels, cu_seqlens=cu_seqlens).loss

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(**inputs, cu_seqlens=torch.tensor(PACKED))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    # the packed top-k is the blocked selection: no [B, T, P] index scores (packed kernel) nor their select_pools
    ops = {str(n.target) for n in explained.graphs[0].graph.nodes if str(n.target).startswith("glm53.")}
    assert "glm53.select_pools_blocked.default" in ops, sorted(ops)
    assert not ops & {"glm53.select_pools.default", "glm53.indexer_scores_packed.default"}, sorted(ops)


def test_compiled_boundaries_keep_duplicates_as_empty_documents():
    """document_boundaries under compile: sorted, duplicates kept ([n + 1 + B + 1] from the shapes); the segment
    ids count non-empty documents only, equal to eager's on the deduplicated boundaries."""
    cu = torch.tensor(PACKED)
    eager = document_boundaries(B, T, cu.device, cu)
    compiled = torch.compile(lambda c: document_boundaries(B, T, c.device, c), backend="eager", fullgraph=True)(cu)
    assert eager.tolist() == [0, 5, 19, 30, 38]
    assert compiled.tolist() == [0, 0, 5, 5, 19, 19, 30, 38, 38, 38]
    assert torch.equal(segment_ids(compiled, B, T), segment_ids(eager, B, T))
    assert segment_ids(eager, B, T).flatten().tolist() == [0] * 5 + [1] * 14 + [2] * 11 + [3] * 8


def test_document_balance_loss_with_slot_counts_from_shapes():
    """The per-document balance loss with its slots sized by the document count from cu_seqlens' shape (exact,
    or with duplicates: the compiled boundaries), or by M (the default): the mean over documents with a valid
    token of each document's own balance loss (document 0 is all padding and drops out)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B * T, 8, generator=g)
    indices = logits.topk(2, dim=-1).indices
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :5] = False
    valid[1, 2] = False
    docs = [(0, 5), (5, 19), (19, 30), (30, 38)]
    flat = valid.flatten()
    expected = torch.stack([balance_loss(logits[s:e], indices[s:e], flat[s:e].view(1, -1)) for s, e in docs[1:]])
    cu = torch.tensor(PACKED)
    eager = document_boundaries(B, T, cu.device, cu)
    with_duplicates = torch.tensor([0, 0, 5, 5, 19, 19, 30, 38, 38, 38])  # what the compiled model makes
    for bounds, n in ((eager, 4), (with_duplicates, 9), (eager, None)):
        got = balance_loss(logits, indices, valid, segment_ids=segment_ids(bounds, B, T), num_documents=n)
        torch.testing.assert_close(got, expected.mean(), rtol=1e-6, atol=0)


def test_document_balance_loss_reads_the_ids_once_per_tensor_version():
    """Every MoE layer's balance loss of a step takes the same segment ids: their bound is read on the host once
    (not once per layer), and read again after an in-place change, which is then caught."""
    from glm53.profiling import HostSyncs

    logits = torch.randn(B * T, 8, generator=torch.Generator().manual_seed(4))
    chosen, valid = logits.topk(2, dim=-1).indices, torch.ones(B, T, dtype=torch.bool)
    ids = segment_ids(document_boundaries(B, T, torch.device("cpu"), torch.tensor(PACKED)), B, T)
    with HostSyncs() as syncs:
        for _ in range(3):
            balance_loss(logits, chosen, valid, segment_ids=ids, num_documents=4)
    assert dict(syncs.counts) == {"item": 1}
    ids[1, -1] = 4  # a fifth document: too many for the bound
    with pytest.raises(ValueError, match="num_documents=4 is too small: segment_ids go up to 4"):
        balance_loss(logits, chosen, valid, segment_ids=ids, num_documents=4)


@pytest.mark.parametrize(
    "bad,match",
    [(0, "positive int"), (2.0, "positive int"), (True, "positive int"), (3, "too small: segment_ids go up to 3")],
)
def test_document_balance_loss_rejects_a_bad_document_count(bad, match):
    logits = torch.randn(B * T, 8, generator=torch.Generator().manual_seed(3))
    ids = segment_ids(document_boundaries(B, T, torch.device("cpu"), torch.tensor(PACKED)), B, T)
    with pytest.raises(ValueError, match=f"num_documents.*{match}|{match}"):
        balance_loss(
            logits,
            logits.topk(2, dim=-1).indices,
            torch.ones(B, T, dtype=torch.bool),
            segment_ids=ids,
            num_documents=bad,
        )
