"""Packed batches under FSDP2 + TP (2x2, with activation checkpointing) and FSDP2 alone (dp=4) on gloo: the loss,
every loss part and every gradient equal one process on the whole batch.

Rows are packed DataCollatorWithFlattening-style (`position_ids` restarting at 0 per document); each data-parallel
share holds the same document lengths (different tokens), so the mean of the ranks' losses is the global one
whatever the loss normalisation across ranks. Every training loss is on (MTP, indexer KL, balance, z-loss).
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.helpers.packing_jobs import packed_reference, packed_step

REL_TOL = 1e-4
GRAD_FLOOR = 1e-4  # as tests/parallel/test_parallel_gloo.py: relative to 1e-4 of the largest gradient at least
ROW_DOCS = [[1, 6, 2, 11], [12, 3, 5]]  # document lengths of the rows of one data-parallel share (T = 20)
T = 20


def config_dict() -> dict:
    config = Glm53Config.tiny(
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        indexer_types=["full", "full", "full", "shared"],
        index_n_heads=16,
        num_nextn_predict_layers=1,
        indexer_loss_weight=1.0,
        router_aux_loss_coef=0.01,
        router_z_loss_coef=1e-3,
    )
    return {k: v for k, v in config.to_dict().items() if k in Glm53Config.__dataclass_fields__ and k != "extra"}


def packed_batch(shares: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`shares` copies of ROW_DOCS' layout with fresh tokens: ids and position_ids [2 * shares, T]."""
    g = torch.Generator().manual_seed(seed)
    rows = ROW_DOCS * shares
    ids = torch.randint(1, 320, (len(rows), T), generator=g)
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in lengths])[None] for lengths in rows])
    return ids, position_ids


@pytest.fixture(scope="module")
def case():
    config = config_dict()
    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config(**config))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a KL far from 0 and untied index scores
            if ".indexer." in name and p.dim() == 2:
                p.normal_(std=0.3, generator=g)
    return dict(config=config, state={k: v.clone() for k, v in model.state_dict().items()})


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-12) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(floor)).item()


@pytest.mark.parametrize("layout", ["fsdp-tp-2x2-checkpointing", "fsdp-dp4"])
def test_packed_batch_matches_one_process(pool4, case, layout):
    dp, tp = (2, 2) if layout.startswith("fsdp-tp") else (4, 1)
    ids, position_ids = packed_batch(shares=dp)
    reference = packed_reference(case["config"], case["state"], ids, position_ids)
    assert {"mtp_loss", "aux_loss", "indexer_loss"} <= set(reference["parts"])
    results = pool4.run(
        packed_step,
        config=case["config"],
        state=case["state"],
        ids=ids,
        position_ids=position_ids,
        dp=dp,
        tp=tp,
        checkpointing=tp > 1,
    )
    floor = GRAD_FLOOR * max(g.abs().max().item() for g in reference["grads"].values())
    for rank, res in enumerate(results):
        assert rel_err(res["loss"], reference["loss"]) <= REL_TOL, (rank, res["loss"], reference["loss"])
        for name, value in res["parts"].items():
            assert rel_err(value, reference["parts"][name]) <= REL_TOL, (rank, name, value, reference["parts"][name])
        assert res["grads"].keys() == reference["grads"].keys()
        bad = {n: rel_err(g, reference["grads"][n], floor) for n, g in res["grads"].items()}
        bad = {n: e for n, e in bad.items() if e > REL_TOL}
        assert not bad, f"rank {rank}: gradients differ from one process: {bad}"
