"""What each torch.compile option of `generate(compile=True)` buys on a CPU decode step (issue 27).

    python benchmarks/bench_compile_options.py                  # bench config, prompt 2048, 40 steps, 2 threads
    python benchmarks/bench_compile_options.py --steps 80 --threads 1

One model, one prefilled GenerationCache per variant, then the compiled decode step (generation/step.py's
`Stepper`, its options swapped) plus lm_head, `--steps` times after 5 warm-up steps, back to back (no other model
between steps, unlike bench_generate's interleaved step columns). Variants, each its own compile (cold unless
TORCHINDUCTOR_CACHE_DIR holds it):
  plain          fullgraph, static shapes (last session's compile=True on a CPU)
  skip guards    + options guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe
  + cpp_wrapper  + inductor's C++ wrapper: what compile=True is on a CPU now (compile_options(True))
Medians and fastest steps in ms, and the first compiled call (the compile). Results:
benchmarks/results/bench_compile_options.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from bench_config import machine, median, positive_int, table, write_json
from bench_generate import build_pair

from glm53.generation import GenerationCache, Stepper, step
from glm53.generation.step import CAPACITY_BUCKET, compile_options

SKIP = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
VARIANTS = {
    "plain": dict(fullgraph=True, dynamic=False),
    "skip guards": dict(fullgraph=True, dynamic=False, options=SKIP),
    "+ cpp_wrapper (compile=True)": compile_options(True),
}


def run(model, ids: torch.Tensor, options: dict, steps: int) -> dict:
    stepper = Stepper(compile=True)
    stepper.options = options
    capacity = -(-(ids.shape[1] + steps + 8) // CAPACITY_BUCKET) * CAPACITY_BUCKET
    with torch.inference_mode():
        cache = GenerationCache(model, max_length=capacity)
        step(model, cache, ids)
        token = ids[:, -1:]
        start = time.perf_counter()
        model.lm_head(stepper(model, cache, token)[:, -1])
        compile_s = time.perf_counter() - start
        for _ in range(5):
            model.lm_head(stepper(model, cache, token)[:, -1])
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model.lm_head(stepper(model, cache, token)[:, -1])
            times.append(time.perf_counter() - start)
    return dict(
        step_ms_med=round(1e3 * median(times), 2), step_ms_min=round(1e3 * min(times), 2), compile_s=round(compile_s, 1)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=positive_int, default=2048)
    ap.add_argument("--steps", type=positive_int, default=40)
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    ap.add_argument("--out", default="bench_compile_options.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf, model, config = build_pair(tempfile.mkdtemp(prefix="glm53-bench-opts-"))
    del hf
    ids = torch.randint(1, config.vocab_size, (1, args.prompt))
    rows = [dict(variant=name, **run(model, ids, options, args.steps)) for name, options in VARIANTS.items()]
    print(f"compiled decode step + lm_head (prompt {args.prompt}, {args.threads} thread(s), {args.steps} steps)")
    print(table(rows, ["variant", "step_ms_med", "step_ms_min", "compile_s"]))
    write_json(args.out, dict(machine=machine(), args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
