"""examples/finetune_vl.py (the README's VL fine-tuning walk-through) runs end to end and lowers the held-out loss."""

from __future__ import annotations

import importlib.util
import os
import re

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune_vl.py")


def test_example_runs_and_learns(tmp_path, capfd):
    spec = importlib.util.spec_from_file_location("finetune_vl_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path / "ex"), "--steps", "12"]) == 0
    out = capfd.readouterr().out
    base, tuned = (float(v) for v in re.findall(r"held-out loss of \w+: ([0-9.]+) \(\d+ image", out))
    assert tuned < base
    assert re.search(r"\[4 new tokens in", out)
