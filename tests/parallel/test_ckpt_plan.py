"""The scale tool's read plan (meta device, fake process group) splits the checkpoint over the ranks: every rank
reads about its share, together they read every byte, and the CLI prints the table.

The scale tool's byte counts written out: the FP8 release size of the tiny model counted from its own tensors,
a whole-world plan reading exactly that, scale blocks of slices that start inside a block, the disk width of
the fp32 keep-list, the largest official tensor and the per-rank shard bytes.

Legend: E experts, I expert width, D model width; bytes are the on-disk bytes of the FP8 release layout (128 x 128
blocks with an fp32 scale each), fp32 for glm53.precision's keep-list, bf16 for everything else.
"""

from __future__ import annotations

import pytest

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel.ckpt_plan import _disk_width, _scale_bytes, plan_rank
from glm53.precision import keeps_fp32
from glm53.tools.ckpt_plan import main
from glm53.utils import ceil_div

CONFIG = Glm53Config.tiny(
    num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4, hidden_size=64, moe_intermediate_size=32
)


def test_ranks_read_their_share_and_together_everything():
    plans = [plan_rank(CONFIG, r, 4, 1) for r in range(4)]  # FSDP shards every parameter over the 4 ranks
    total = plans[0].checkpoint_bytes
    for p in plans:
        assert p.read_bytes < 0.3 * total, (p, total)  # a quarter, plus the FP8 scales of the blocks it touches
    # Each stored element is read by exactly one rank (replicated buffers by all, scales by every toucher).
    assert total <= sum(p.read_bytes - p.replicated_bytes for p in plans) + plans[0].replicated_bytes < 1.05 * total
    for p in (plan_rank(CONFIG, r, 2, 2) for r in (0, 3)):
        assert p.read_bytes < 0.4 * total, (p, total)


def test_cli_prints_a_row_per_rank(capsys):
    assert main(["--num-layers", "2", "--dp", "2", "--tp", "2", "--ranks", "0,-1", "--max-shard-size", "1MB"]) == 0
    out = capsys.readouterr().out
    assert "dp 2 x tp 2 = 4 ranks" in out and "\n    3 " in out and "12 bytes" not in out


# ----------------------------------------------------------------------------------------------- ckpt_plan at its edges
MTP_CONFIG = Glm53Config.tiny(
    num_attention_heads=4,
    num_key_value_heads=4,
    linear_num_heads=4,
    hidden_size=64,
    moe_intermediate_size=32,
    num_nextn_predict_layers=1,
)
NOT_FP8 = ("embed_tokens", "layernorm", "norm", "lm_head", "hc_", "gate.weight")


def release_bytes(model: Glm53ForCausalLM) -> int:
    """The FP8 release's bytes, from the model's own tensors: fused experts are E per-expert keys (gate and up
    halves of gate_up_proj [E, 2I, D], down_proj [E, D, I]), each FP8 slab with one fp32 scale per 128 x 128
    block."""
    total = 0
    for name, t in model.state_dict().items():
        if keeps_fp32(name):
            total += 4 * t.numel()
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, rows, cols = t.shape
            halves = 2 if name.endswith("gate_up_proj") else 1
            total += t.numel() + 4 * E * halves * ceil_div(rows // halves, 128) * ceil_div(cols, 128)
        elif t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in NOT_FP8):
            total += t.numel() + 4 * ceil_div(t.shape[0], 128) * ceil_div(t.shape[1], 128)
        else:
            total += 2 * t.numel()
    return total


@pytest.mark.parametrize("config", [CONFIG, MTP_CONFIG], ids=["no-mtp", "mtp"])
def test_one_rank_reads_the_whole_release_and_holds_the_whole_model(config):
    model = Glm53ForCausalLM(config)
    plan = plan_rank(config, 0, 1, 1)
    assert plan.checkpoint_bytes == release_bytes(model)
    assert plan.read_bytes == plan.checkpoint_bytes  # every key whole, its scales included
    # FSDP shards every parameter (over one rank): only the plain fp32 buffers (router biases) count as whole.
    assert plan.replicated_bytes == sum(b.numel() * 4 for b in model.buffers()) > 0
    held = sum(t.numel() * t.dtype.itemsize for t in [*model.parameters(), *model.buffers()])
    assert plan.shard_bytes == held
    assert plan.largest_key_bytes == 4 * config.vocab_size * config.hidden_size  # the embedding, gathered in fp32


def test_four_ranks_hold_a_quarter_each():
    model = Glm53ForCausalLM(CONFIG)
    params = sum(p.numel() * p.dtype.itemsize for p in model.parameters())
    buffers = sum(b.numel() * b.dtype.itemsize for b in model.buffers())  # plain buffers: whole on every rank
    plans = [plan_rank(CONFIG, r, 4, 1) for r in range(4)]
    assert sum(p.shard_bytes for p in plans) == params + 4 * buffers


@pytest.mark.parametrize(
    "rows,cols,blocks",
    [((0, 128), (0, 64), 1), ((96, 160), (0, 64), 2), ((96, 160), (120, 136), 4), ((128, 256), (256, 257), 1)],
)
def test_scale_blocks_of_a_slice_count_every_block_it_touches(rows, cols, blocks):
    assert _scale_bytes((slice(*rows), slice(*cols))) == 4 * blocks


def test_disk_width_of_keep_list_fp8_and_bf16_keys():
    key, name = "model.language_model.layers.0", "model.layers.0"
    assert _disk_width(f"{key}.self_attn.dt_bias", f"{name}.self_attn.dt_bias", (4,)) == (4, False)
    assert _disk_width(f"{key}.mlp.gate.weight", f"{name}.mlp.gate.weight", (8, 64)) == (4, False)
    assert _disk_width(f"{key}.self_attn.o_proj.weight", f"{name}.self_attn.o_proj.weight", (64, 64)) == (1, True)
    assert _disk_width(f"{key}.input_layernorm.weight", f"{name}.input_layernorm.weight", (64,)) == (2, False)
    assert _disk_width("lm_head.weight", "lm_head.weight", (320, 64)) == (2, False)
