"""The run directory's files besides the checkpoint: tokenizer files, step-N pruning, another job's checkpoint.

No tensors here. Rules (tests/training/test_runs.py, test_run_data.py):
- --save DIR holding tokenizer files that differ from this run's tokenizer is refused at the start (they would
  be replaced at the first save); identical ones are left as they are, missing ones are written.
- --keep-last K removes the oldest DIR/step-N checkpoints after a save succeeded, so an earlier complete
  checkpoint exists whatever the next save does.
- A checkpoint that appears in DIR during the run and is not this run's (DIR/run.toml is not the file this run
  wrote, and the run did not start from DIR) is not replaced: the trainer saves beside it and says so.
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import tempfile

STEP_DIR = re.compile(r"^step-(\d+)$")
CHECKPOINT_MARKERS = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "trainer_state.pt",
    "train_state",
)


def _written(tokenizer) -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="glm53-tokenizer-")
    tokenizer.save(tmp.name)
    return tmp


def check_tokenizer_files(tokenizer, run_dir: str) -> None:
    """Refuse (SystemExit naming the file) a run directory whose tokenizer files are not this tokenizer's."""
    if not os.path.isdir(run_dir) or os.path.realpath(run_dir) == os.path.realpath(tokenizer.path):
        return
    with _written(tokenizer) as tmp:
        for name in sorted(os.listdir(tmp)):
            mine, theirs = os.path.join(tmp, name), os.path.join(run_dir, name)
            if os.path.lexists(theirs) and not (os.path.isfile(theirs) and filecmp.cmp(mine, theirs, shallow=False)):
                raise SystemExit(
                    f"glm53 train: error: --save {run_dir} holds a {name} that is not this run's "
                    f"tokenizer's ({tokenizer.path}); saving would replace it: use another --save "
                    f"directory, or move the file"
                )


def write_tokenizer(tokenizer, path: str) -> None:
    """Write the tokenizer files missing from checkpoint `path` (never replacing a file or following a link)."""
    with _written(tokenizer) as tmp:
        for name in sorted(os.listdir(tmp)):
            target = os.path.join(path, name)
            if not os.path.lexists(target):
                shutil.copyfile(os.path.join(tmp, name), target)


def step_dirs(run_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(run_dir):
        return []
    found = [(int(m[1]), os.path.join(run_dir, n)) for n in os.listdir(run_dir) if (m := STEP_DIR.match(n))]
    return sorted(p for p in found if os.path.isdir(p[1]) and not os.path.islink(p[1]))


def prune_steps(run_dir: str, keep: int) -> list[str]:
    """Remove all but the `keep` newest DIR/step-N checkpoints -> the removed paths."""
    old = step_dirs(run_dir)[:-keep] if keep > 0 else []
    for _, path in old:
        shutil.rmtree(path)
    return [p for _, p in old]


def save_conflict(path: str, run_config_stat: tuple[int, int] | None, resumed: str | None) -> bool:
    """Whether `path` now holds a checkpoint that this run neither wrote nor started from (module docstring)."""
    if not os.path.isdir(path) or not any(os.path.lexists(os.path.join(path, n)) for n in CHECKPOINT_MARKERS):
        return False
    if resumed is not None and os.path.realpath(resumed) == os.path.realpath(path):
        return False
    if run_config_stat is None:
        return False  # the run did not write DIR/run.toml (a step-N directory, or a bare Trainer)
    try:
        st = os.stat(os.path.join(path, "run.toml"))
    except FileNotFoundError:
        return True
    return (st.st_ino, st.st_dev) != run_config_stat


__all__ = ["check_tokenizer_files", "prune_steps", "save_conflict", "step_dirs", "write_tokenizer"]
