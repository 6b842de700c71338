"""benchmarks/bench_indexer_kl_memory.py runs and writes its table at tiny sizes (memory and time not asserted; the
two records' KL values must agree, as the parity tests require)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("documents", [1, 3], ids=["unpacked", "packed"])
def test_bench_runs_both_records_and_they_agree(tmp_path, documents):
    out = tmp_path / "kl.json"
    args = ["--seqlens", "64", "--hidden", "32", "--heads", "2", "--head-dim", "8", "--q-lora", "24"]
    args += ["--kv-lora", "16", "--index-heads", "2", "--index-head-dim", "8", "--topk", "8", "--threads", "1"]
    args += ["--documents", str(documents)]
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_indexer_kl_memory.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "recompute/stored" in proc.stdout
    result = json.loads(out.read_text())
    assert result["documents"] == documents and f"{documents} document(s)" in proc.stdout
    points = result["points"]
    assert {(p["variant"], p["seqlen"]) for p in points} == {("stored", 64), ("recompute", 64)}
    kl = {(p["variant"], p["seqlen"]): p["kl"] for p in points}
    assert kl[("stored", 64)] > 0
    assert abs(kl[("stored", 64)] - kl[("recompute", 64)]) <= 1e-4 * kl[("stored", 64)]  # two fp32 groupings of one sum


def test_bench_compiled_step_runs_and_agrees(tmp_path):
    """--compile aot_eager at T = 64 (the child's warm-up size: one compilation): the compiled recomputing step's
    KL equals the eager one's."""
    args = ["--seqlens", "64", "--hidden", "32", "--heads", "2", "--head-dim", "8", "--q-lora", "24", "--kv-lora"]
    args += ["16", "--index-heads", "2", "--index-head-dim", "8", "--topk", "8", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    kl = {}
    for backend in ("none", "aot_eager"):
        out = tmp_path / f"{backend}.json"
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "benchmarks", "bench_indexer_kl_memory.py"), *args]
            + ["--variants", "recompute", "--compile", backend, "--out", str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"compile {backend}" in proc.stdout
        result = json.loads(out.read_text())
        assert result["compile"] == backend
        kl[backend] = result["points"][0]["kl"]
    assert kl["none"] > 0
    assert abs(kl["none"] - kl["aot_eager"]) <= 1e-4 * kl["none"]  # the same fp32 op, traced or not
