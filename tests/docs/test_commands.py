"""Every command the README and docs/ show in a shell block is run: here (on tiny settings, in the order shown, in
a scratch directory standing for the repository root), or by the named test that runs the same command at a
smaller world, or by CI (.ci/run). A new command without one of these fails `test_every_shown_command_is_covered`.

Shrinking rules (`shrink`): `--steps N` -> a few steps, `--max-new-tokens N` -> 4, `[optional flags]` dropped,
`pip install ... &&` prefixes dropped (CI installs), trailing `# comments` dropped, `\\` continuations joined.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from glm53.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

# Commands run elsewhere: the start of the command -> the test (file::name) or CI script that runs it.
ELSEWHERE = {
    "python -m pytest -q -n 2 --dist loadfile tests": ".ci/run",
    "torchrun --nproc-per-node 4 -m glm53 train --dp 2 --tp 2 --save": "tests/training/test_train_distributed.py::test_dp2_trains_saves_and_resumes",
    "torchrun --nproc-per-node 4 -m glm53 train --dp 2 --tp 2 --resume": "tests/training/test_train_distributed.py::test_tp2_matches_one_process_and_resumes_in_one",
    "torchrun --nproc-per-node 2 -m glm53 train --dp 1 --ep 2": "tests/training/test_train_ep.py::test_ep2_trains_saves_and_resumes",
    "torchrun --nproc-per-node 4 -m glm53 train --tp 2 --ep 2": "tests/training/test_train_composed.py::test_composed_layout_matches_dp2",
    "torchrun --nproc-per-node 4 -m glm53 train --cp 2 --ep 2": "tests/training/test_train_composed.py::test_composed_layout_matches_dp2",
    "torchrun --nproc-per-node 4 -m glm53 train --cp 2 --tp 2": "tests/training/test_train_composed.py::test_cp2_tp2_matches_one_process",
    "python -m glm53.tools.plan": "tests/parallel/test_plan_tool.py",
    # README's LoRA block shows a CKPT placeholder; peft's CLI tests run these flags on a tiny checkpoint
    "python -m glm53 train --init CKPT": "tests/peft/test_cli.py::test_lora_run_saves_adapter_resumes_exactly_and_exports_merged",
    "python -m glm53 train --resume runs/lora": "tests/peft/test_cli.py::test_lora_run_saves_adapter_resumes_exactly_and_exports_merged",
    "python -m glm53 generate --model CKPT --adapter": "tests/peft/test_cli.py",
    # the VL section: the example is run by its test; the train/generate lines show placeholders (VL_DIR, MEDIA)
    "python examples/finetune_vl.py": "tests/training/test_finetune_vl_example.py::test_example_runs_and_learns",
    "python -m glm53 train --init VL_DIR": "tests/training/test_vl_train_cli.py::test_train_resume_and_freeze",
    "torchrun --nproc-per-node 2 -m glm53 train --cp 2 --init VL_DIR": "tests/training/test_vl_train_distributed.py::test_vl_layout_matches_one_process",
    "python -m glm53 generate --model runs/vl --image": "tests/generation/test_vl_generate.py::test_cli_streams_an_answer",
    "python -m glm53 generate --model runs/tiny --prompts": "tests/generation/test_cli.py::test_prompts_file_is_one_left_padded_batch",
    "python -m glm53 train --preset tiny --compile": "tests/compile/test_compile_parallel.py::test_train_cli_compile_flag_compiles_every_block",
}
# docs/mutation.md's commands run the mutation audit by hand (hours); they are not part of CI by design.
# The others take minutes or a world of 4 processes: too slow for the suite, for .ci/run to run (lead: pending).
NOT_RUN = (
    "pip install mutmut",
    "cd <repository root>",
    "export OMP_NUM_THREADS",
    "mutmut ",
    "torchrun --nproc-per-node 4 examples/train_distributed.py",
    "python benchmarks/bench_parallel.py",
    "python benchmarks/bench_model.py --quick --compile",
)
SMALL_STEPS = {"--steps": "3", "--max-new-tokens": "4"}


def shown_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line of every ```bash block, continuations joined, comments dropped."""
    out = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line:
                    out.append((doc, re.sub(r"\s+", " ", line)))
    return out


def shrink(command: str) -> list[str]:
    command = re.sub(r"\[[^\]]*\]", "", command)  # optional flags
    command = command.split("&&")[-1].strip()  # the pip install prefix: CI installs
    words = shlex.split(command)
    words = [w for w in words if w != "..."]
    for i, w in enumerate(words[:-1]):
        if w in SMALL_STEPS:
            words[i + 1] = SMALL_STEPS[w]
    return words


def is_run_here(command: str) -> bool:
    return not command.startswith(NOT_RUN) and not any(command.startswith(k) for k in ELSEWHERE)


def test_every_shown_command_is_covered():
    for doc, command in shown_commands():
        if command.startswith(NOT_RUN) or is_run_here(command):
            continue
        where = next(v for k, v in ELSEWHERE.items() if command.startswith(k))
        path, _, name = where.partition("::")
        assert os.path.isfile(os.path.join(ROOT, path)), (doc, command, where)
        if name:
            assert f"def {name}(" in open(os.path.join(ROOT, path)).read(), (doc, command, where)
    here = [c for _, c in shown_commands() if is_run_here(c)]
    assert all(
        c.startswith(("python -m glm53 ", "python examples/", "python benchmarks/", "pip install")) for c in here
    ), here


def run(words: list[str], cwd: str) -> None:
    if words[:3] == ["python", "-m", "glm53"]:
        old = os.getcwd()
        os.chdir(cwd)
        try:
            assert main(words[3:]) == 0, words
        finally:
            os.chdir(old)
        return
    assert words[0] == "python", words
    proc = subprocess.run([sys.executable, *words[1:]], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (words, proc.stdout[-2000:], proc.stderr[-2000:])


def test_shown_commands_run(tmp_path, capsys):
    """README's quickstart, Runs, Generation and Fine-tune commands, in order, in one scratch 'repository'."""
    for name in ("examples", "benchmarks"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    commands = [c for _, c in shown_commands() if is_run_here(c)]
    assert len(commands) >= 8, commands
    for command in commands:
        words = shrink(command)
        if words[:2] == ["python", "examples/finetune.py"]:
            words += ["--steps", "2"]
        run(words, str(tmp_path))
    assert (tmp_path / "runs" / "tiny" / "run.png").is_file()
    assert (tmp_path / "runs" / "finetune-example" / "mine" / "metrics.jsonl").is_file()


@pytest.mark.parametrize(
    "command,expected",
    [
        (
            "pip install x && python -m glm53 train --steps 120 --save runs/t",
            ["python", "-m", "glm53", "train", "--steps", "3", "--save", "runs/t"],
        ),
        (
            'python -m glm53 generate --prompt "a b" --max-new-tokens 64 [--mtp 3]',
            ["python", "-m", "glm53", "generate", "--prompt", "a b", "--max-new-tokens", "4"],
        ),
    ],
)
def test_shrink(command, expected):
    assert shrink(command) == expected
