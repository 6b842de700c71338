"""Composed meshes on gloo (world 4): tp2 x ep2, cp2 x ep2, cp2 x tp2 and dp2 x cp2, each one training step
compared with one process on the same checkpoint and global batch.

Every case runs the hybrid tiny model (KDA, MLA with a full indexer, KDA, MLA reusing the top-k, MoE) with MTP,
the indexer KL, the balance and z-losses and activation checkpointing; the cp cases also get padding and packed
documents that cross the cp slices. Asserted on every rank: the loss and every part, every gradient, the
clipped norm, the parameters after an SGD step and the router biases after `update_router_bias` (bit-equal:
the integer loads of the whole global batch), plus the placements each expert parameter has on the mesh.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.helpers.mesh_jobs import composed_reference, composed_step
from tests.parallel.test_parallel_gloo import TRAINING, check_parity, config_dict

KDA_CHUNK = 32  # the fast KDA kernel's chunk: cp slices of 34 tokens are no multiple of it (nor of the k-pool, 4)
T_CP = 2 * KDA_CHUNK + 3  # 67 tokens: cp 2 pads one (right padding inside the last slice)
T_PLAIN = 12
EXPERT = "model.layers.1.mlp.experts"


def make_case(seed: int, rows: int, T: int, packed: bool = False) -> dict:
    config = config_dict(**TRAINING)
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(Glm53Config(**config))
    with torch.no_grad():
        for router in model.routers():
            router.e_score_correction_bias.normal_(std=0.01, generator=torch.Generator().manual_seed(seed + 5))
        for name, p in model.named_parameters():  # an indexer KL well away from 0 (see test_parallel_gloo)
            if ".indexer." in name and p.dim() == 2:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(seed + 7))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, config["vocab_size"], (rows, T), generator=torch.Generator().manual_seed(seed + 1))
    mask = torch.ones(rows, T, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[-1, -4:] = 0  # right padding
    position_ids = None
    if packed:  # documents ending just before, at and after the cp boundary (34 at cp 2)
        lengths = [[20, 13, 2, 32], [34, 33], [33, 1, 33], [10, 57]][:rows]
        position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    return dict(config=config, state=state, ids=ids, mask=mask, position_ids=position_ids)


CASES = {  # name: (degrees, rows, T, packed)
    "tp2xep2": (dict(tp=2, ep=2), 4, T_PLAIN, False),
    "cp2xep2": (dict(cp=2, ep=2), 2, T_CP, True),
    "cp2xtp2": (dict(cp=2, tp=2), 2, T_CP, True),
    "dp2xcp2": (dict(dp=2, cp=2), 2, T_CP, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_composed_mesh_matches_one_process(pool4, name):
    degrees, rows, T, packed = CASES[name]
    case = make_case(seed=list(CASES).index(name), rows=rows, T=T, packed=packed)
    reference = composed_reference(**case)
    assert {"mtp_loss", "aux_loss", "indexer_loss"} <= set(reference["parts"])
    results = pool4.run(composed_step, checkpointing=True, **degrees, **case)
    check_parity(results, reference)
    E, I2, D = (
        case["config"]["n_routed_experts"],
        2 * case["config"]["moe_intermediate_size"],
        case["config"]["hidden_size"],
    )
    placements, shape, mesh = results[0]["placements"][f"{EXPERT}.gate_up_proj"]
    if "ep" in degrees and "tp" in degrees:  # (dp_cp_ep FSDP of size 1 is dropped) ep on dim 0, tp on the width
        assert placements[-2] == Shard(0) and shape[0] == E // 2 and shape[1] == I2 // 2, (placements, shape)
    elif "ep" in degrees:  # ep on dim 0, FSDP over cp on the width
        assert shape == (E // 2, I2 // 2, D), (placements, shape, mesh)
