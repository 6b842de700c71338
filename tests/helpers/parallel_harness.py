"""A gloo worker pool for multi-process tests: spawn `world_size` ranks once, then feed them jobs.

Spawning a gloo world costs seconds (docs/parallel.md), so a test module starts one pool per world size in a
module-scoped fixture and sends every rank the same job (an importable function and its kwargs, generated in
the parent). Each rank returns the job's result; an exception on any rank fails the call with its traceback.
Jobs live in this file so the spawned children can import them.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

JOB_TIMEOUT_S = (
    600.0  # a hang guard, not a speed bound: two xdist workers may run an 8-rank world and a compile together
)
FAILURE_GRACE_S = 5.0
POLL_S = 0.5


def _worker(rank: int, world_size: int, init_file: str, jobs, results, timeout_s: float = JOB_TIMEOUT_S) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        while True:
            job = jobs.get()
            if job is None:
                break
            fn, kwargs = job
            try:
                results.put((rank, True, fn(**kwargs)))
            except BaseException:  # reported to the parent, which fails the test
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int, job_timeout_s: float = JOB_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.job_timeout_s = job_timeout_s
        self._dir = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._dir.name, "init")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, world_size, init_file, self._jobs[r], self._results, job_timeout_s),
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, **kwargs) -> list:
        """Run fn(**kwargs) on every rank; return the results in rank order."""
        for q in self._jobs:
            q.put((fn, kwargs))
        out: dict[int, object] = {}
        errors: list[str] = []
        for _ in range(self.world_size):
            # After a failure the other ranks may be stuck in a collective: wait briefly, then drop the pool.
            got = self._next(self.job_timeout_s if not errors else FAILURE_GRACE_S)
            if got is None:
                missing = sorted(set(range(self.world_size)) - set(out))
                self.close()
                raise RuntimeError(f"{fn.__name__}: ranks {missing} did not answer (or died)\n" + "\n".join(errors))
            rank, ok, value = got
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError(f"{fn.__name__} failed\n" + "\n".join(errors))
        return [out[r] for r in range(self.world_size)]

    def _next(self, timeout: float):
        """The next (rank, ok, value), or None after `timeout` seconds or when a worker process has died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self._results.get(timeout=POLL_S)
            except queue.Empty:
                if not all(p.is_alive() for p in self._procs):
                    return None
        return None

    def close(self) -> None:
        for q, p in zip(self._jobs, self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()
        self._dir.cleanup()
