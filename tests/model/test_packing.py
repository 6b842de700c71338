"""Packed documents through the whole model: each document behaves exactly as if it ran alone.

- logits of a packed row equal each document's own forward (fp32, 1e-5 relative), on the fast and the reference
  kernels, absorbed and per-head MLA, bounded and softplus KDA gates;
- `position_ids` restarting per document give the same boundaries as explicit `cu_seqlens`, with padding;
- the packed loss and every parameter gradient equal the token-weighted combination of the per-document loss
  parts (every part on: MTP over two depths, indexer KL dense and sparse, balance loss per document, z-loss), and
  the expert loads equal the per-document loads summed.
Document lengths: 1, 2, one short of a fast KDA chunk (31), longer than a chunk (33, 70), longer than
index_topk (8), none a multiple of index_kpool (4) except where noted.

Edges of model/packing.py's boundaries: positions that jump without restarting at 0, boundaries given without
the row starts, duplicate boundaries (empty documents) in segment ids, the one-document-per-row case, the
compile form (duplicates kept, sorted) against the eager one, and the k-pool layout written out by hand.

Legend (glm53/model/__init__.py): B batch, T time, n documents, P pools, L tokens per pool.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels import use_backend
from glm53.losses import balance_loss, indexer_kl_terms, z_loss
from glm53.model.packing import document_boundaries, document_pool_layout, segment_ids

LENGTHS = [1, 2, 31, 33, 70, 9, 13, 6]
REL = 1e-5
# 16 indexer heads: a pool scores exactly 0 (every head's ReLU at 0) with odds ~2^-16, not ~2^-4, so tied top
# scores, which torch.topk may break differently in a longer row (README, "Indexer ties"), practically vanish.
LAYERS = dict(
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    indexer_types=["full", "full", "full", "shared"],
    index_n_heads=16,
)


def build(seed: int = 0, **overrides) -> Glm53ForCausalLM:
    """The tiny model with KDA, a full and a shared indexer layer, MoE; indexer weights spread out (a KL loss
    far from 0, and scores far apart)."""
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(Glm53Config.tiny(**{**LAYERS, **overrides}))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".indexer." in name and p.dim() == 2:
                p.normal_(std=0.3, generator=g)
    return model


def documents(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (1, n), generator=g) for n in lengths]


def cu_for(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


CASES = {
    "fast-absorbed": ("fast", True, {}),
    "fast-per-head": ("fast", False, {}),
    "fast-softplus-gate": ("fast", True, dict(linear_lower_bound=None)),
    "reference-kernels": ("reference", True, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_logits_match_documents_alone(case):
    backend, absorb, overrides = CASES[case]
    model = build(**overrides).eval()
    model.set_numerics(mla_absorb=absorb)
    docs = documents(LENGTHS)
    with use_backend(backend), torch.no_grad():
        packed = model(torch.cat(docs, dim=1), cu_seqlens=cu_for(LENGTHS)).logits
        bounds = cu_for(LENGTHS).tolist()
        for doc, s, e in zip(docs, bounds[:-1], bounds[1:]):
            alone = model(doc).logits
            assert rel_err(packed[:, s:e], alone) <= REL, (doc.shape[1], rel_err(packed[:, s:e], alone))
        # and the boundaries matter: run as one sequence, the later documents change
        whole = model(torch.cat(docs, dim=1)).logits
    assert rel_err(whole[:, bounds[-2] :], packed[:, bounds[-2] :]) > 1e-3


def test_position_ids_match_cu_seqlens_with_padding():
    """[2, T] rows packed DataCollatorWithFlattening-style plus right padding on the second row."""
    model = build().eval()
    rows = [[9, 1, 31, 6], [2, 13, 33]]
    T = max(sum(r) for r in rows) + 3
    docs = documents([n for r in rows for n in r], seed=2)
    ids = torch.zeros(2, T, dtype=torch.long)
    position_ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    it = iter(docs)
    for b, lengths in enumerate(rows):
        t = 0
        for n in lengths:
            ids[b, t : t + n] = next(it)[0]
            position_ids[b, t : t + n] = torch.arange(n)
            t += n
        mask[b, :t] = 1
        position_ids[b, t:] = torch.arange(T - t)  # the padding run counts as one more (invalid) document
    assert T == 51
    cu = torch.tensor([0, 9, 10, 41, 47, 51, 53, 66, 99, 102])  # the same boundaries, explicit, over the flat tokens
    with torch.no_grad():
        from_positions = model(ids, attention_mask=mask, position_ids=position_ids).logits
        from_cu = model(ids, attention_mask=mask, cu_seqlens=cu).logits
        torch.testing.assert_close(from_positions, from_cu, rtol=0, atol=0)
        it = iter(docs)
        for b, lengths in enumerate(rows):
            t = 0
            for n in lengths:
                alone = model(next(it)).logits
                assert rel_err(from_positions[b : b + 1, t : t + n], alone) <= REL
                t += n
        # rows of one document each (position_ids 0..T-1) are the ordinary, unpacked forward
        plain = torch.arange(T).expand(2, T)
        torch.testing.assert_close(
            model(ids, attention_mask=mask, position_ids=plain).logits,
            model(ids, attention_mask=mask).logits,
            rtol=0,
            atol=0,
        )


def test_bad_boundaries_raise():
    model = build().eval()
    ids = torch.randint(1, 320, (1, 10))
    with pytest.raises(ValueError, match="end at 10"):
        model(ids, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="at most one of cu_seqlens and position_ids"):
        model(ids, cu_seqlens=torch.tensor([0, 10]), position_ids=torch.arange(10)[None])
    with pytest.raises(ValueError, match="position_ids must be an integer tensor of shape"):
        model(ids, position_ids=torch.arange(9)[None])


# ------------------------------------------------------------------------------------------ loss and gradients
TRAINING = dict(
    num_nextn_predict_layers=1,
    mtp_depth=2,
    mtp_loss_weight=0.3,
    indexer_loss_weight=1.0,
    router_aux_loss_coef=0.01,
    router_z_loss_coef=1e-3,
)
GRAD_LENGTHS = [1, 2, 9, 31, 33, 6]


def captured_forward(model, ids, **kwargs):
    """model(ids, labels=ids) and what its loss assembly saw: (out, valid, per-layer stats, MTP runs)."""
    seen = {}
    assemble = model._add_losses

    def capture(out, labels, valid, stats, mtp_runs, *rest):
        seen.update(valid=valid, stats=stats, mtp=mtp_runs)
        return assemble(out, labels, valid, stats, mtp_runs, *rest)

    model._add_losses = capture
    try:
        out = model(ids, labels=ids, **kwargs)
    finally:
        del model._add_losses
    return out, seen


def document_parts(model, doc: torch.Tensor, mode: str) -> dict:
    """One document alone: every loss part as (numerator, count) per term, from its own forward."""
    out, seen = captured_forward(model, doc)
    n = doc.shape[1]
    ce_sum = lambda logits, d: F.cross_entropy(
        logits[0, : max(n - 1 - d, 0)],
        doc[0, d + 1 :],  # noqa: E731
        reduction="sum",
    )
    parts = {"lm": [(ce_sum(out.logits, 0), n - 1)]}
    # each MTP run carries the normed hidden state the shared lm_head reads
    parts["mtp"] = [(ce_sum(model.lm_head(h), d), max(n - 1 - d, 0)) for d, (h, _, _) in enumerate(seen["mtp"], 1)]
    records = [(s, seen["valid"]) for s in seen["stats"]] + [(s, v) for _, v, s in seen["mtp"]]
    records = [(s, v) for s, v in records if s.router_logits is not None]
    has = [int(v.any()) for _, v in records]
    parts["balance"] = [(balance_loss(s.router_logits, s.router_indices, v) * h, h) for (s, v), h in zip(records, has)]
    parts["z"] = [(z_loss(s.router_logits, v) * v.sum(), int(v.sum())) for s, v in records]
    groups = [(seen["stats"], seen["valid"])] + [([s], v) for _, v, s in seen["mtp"]]
    parts["indexer"] = []
    for stats, valid in groups:
        fulls = [s for s in stats if s.index_scores is not None]
        for full, term in zip(fulls, indexer_kl_terms(stats, valid, mode)):
            rows = int((valid & (full.candidate if mode == "dense" else full.selected).any(-1)).sum())
            parts["indexer"].append((term * rows, rows))
    return parts


def combine(per_doc: list[dict], config: Glm53Config) -> dict[str, torch.Tensor]:
    """Token-weighted (balance: document-weighted) sums of the per-document parts, as the packed model defines
    them: each term its numerators over its counts, then the mean over layers / depths."""

    def pooled(name):
        terms = zip(*(d[name] for d in per_doc))  # per term: every document's (numerator, count)
        return [sum(num for num, _ in t) / max(1, sum(cnt for _, cnt in t)) for t in terms]

    mtp = torch.stack(pooled("mtp")).mean()
    aux = torch.stack(
        [
            config.router_aux_loss_coef * b + config.router_z_loss_coef * z
            for b, z in zip(pooled("balance"), pooled("z"))
        ]
    ).mean()
    indexer = torch.stack(pooled("indexer")).mean()
    lm = pooled("lm")[0]
    loss = lm + config.mtp_loss_weight * mtp + aux + config.indexer_loss_weight * indexer
    return dict(lm_loss=lm, mtp_loss=mtp, aux_loss=aux, indexer_loss=indexer, loss=loss)


def gradients(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_packed_gradients_match_token_weighted_documents(mode):
    model = build(**TRAINING, indexer_loss_mode=mode).train()
    docs = documents(GRAD_LENGTHS, seed=3)
    out = model(torch.cat(docs, dim=1), labels=torch.cat(docs, dim=1), cu_seqlens=cu_for(GRAD_LENGTHS))
    packed_loads = [r.counted_load.clone() for r in model.routers()]
    packed = gradients(model, out.loss)
    for r in model.routers():
        r.counted_load = None
    expected = combine([document_parts(model, doc, mode) for doc in docs], model.config)
    doc_loads = [r.counted_load for r in model.routers()]  # accumulated over the per-document forwards
    for name, value in expected.items():
        assert rel_err(getattr(out, name), value) <= REL, (name, getattr(out, name), value)
    assert out.indexer_loss > 1e-3 and out.aux_loss > 0  # the parts are really on
    reference = gradients(model, expected["loss"])
    assert packed.keys() == reference.keys()
    assert any(n.startswith("mtp.") for n in packed) and any(".indexer." in n for n in packed)
    floor = 1e-4 * max(g.abs().max().item() for g in reference.values())  # fp32 sums in another order
    bad = {
        n: rel_err(g, reference[n])
        for n, g in packed.items()
        if (g - reference[n]).abs().max() > 1e-4 * max(reference[n].abs().max().item(), floor)
    }
    assert not bad, bad
    for got, want in zip(packed_loads, doc_loads):  # expert loads: real tokens only, as the documents alone
        assert torch.equal(got, want)


def test_packed_forward_divides_by_its_loss_counts():
    """`loss_counts(..., position_ids)` (the trainer's denominators, counted per document) are exactly what a packed
    forward divides each loss part by: given them, it returns its own default means, part by part."""
    model = build(**TRAINING).train()
    rows, T = [[9, 1, 31, 6], [2, 13, 35]], 50
    ids = torch.randint(1, 320, (2, T), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, 47:] = 0  # row 0 ends in padding (one more, invalid, document)
    position_ids = torch.cat(
        [torch.cat([torch.arange(n) for n in row + [T - sum(row)] * (sum(row) < T)])[None] for row in rows]
    )
    labels = ids.masked_fill(mask == 0, -100)
    own = model(ids, attention_mask=mask, labels=labels, position_ids=position_ids)
    counts = model.loss_counts(labels, mask, position_ids)
    given = model(ids, attention_mask=mask, labels=labels, position_ids=position_ids, loss_denominators=counts)
    for name in ("lm_loss", "mtp_loss", "aux_loss", "indexer_loss", "loss"):
        assert rel_err(getattr(given, name), getattr(own, name)) <= REL, name


# -------------------------------------------------------------------------------------------- boundaries at their edges
CPU = torch.device("cpu")


def brute_segments(cu: list[int], B: int, T: int) -> list[list[int]]:
    """Index of each token's document among the non-empty ones, by a plain loop."""
    ids, k = [], -1
    for s, e in zip(cu[:-1], cu[1:]):
        if e > s:
            k += 1
            ids += [k] * (e - s)
    return [ids[b * T : (b + 1) * T] for b in range(B)]


def test_positions_that_jump_start_a_document():
    """A document starts wherever the position does not continue the previous one, not only at 0."""
    pos = torch.tensor([[0, 1, 2, 5, 6, 0, 1, 2], [3, 4, 0, 1, 2, 3, 9, 10]])
    cu = document_boundaries(2, 8, CPU, position_ids=pos)
    assert cu.tolist() == [0, 3, 5, 8, 10, 14, 16]


def test_boundaries_without_row_starts_get_them():
    """cu_seqlens over the flattened tokens need not list the row starts: they are added."""
    cu = document_boundaries(2, 4, CPU, cu_seqlens=torch.tensor([0, 2, 8]))
    assert cu.tolist() == [0, 2, 4, 8]


def test_one_document_per_row_is_not_packed():
    assert document_boundaries(2, 4, CPU, cu_seqlens=torch.tensor([0, 4, 4, 8])) is None
    assert document_boundaries(2, 4, CPU, cu_seqlens=torch.tensor([0, 8])) is None
    assert document_boundaries(2, 4, CPU, position_ids=torch.arange(4).expand(2, 4)) is None
    assert document_boundaries(1, 4, CPU, cu_seqlens=torch.tensor([0, 1, 4])).tolist() == [0, 1, 4]


def test_segment_ids_skip_empty_documents():
    cu = [0, 3, 3, 4, 4, 6, 6, 8, 12]  # with every row start (a valid packed batch)
    ids = segment_ids(torch.tensor(cu), 3, 4)
    assert ids.tolist() == brute_segments(cu, 3, 4) and int(ids.max()) == 4  # 5 non-empty documents


def test_compile_form_keeps_duplicates_and_gives_the_same_segments(monkeypatch):
    """Under torch.compile (is_compiling faked here) the boundaries are sorted with duplicates kept; segment ids
    from them equal the eager ones."""
    given = torch.tensor([0, 5, 5, 8, 11, 12])
    eager = document_boundaries(3, 4, CPU, cu_seqlens=given)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compiled = document_boundaries(3, 4, CPU, cu_seqlens=given)
    assert compiled.tolist() == [0, 0, 4, 5, 5, 8, 8, 11, 12, 12]
    assert eager.tolist() == sorted(set(compiled.tolist()))
    assert torch.equal(segment_ids(compiled, 3, 4), segment_ids(eager, 3, 4))


# row 0: documents of 5 and 3 tokens; row 1: one of 3 padded tokens only, then one of 5 (its last pool short)
POOL_CU, POOL_KPOOL = torch.tensor([0, 5, 8, 11, 16]), 3


def pool_case() -> torch.Tensor:
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, :3] = False
    return valid


def test_document_pool_layout_written_out():
    """Eager: every pool from each document's first valid token, short last pools kept (their tokens past the end
    invalid), no pool for an all-padding document, the slots past a row's pools empty (T + slot, invalid)."""
    positions, token_valid = document_pool_layout(pool_case(), POOL_CU, POOL_KPOOL)
    empty = [8, 9, 10]
    assert positions.tolist() == [
        [[0, 1, 2], [3, 4, 5], [5, 6, 7], empty, empty, empty],
        [[3, 4, 5], [6, 7, 8], empty, empty, empty, empty],
    ]
    full, none = [True] * 3, [False] * 3
    assert token_valid.tolist() == [
        [full, [True, True, False], full, none, none, none],
        [full, [True, True, False], none, none, none, none],
    ]


def test_document_pool_layout_compile_form_written_out(monkeypatch):
    """Compile form (is_compiling faked): whole pools only, P = T // L slots, the rest empty."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    positions, token_valid = document_pool_layout(pool_case(), POOL_CU, POOL_KPOOL)
    assert positions.tolist() == [[[0, 1, 2], [5, 6, 7]], [[3, 4, 5], [8, 9, 10]]]
    assert token_valid.tolist() == [[[True] * 3] * 2, [[True] * 3, [False] * 3]]
