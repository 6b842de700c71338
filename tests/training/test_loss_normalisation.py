"""Loss normalisation: the counts of every loss part, micro-batches summing to the global batch's gradient, and
(on gloo) data parallelism with unequal masks equal to one process on the global batch.

Legend: B batch, T time.
The model runs in the dense indexer regime (index_topk >= T): which pools a query may pick then depends on its own
row only, so one forward on the global batch and forwards on its parts select the same keys.

loss_counts edges the normalisation tests do not reach: a padding hole inside a row (a pool with an invalid token
is no candidate, so it never opens the indexer KL rows) and document starts where position_ids jump without
restarting at 0.

Legend: B batch, T time.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.losses import IGNORE_INDEX, document_spans, indexer_query_rows
from tests.helpers.loss_jobs import PARTS, accumulated_step, single_process

B, T = 8, 16
TOL = dict(rtol=1e-5, atol=1e-7)


def config_dict(**overrides) -> dict:
    """Every loss part on: MTP over two depths, indexer KL, balance loss and z-loss; a full and a shared indexer."""
    fields = dict(
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        indexer_types=["full", "full", "full", "shared"],
        index_topk=T,
        num_nextn_predict_layers=1,
        mtp_depth=2,
        indexer_loss_weight=1.0,
        router_aux_loss_coef=0.01,
        router_z_loss_coef=1e-3,
    )
    config = Glm53Config.tiny(**{**fields, **overrides})
    d = config.to_dict()
    return {k: v for k, v in d.items() if k in Glm53Config.__dataclass_fields__ and k != "extra"}


def unequal_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention_mask and SFT-style labels whose counts differ a lot between the halves and quarters:
    the first rows are mostly padding with few targets, the last ones full with targets everywhere."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 320, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    labels = ids.clone()
    for row in range(B // 2):
        mask[row, : T - 3 - 2 * row] = 0  # left padding: 3, 5, 7, 9 real tokens
        labels[row, : T - 1] = IGNORE_INDEX  # one target: a prompt with a one-token answer
    labels[B // 2, : T // 2] = IGNORE_INDEX
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, labels.masked_fill(mask == 0, IGNORE_INDEX)


@pytest.fixture(scope="module")
def case():
    config = config_dict()
    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config(**config))
    with torch.no_grad():  # index scores far from the attention target: an indexer KL well above rounding
        for name, p in model.named_parameters():
            if ".indexer." in name and p.dim() == 2:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask, labels = unequal_batch()
    return dict(
        config=config,
        state=state,
        ids=ids,
        mask=mask,
        labels=labels,
        reference=single_process(config, state, ids, mask, labels),
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def check_grads(grads: dict, reference: dict, tol: float = 1e-4) -> None:
    assert set(grads) == set(reference["grads"])
    floor = 1e-4 * max(g.abs().max().item() for g in reference["grads"].values())
    bad = {}
    for n, g in grads.items():
        ref = reference["grads"][n]
        err = ((g - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()
        if err > tol:
            bad[n] = err
    assert not bad, f"gradients differ from one forward on the global batch: {bad}"


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_own_counts_reproduce_the_per_forward_means(mode):
    """Given this batch's own counts, every part equals its default mean: the counts mirror the losses."""
    config = Glm53Config(**config_dict(indexer_loss_mode=mode, index_topk=8))  # a real sparse selection too
    model = Glm53ForCausalLM(config)
    ids, mask, labels = unequal_batch(seed=1)
    plain = model(ids, attention_mask=mask, labels=labels)
    counts = model.loss_counts(labels, mask)
    assert counts.targets.tolist()[0] == (labels[:, 1:] != IGNORE_INDEX).sum().item()
    assert counts.tokens.tolist()[0] == mask.sum().item() and counts.sequences.tolist() == [B, B, B]
    assert counts.indexer_rows[0] > counts.indexer_rows[2] > 0
    given = model(ids, attention_mask=mask, labels=labels, loss_denominators=counts)
    for name in PARTS:
        torch.testing.assert_close(getattr(given, name), getattr(plain, name), **TOL, msg=name)
    doubled = model(ids, attention_mask=mask, labels=labels, loss_denominators=counts + counts)
    torch.testing.assert_close(doubled.loss, plain.loss / 2, **TOL)


def test_micro_batches_sum_to_the_global_batch(case):
    """Gradient accumulation over unequal micro-batches: one process, four micro-batches, global counts."""
    model = Glm53ForCausalLM(Glm53Config(**case["config"]))
    model.load_state_dict(case["state"])
    ids, mask, labels = case["ids"], case["mask"], case["labels"]
    rows = torch.arange(B).chunk(4)
    den = sum(
        (model.loss_counts(labels[r], mask[r]) for r in rows[1:]), model.loss_counts(labels[rows[0]], mask[rows[0]])
    )
    for r in rows:
        out = model(ids[r], attention_mask=mask[r], labels=labels[r], loss_denominators=den)
        out.loss.backward()
    check_grads({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, case["reference"])
    # the mean of per-micro-batch means weights the tokens differently: the check above can fail
    model.zero_grad(set_to_none=True)
    for r in rows[:2]:
        (model(ids[r], attention_mask=mask[r], labels=labels[r]).loss / len(rows)).backward()
    with pytest.raises(AssertionError, match="lm_head"):
        check_grads({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, case["reference"])


@pytest.mark.parametrize("layout", ["dp2", "dp2-accum2", "2x2-accum2"])
def test_data_parallel_with_unequal_masks_equals_one_process(request, case, layout):
    """FSDP2 over two dp ranks whose halves hold 4 vs 100 targets (with TP 2 inside each in 2x2): every loss
    part and gradient is one process's on the global batch."""
    micro = 2 if "accum2" in layout else 1
    tp = 2 if layout.startswith("2x2") else 1
    pool = request.getfixturevalue("pool4" if tp == 2 else "pool2")
    results = pool.run(
        accumulated_step,
        config=case["config"],
        state=case["state"],
        ids=case["ids"],
        mask=case["mask"],
        labels=case["labels"],
        dp=2,
        tp=tp,
        micro=micro,
    )
    reference = case["reference"]
    for name in PARTS:
        mean = sum(res["parts"][name] for res in results) / len(results)
        assert rel_err(mean, reference["parts"][name]) <= 1e-5, (name, mean, reference["parts"][name])
    for res in results:
        check_grads(res["grads"], reference)


def test_packed_rows_count_each_document_alone():
    """With position_ids (restarting at 0 per document) the counts are the sum of each document's own: the
    denominators a packed forward needs (MTP never predicts across a boundary; the balance loss is per document)."""
    config = Glm53Config(**config_dict())
    model = Glm53ForCausalLM(config)
    lengths = [[5, 8, 1, 2], [16]]
    labels = torch.randint(1, 320, (2, T))
    labels[0, 3] = IGNORE_INDEX
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, 14:] = 0  # the last "document" of row 0 is padding
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    packed = model.loss_counts(labels, mask, position_ids)
    alone, start = [], 0
    for n in lengths[0]:
        alone.append(model.loss_counts(labels[:1, start : start + n], mask[:1, start : start + n]))
        start += n
    expected = sum(alone, model.loss_counts(labels[1:], mask[1:]))
    torch.testing.assert_close(packed.stacked(), expected.stacked())
    # documents with a valid token: 5, 8, 1 in row 0 (2 is padding) and row 1; MTP depths have none in the 1
    assert packed.sequences.tolist() == [4.0, 3.0, 3.0]
    one_sequence = model.loss_counts(labels, mask)
    assert packed.targets[1] < one_sequence.targets[1]  # MTP targets across boundaries are gone


# --------------------------------------------------------------------------------------------- loss_counts at its edges
def test_indexer_rows_start_at_the_first_complete_pool():
    """index_kpool 4, pools from each row's first valid token. Row 0 (a hole at 2): pool [0, 4) is incomplete, the
    first complete one ends at 7. Row 1 (left-padded by 2): pool [2, 6) ends at 5."""
    config = Glm53Config.tiny()
    assert config.index_kpool == 4
    valid = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # [B, T]
    expected = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(indexer_query_rows(valid, config), expected)


def test_documents_start_where_positions_do_not_continue():
    spans = document_spans(torch.tensor([[0, 1, 2, 5, 6, 0, 1], [3, 4, 5, 6, 7, 8, 9]]))
    assert spans == [[(0, 3), (3, 5), (5, 7)], [(0, 7)]]
