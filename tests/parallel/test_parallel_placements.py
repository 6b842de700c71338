"""The placement every parameter gets from `parallelize` on a TP mesh, and the vocab-parallel embedding's pad row.

Legend: V vocab, D model width, E experts, I expert width.
Runs a simulated world under LocalTensorMode with the fake process group (the `meshes` fixture of
test_parallel_boundary.py): placements are read from the DTensor parameters, not from the plan's keys, so a plan
entry with the wrong style (colwise for rowwise, a replicated projection that should be split) fails here.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from glm53 import Glm53ForCausalLM
from glm53.parallel import loss_parallel_context, parallelize
from tests.parallel.test_parallel_boundary import WORLD, meshes, per_rank, tiny  # noqa: F401 (fixture)

COL, ROW, REP = Shard(0), Shard(1), Replicate()  # nn.Linear weight [out, in]: colwise splits out, rowwise in
# (FQN pattern, placement) in order; the first match wins. Every parameter must match one.
EXPECTED = [
    (r"model\.embed_tokens\.weight", Shard(0)),  # vocab-parallel rows
    (r"lm_head\.weight", COL),  # vocab-sharded logits
    (r".*\.self_attn\.(q|k|v|f_b|b|g_b)_proj\.weight", COL),  # KDA heads
    (r".*\.self_attn\.[qkv]_conv1d\.weight", Shard(0)),  # per-channel convs follow the heads
    (r".*\.self_attn\.(dt_bias|A_log)", Shard(0)),
    (r".*\.self_attn\.(f_a|g_a)_proj\.weight", REP),  # low-rank entries of the gates
    (r".*\.self_attn\.o_norm\.weight", REP),
    (r".*\.self_attn\.indexer\..*", REP),  # top-k identical on every rank
    (r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_a_layernorm|kv_a_layernorm)\.weight", REP),
    (r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight", COL),  # MLA heads
    (r".*\.self_attn\.o_proj\.weight", ROW),
    (r".*\.mlp\.gate\.weight", REP),  # router
    (r".*\.mlp\.experts\.gate_up_proj", _StridedShard(1, split_factor=2)),  # each rank: its gate and up rows
    (r".*\.mlp\.experts\.down_proj", Shard(2)),
    (r".*\.(gate_proj|up_proj)\.weight", COL),  # dense MLP and shared expert
    (r".*\.down_proj\.weight", ROW),
    (r".*_hc\.(fn|base|scale)", REP),
    (r".*(layernorm|norm|enorm|hnorm)\.weight", REP),
    (r".*\.eh_proj\.weight", REP),
]


def expected_placement(name: str):
    for pattern, placement in EXPECTED:
        if re.fullmatch(pattern, name):
            return placement
    raise AssertionError(f"{name}: no expected placement listed")


@pytest.mark.parametrize("layout", ["kda-mla-shared", "mtp"])
def test_every_parameter_gets_its_placement(meshes, layout):  # noqa: F811
    config = tiny() if layout == "kda-mla-shared" else tiny(num_nextn_predict_layers=1)
    model = Glm53ForCausalLM(config)
    full_shapes = {n: p.shape for n, p in model.named_parameters()}
    with LocalTensorMode(WORLD):
        parallelize(model, meshes["tp2"])
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            want = expected_placement(name)
            assert param.placements == (want,), f"{name}: {param.placements} instead of {want}"
            local = param.to_local().shape
            if isinstance(want, Shard) and not isinstance(want, _StridedShard):
                assert local[want.dim] * 2 == full_shapes[name][want.dim], (name, local)
            elif want == REP:
                assert local == full_shapes[name], name


def test_vocab_parallel_embedding_gives_the_pad_row_no_gradient(meshes):  # noqa: F811
    """Left padding with labels on every real token: the last pad position predicts the first real token, so the
    pad embedding reaches the loss; under TP (rows split over ranks) its gradient stays zero, like one process."""
    config = tiny()
    torch.manual_seed(0)
    model = Glm53ForCausalLM(config)
    pad = config.pad_token_id
    ids = torch.randint(1, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, pad)
    labels = ids.masked_fill(mask == 0, -100)
    ref = copy.deepcopy(model)
    ref(ids, attention_mask=mask, labels=labels).lm_loss.backward()
    expected = ref.model.embed_tokens.weight.grad
    assert expected[pad].abs().max() == 0 and expected.abs().max() > 0
    with LocalTensorMode(WORLD):
        parallelize(model, meshes["tp2"])
        with loss_parallel_context(model):
            model(ids, attention_mask=mask, labels=labels).lm_loss.backward()
        for grad in per_rank(model.model.embed_tokens.weight.grad):
            assert grad[pad].abs().max() == 0
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
