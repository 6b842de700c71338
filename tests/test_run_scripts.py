"""benchmarks/gpu_check.py runs on CPU (--cpu-smoke: the CUDA parts say why they skip), benchmarks/plot_run.py
draws a run's metrics, and the base install's default paths import no optional package (extras named when
needed). No tensors beyond the scripts' own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from glm53.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_gpu_check_cpu_smoke_writes_json(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = json.loads(out.read_text())["parts"]
    assert parts["parity"]["status"] == "skipped" and "needs a GPU" in parts["parity"]["why"]
    assert parts["bf16_train"]["status"] == "ok" and parts["bf16_train"]["saved_dtypes"] == ["torch.float32"]
    assert parts["generate"]["cached_equals_full_forward"] is True
    assert parts["bench_step"]["tokens_per_s"] > 0 and parts["bench_step"]["mfu"] is None  # no CPU peak known
    assert "CUDA-only parts are skipped" in proc.stdout


def test_plot_run_draws_the_metrics(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    assert (
        main(["train", "--steps", "3", "--batch-size", "1", "--seq-len", "16", "--log-every", "1", "--save", str(run)])
        == 0
    )
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "plot_run.py"), str(run)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    png = (run / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert f"{first:.4f}" in proc.stdout
    bad = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "plot_run.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert bad.returncode == 1 and "metrics.jsonl: no such file" in bad.stderr and "Traceback" not in bad.stderr


BLOCK_EXTRAS = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"transformers", "datasets", "pyarrow", "tensorboard", "matplotlib", "PIL", "av"}:
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, Block())
"""


def test_default_paths_need_no_extra(tmp_path):
    """The train and generate commands import without the extras; a path that needs one names it."""
    script = (
        BLOCK_EXTRAS
        + r"""
from glm53.__main__ import main
assert main(["train", "--steps", "1", "--batch-size", "1", "--seq-len", "8"]) == 0
from glm53.training.data.tokenize import TextTokenizer
from glm53.training.data.documents import DataError
import os
d = sys.argv[1]
open(os.path.join(d, "tokenizer_config.json"), "w").write("{}")
try:
    TextTokenizer(d)
except DataError as e:
    print("MESSAGE", e)
"""
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "MESSAGE" in proc.stdout and "pip install 'glm53[data]'" in proc.stdout


def test_setup_extras_cover_what_the_tests_import():
    import ast

    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    assert {"tokenizers", "tqdm"} <= set(kw["install_requires"])
    assert set(kw["extras_require"]) >= {"data", "vl", "tensorboard", "test"}
    names = {r.split("=")[0].split(">")[0] for r in kw["extras_require"]["test"]}
    # optional packages the test files import (directly or through glm53's optional paths)
    for module, package in (
        ("pyarrow", "pyarrow"),
        ("datasets", "datasets"),
        ("tensorboard", "tensorboard"),
        ("PIL", "pillow"),
        ("transformers", "transformers"),
        ("matplotlib", "matplotlib"),
    ):
        assert package in names, (module, package)
