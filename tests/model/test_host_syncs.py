"""Host syncs per training step stay bounded and independent of T (glm53.profiling.HostSyncs counts them).

Legend: T tokens per row, L layers. What remains per step: the input and label id checks (2, once per step), and
per full-indexer MLA layer one nonzero (the pools complete in some row) and the sparse attention's key spans (one
transfer in forward, one in backward). KDA reads nothing: the bounded gate decides its path statically, and
packed boundaries are validated once per tensor. At the released schedule (45 layers, 11 MLA) that is
2 + 11 * 3 = 35 per step whatever T is (benchmarks/bench_host_syncs.py measures it at the released widths).
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels.kda import fast
from glm53.model.kda import KimiDeltaAttention
from glm53.profiling import HostSyncs


def _step(model, ids, **kwargs) -> HostSyncs:
    with HostSyncs() as syncs:
        model(ids, labels=ids, return_logits=False, **kwargs).loss.backward()
    return syncs


@pytest.mark.parametrize("T", [64, 200])
def test_training_step_syncs_do_not_grow_with_T(T, monkeypatch):
    monkeypatch.setattr(fast, "STATE_BUDGET", 1)  # one 32-token chunk per KDA block: many blocks per row
    config = Glm53Config.tiny(indexer_loss_weight=0.01)
    assert config.layer_types.count("indexed_attention") == 1
    model = Glm53ForCausalLM(config)
    ids = torch.randint(1, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    syncs = _step(model, ids)
    # the ids' range checks (2 items), the indexer's kept pools (nonzero), the blocked top-k's and the two sparse
    # attention calls' key spans (tolist): once per step or per call, never per block or per token
    assert dict(syncs.counts) == {"item": 2, "nonzero": 1, "tolist": 3}


def test_packed_step_validates_the_boundaries_once(monkeypatch):
    monkeypatch.setattr(fast, "STATE_BUDGET", 1)
    config = Glm53Config.tiny(indexer_loss_weight=0.01)
    model = Glm53ForCausalLM(config)
    ids = torch.randint(1, config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(40), torch.arange(56)])[None]  # two documents
    unpacked = _step(model, ids).total
    packed = _step(model, ids, position_ids=position_ids)
    # packing adds its own once-per-step reads (the boundaries made from position_ids and checked once, the conv
    # edge tokens found once, the document count of the losses); nothing per layer or per kernel call (the 9
    # convs' edge search alone, forward and backward, was 18 nonzero)
    assert unpacked == 6 and packed.counts["nonzero"] == 3 and packed.total <= 12, packed.counts


def test_packed_step_syncs_per_layer_are_the_unpacked_ones(monkeypatch):
    """Four more layers (3 KDA + 1 MLA, 4 MoE) add the same syncs packed as unpacked (the MLA layer's nonzero and
    key spans): the packed top-k reads no more than the unpacked one, and the per-document balance loss reads its
    segment ids once per step, not once per MoE layer."""
    monkeypatch.setattr(fast, "STATE_BUDGET", 1)
    ids = torch.randint(1, Glm53Config.tiny().vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(24)] * 4)[None]  # four documents
    steps = {}
    for layers in (4, 8):
        config = Glm53Config.tiny(
            indexer_loss_weight=0.01, num_hidden_layers=layers, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1)
        )
        model = Glm53ForCausalLM(config)
        steps[layers] = (_step(model, ids).counts, _step(model, ids, position_ids=position_ids).counts)
    unpacked_added = steps[8][0] - steps[4][0]
    assert dict(unpacked_added) == {"nonzero": 1, "tolist": 3}
    assert steps[8][1] - steps[4][1] == unpacked_added, steps


def test_released_width_kda_layer_reads_nothing():
    """One KDA layer at the released widths (64 heads x 128, the -5 gate), 2 blocks of 128 tokens: no sync."""
    config = Glm53Config(hidden_size=64, num_hidden_layers=1, vocab_size=256, pad_token_id=0)
    layer = KimiDeltaAttention(config)
    x = torch.randn(1, 256, 64, requires_grad=True)
    assert fast.n_blocks(1, 256, 64, 128, 128) == 2
    with HostSyncs() as syncs:
        layer(x).square().sum().backward()
    assert syncs.total == 0, syncs.counts
