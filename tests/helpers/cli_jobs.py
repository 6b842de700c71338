"""The `glm53` CLI on the ranks of a spawned gloo pool (tests/helpers/parallel_harness.py), as torchrun starts it.

A torchrun subprocess costs its ranks' interpreter start and torch/DTensor imports (4-9 s each on two cores) before
the first step; the pool's ranks have paid that once. `cli_rank` is `python -m glm53 ARGV` on one rank with
torchrun's WORLD_SIZE / RANK, the pool's process group serving as the run's (the CLI's shutdown of it is skipped,
so the pool lives on). Everything after the process group starts is the CLI's own code: the same mesh, trainer,
saves and prints. tests/training/test_train_distributed.py keeps real torchrun launches for what this skips (the
launcher's environment, the CLI starting and destroying the process group).
"""

from __future__ import annotations

import contextlib
import io
import os

import torch.distributed as dist


def cli_rank(argv: list[str]) -> dict:
    """`python -m glm53 ARGV` on this pool rank -> {"rc": exit status, "stdout", "stderr": what it printed}."""
    from glm53 import parallel
    from glm53.__main__ import main

    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(dist.get_rank()))
    keep = parallel.runtime.shutdown
    parallel.runtime.shutdown = lambda: None
    text, errors = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(errors):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse and the CLI's usage errors
                rc = e.code if isinstance(e.code, int) else 2
                print(e.code, file=errors)
    finally:
        parallel.runtime.shutdown = keep
        for k, v in env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return {"rc": rc, "stdout": text.getvalue(), "stderr": errors.getvalue()}


def torchrun_in(pool, *argv: str) -> str:
    """`torchrun --nproc-per-node <pool size> -m glm53 ARGV` in `pool` -> rank 0's stdout (fails with every rank's
    output unless all ranks exit 0)."""
    results = pool.run(cli_rank, argv=list(argv))
    if any(r["rc"] != 0 for r in results):
        raise AssertionError(
            f"glm53 {' '.join(argv)} on {len(results)} pool ranks failed:\n"
            + "\n".join(
                f"--- rank {k} (rc {r['rc']}):\n{r['stdout'][-2000:]}\n{r['stderr'][-3000:]}"
                for k, r in enumerate(results)
            )
        )
    return results[0]["stdout"]
