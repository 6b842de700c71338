"""The benchmark scripts' numeric arguments: a bad count or length is a usage error naming the flag (exit 2),
never a traceback from deep inside a run (benchmarks/bench_config.py `positive_int` / `non_negative_int`)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _bench_config():
    spec = importlib.util.spec_from_file_location("bench_config", os.path.join(BENCH, "bench_config.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("text", ["0", "-3", "x", "1.5", ""])
def test_positive_int_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        _bench_config().positive_int(text)


def test_positive_and_non_negative_accept():
    cfg = _bench_config()
    assert cfg.positive_int("7") == 7 and cfg.non_negative_int("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        cfg.non_negative_int("-1")


def _plain_int_arguments(path: str) -> list[str]:
    """Flags of `add_argument(..., type=int)` calls in a script (they would accept 0 and negatives)."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            for kw in node.keywords:
                if kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id == "int":
                    found.append(ast.unparse(node.args[0]) if node.args else "?")
    return found


def test_no_benchmark_takes_a_plain_int():
    scripts = [f for f in sorted(os.listdir(BENCH)) if f.endswith(".py")]
    offenders = {f: flags for f in scripts if (flags := _plain_int_arguments(os.path.join(BENCH, f)))}
    assert not offenders, f"use bench_config.positive_int / non_negative_int: {offenders}"


def test_bad_number_is_a_usage_error():
    run = subprocess.run(
        [sys.executable, os.path.join(BENCH, "bench_long_context.py"), "--reps", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 2, run.stderr
    assert "--reps" in run.stderr and "must be >= 1" in run.stderr and "Traceback" not in run.stderr
