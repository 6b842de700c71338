"""The planner's LoRA / FP8-base targets on the released config (the README's commands, glm53/peft/memory.py)."""

from __future__ import annotations

import re

import pytest

from glm53.tools.plan import main

LORA = [
    "--seq-len",
    "8192",
    "--batch",
    "1",
    "--activation-checkpointing",
    "--lora-rank",
    "16",
    "--lora-targets",
    "attention",
    "experts",
]


def _rows(out: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^  (\w+)\s+([\d.]+)$", out, re.M)}


@pytest.mark.parametrize("gib", [141, 80])
def test_fp8_base_lora_fits_one_node(gib, capsys):
    """LoRA r16 on attention + experts, FP8 base, checkpointing, 8192 tokens per rank: 8 ranks (ep 8)."""
    assert main(["--dp", "1", "--ep", "8", *LORA, "--base-dtype", "fp8", "--device-gib", str(gib)]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert "= 8 ranks" in out and "fp8 base" in out and "fits" in out
    # the frozen base costs its FP8 bytes: ~313e9 / 8 ranks, no gradients or AdamW for it
    assert 33 < rows["params"] < 45 and rows["grads"] < 1 and rows["adamw"] == pytest.approx(2 * rows["grads"], 0.02)


def test_bf16_base_lora_fits_141(capsys):
    assert main(["--dp", "1", "--ep", "8", *LORA, "--base-dtype", "bf16", "--device-gib", "141"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert 66 < rows["params"] < 80  # 2 bytes per frozen parameter


def test_bf16_base_under_fp32_training_is_priced_at_2_bytes(capsys):
    """--dtype fp32 (fp32 adapters and compute): the held bf16 base still costs 2 bytes a weight (4 would be ~147
    GiB), the adapters 4, and a module's weights widened to fp32 for its matmul add to the transient."""
    argv = ["--dp", "1", "--ep", "8", *LORA, "--base-dtype", "bf16", "--device-gib", "141"]
    assert main([*argv, "--dtype", "fp32"]) == 0
    fp32 = _rows(capsys.readouterr().out)
    assert main(argv) == 0
    bf16 = _rows(capsys.readouterr().out)
    assert 66 < fp32["params"] < 80 and fp32["params"] < 1.05 * bf16["params"]
    assert fp32["grads"] == pytest.approx(2 * bf16["grads"], 0.02) and fp32["transient"] > bf16["transient"]


def test_bad_rank(capsys):
    with pytest.raises(SystemExit, match="--lora-rank must be a positive integer"):
        main(["--dp", "1", "--ep", "8", "--lora-rank", "0"])
