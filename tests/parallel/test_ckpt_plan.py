"""The scale tool's read plan (meta device, fake process group) splits the checkpoint over the ranks: every rank
reads about its share, together they read every byte, and the CLI prints the table."""

from __future__ import annotations

from glm53 import Glm53Config
from glm53.parallel.ckpt_plan import plan_rank
from glm53.tools.ckpt_plan import main

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
