"""benchmarks/bench_lora.py runs and writes its table (smallest sizes; the numbers are not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.test_benchmark_cli import BENCH


def test_bench_lora_runs(tmp_path):
    out = tmp_path / "bench_lora.json"
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCH, "bench_lora.py"),
            "--reps",
            "1",
            "--steps",
            "1",
            "--seq",
            "8",
            "--preset",
            "tiny",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"full", "lora", "lora-held", "lora-bf16", "lora-fp8"}
    assert result["rows"]["lora"]["trainable"] < result["rows"]["full"]["trainable"] / 5
    assert result["rows"]["lora-fp8"]["state_bytes"] < result["rows"]["lora-bf16"]["state_bytes"]
    assert result["rows"]["lora-held"]["state_bytes"] < result["rows"]["lora"]["state_bytes"]
