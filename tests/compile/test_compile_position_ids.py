"""torch.compile of the whole Glm53ForCausalLM on a batch packed as `position_ids` (restarting at 0 per document,
transformers' DataCollatorWithFlattening layout): no graph break in the forward (eval, and training with every loss
part), no recompile for another document count, and logits, every loss part, every gradient and the expert loads
equal to the eager model given the same `position_ids` and given the equivalent `cu_seqlens`.

Legend: B batch, T time, n documents.
Compiled, the document starts become a cu_seqlens of B * T + 1 entries from the shape (model/packing.py
`static_boundaries`: the starts, then empty documents), so one graph serves every document count; eager finds
the starts with torch.nonzero and runs a batch of one document per row unpacked. Breaks are counted under
fullgraph=False, as tests/compile/test_compile_packed.py does, on backend "aot_eager".
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.losses import balance_loss
from glm53.model.inputs import packing_fields
from glm53.model.packing import document_boundaries, document_pool_layout, segment_ids, static_boundaries
from tests.helpers.modules import PACKED_LOSS_PARTS, assert_same_packed_run, packed_loss_batch, packed_loss_model

LOSS_PARTS = PACKED_LOSS_PARTS
B, T = 2, 19


def positions(*rows: list[int]) -> torch.Tensor:
    """[B, T] position_ids from each row's document lengths; a negative first length -l is a row that starts
    l tokens before the end of a document which began in an earlier row (positions 7, 8, ... there)."""
    out = []
    for lens in rows:
        row = [torch.arange(7, 7 - lens[0])] if lens[0] < 0 else []
        row += [torch.arange(n) for n in lens[1 if lens[0] < 0 else 0 :]]
        out.append(torch.cat(row))
    return torch.stack(out)


CASES = {  # the whole model's
    # row 0: a document of length 1 between two others; row 1 starts mid-document (positions 7..13)
    "mid-document-and-length-1": positions([5, 1, 13], [-7, 8, 4]),
    # eager runs it unpacked (one document per row), compiled packed: the same graph as the other
    "one-document-per-row": positions([19], [19]),
}
MANY = positions([2, 1, 1, 3, 4, 8], [4, 4, 4, 4, 3])  # eleven documents, short last pools (helpers' tests)


@pytest.fixture(scope="module")
def model() -> Glm53ForCausalLM:
    return packed_loss_model()


def batch(vocab: int) -> dict[str, torch.Tensor]:
    return packed_loss_batch(vocab, B, T)


def run(model: Glm53ForCausalLM, fn, packing: dict[str, torch.Tensor]) -> dict[str, object]:
    """An eval forward without labels, then a training forward+backward with labels, through `fn`."""
    inputs = batch(model.config.vocab_size)
    labels = inputs.pop("labels")
    for router in model.routers():
        router.counted_load = None
    model.eval()
    with torch.no_grad():
        logits = fn(**inputs, **packing).logits
    model.train()
    out = fn(**inputs, labels=labels, **packing)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    loads = [r.counted_load for r in model.routers() if r.counted_load is not None]
    return dict(
        logits=logits, train_logits=out.logits, grads=grads, loads=loads, **{k: getattr(out, k) for k in LOSS_PARTS}
    )


def as_cu_seqlens(pos: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same packing as `cu_seqlens` (eager's boundaries; the row starts for one document per row)."""
    cu = document_boundaries(B, T, pos.device, position_ids=pos)
    return dict(cu_seqlens=torch.arange(0, B * T + 1, T) if cu is None else cu)


@pytest.fixture(scope="module")
def eager(model) -> dict[str, dict[str, dict[str, object]]]:
    """Eager results (position_ids, and the equivalent cu_seqlens) of every case, before anything compiles: an eager
    kernel logging its first use changes a global the compiled graphs guard on (glm53/kernels/dispatch.py)."""
    return {
        name: dict(
            position_ids=run(model, model, dict(position_ids=pos)), cu_seqlens=run(model, model, as_cu_seqlens(pos))
        )
        for name, pos in CASES.items()
    }


def assert_same_run(got: dict, ref: dict, what: str) -> None:
    assert_same_packed_run(got, ref, what)


def test_whole_model_on_position_ids_compiles_once_without_breaks_and_matches_eager(model, eager):
    """One compile (eval graph, training graph) serves two document counts (6, and 2 rows of one): the first case
    compiles, the other runs under error_on_recompile; no graph break in any forward or backward."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    for i, (name, pos) in enumerate(CASES.items()):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = run(model, compiled, dict(position_ids=pos))
        breaks = torch._dynamo.utils.counters["graph_break"]
        assert sum(breaks.values()) == 0, (name, list(breaks))
        assert_same_run(got, eager[name]["position_ids"], f"{name} vs eager position_ids:")
        assert_same_run(got, eager[name]["cu_seqlens"], f"{name} vs eager cu_seqlens:")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the eval and the training forward


@pytest.mark.parametrize("case", [*CASES, "eleven-documents"])
def test_static_boundaries_are_eager_ones_then_empty_documents(case):
    """Compiled (inductor, fullgraph) packing fields from position_ids: the eager boundaries, then B * T repeated
    up to B * T + 1 entries; segment ids equal eager's (empty documents take no id)."""
    pos = MANY if case == "eleven-documents" else CASES[case]
    valid = torch.ones(B, T, dtype=torch.bool)
    eager = packing_fields(valid, None, pos)
    compiled = torch.compile(lambda v, p: packing_fields(v, None, p), backend="inductor", fullgraph=True)(valid, pos)
    cu = as_cu_seqlens(pos)["cu_seqlens"]
    assert compiled["cu_seqlens"].tolist() == cu.tolist() + [B * T] * (B * T + 1 - cu.numel())
    assert torch.equal(compiled["segment_ids"], segment_ids(cu, B, T))
    if eager["segment_ids"] is not None:
        assert torch.equal(compiled["segment_ids"], eager["segment_ids"])
    if case == "mid-document-and-length-1":
        assert cu.tolist() == [0, 5, 6, 19, 26, 34, 38]


def test_compiled_pool_layout_holds_the_whole_pools_in_T_over_L_slots():
    """Compiled with B * T + 1 boundaries (T - n + B empty documents), the layout would need ceil(T / L) + n - B + 1
    slots with every short last pool; it holds the whole pools only (the complete ones here: no padding inside a
    pool), in eager's order, in T // L slots, the rest empty."""
    pos = MANY
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False  # left padding: the row's first document's pools start at its first valid token
    kpool = 4
    eager_pos, eager_valid = document_pool_layout(valid, document_boundaries(B, T, pos.device, position_ids=pos), kpool)
    starts = torch.ones(B, T, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    layout = torch.compile(
        lambda v, s: document_pool_layout(v, static_boundaries(s), kpool), backend="eager", fullgraph=True
    )
    got_pos, got_valid = layout(valid, starts)
    assert got_pos.shape == got_valid.shape == (B, T // kpool, kpool)
    for b in range(B):
        whole = eager_valid[b].all(-1)
        n = int(whole.sum())
        assert n > 0 and not eager_valid[b].all(-1).all()  # the case has short pools to drop
        assert torch.equal(got_pos[b, :n], eager_pos[b, whole]) and got_valid[b, :n].all()
        assert not got_valid[b, n:].any()


def test_document_balance_loss_with_B_times_T_document_slots():
    """num_documents from the compiled cu_seqlens' shape (B * T, mostly empty documents) gives the loss of the exact
    count: the mean over documents of each document's own balance loss."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B * T, 8, generator=g)
    indices = logits.topk(2, dim=-1).indices
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False
    pos = MANY
    cu = document_boundaries(B, T, pos.device, position_ids=pos)
    flat = valid.flatten()
    docs = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    expected = torch.stack([balance_loss(logits[s:e], indices[s:e], flat[s:e].view(1, -1)) for s, e in docs])
    ids = segment_ids(cu, B, T)
    got = balance_loss(logits, indices, valid, segment_ids=ids, num_documents=B * T)
    torch.testing.assert_close(got, expected.mean(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got, balance_loss(logits, indices, valid, segment_ids=ids, num_documents=11))


def test_context_parallel_boundaries_compile_to_static_boundaries():
    """Context parallelism's boundaries (a slice's document starts, model/cp.py; the gathered ids, key_sequence.py)
    compiled (fullgraph): eager's boundaries, then empty documents up to B * T + 1 entries, never None."""
    from glm53.model.key_sequence import segment_boundaries
    from glm53.model.packing import starts_to_cu_seqlens

    pos = CASES["mid-document-and-length-1"]
    starts = torch.ones(B, T, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    cu = as_cu_seqlens(pos)["cu_seqlens"].tolist()
    padded = cu + [B * T] * (B * T + 1 - len(cu))
    ids = segment_ids(torch.tensor(cu), B, T)
    for fn, arg in ((starts_to_cu_seqlens, starts), (segment_boundaries, ids)):
        assert fn(arg).tolist() == cu
        assert torch.compile(fn, backend="eager", fullgraph=True)(arg).tolist() == padded, fn.__name__
    one_per_row = torch.zeros(B, T, dtype=torch.long) + torch.arange(B)[:, None]
    assert segment_boundaries(one_per_row) is None
    compiled = torch.compile(segment_boundaries, backend="eager", fullgraph=True)(one_per_row)
    assert compiled.tolist() == [0, T] + [B * T] * (B * T - 1)
