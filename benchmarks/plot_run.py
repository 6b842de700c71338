"""Draw a `glm53 train` run's loss and throughput curves from its metrics file.

    python benchmarks/plot_run.py runs/tiny                 # -> runs/tiny/run.png
    python benchmarks/plot_run.py runs/tiny --out plot.png

Reads DIR/metrics.jsonl (training/metrics.py: one JSON object per logging step), prints a small table (first,
last, min loss; median tokens/s) and writes a PNG with matplotlib (the Agg backend: no display needed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"plot_run: {path}: no such file (was the run saved with --save {run_dir}?)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"plot_run: {path}:{number}: not JSON ({e.msg})") from None
    if not rows:
        raise SystemExit(f"plot_run: {path}: no metrics lines")
    return rows


def plot(rows: list[dict], out: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_run needs matplotlib: pip install matplotlib (it is in glm53's test extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, rate_ax) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    loss_ax.plot(steps, [r["loss"] for r in rows], label="loss")
    if any("lm_loss" in r for r in rows):
        loss_ax.plot(steps, [r.get("lm_loss") for r in rows], label="lm loss", alpha=0.7)
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if evals:
        loss_ax.plot(*zip(*evals), "o-", label="held-out loss")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    rate_ax.plot(steps, [r.get("tokens_per_s", 0) for r in rows])
    rate_ax.set_xlabel("step")
    rate_ax.set_ylabel("tokens/s (global)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a `glm53 train --save` directory")
    p.add_argument("--out", help="PNG to write (default: RUN_DIR/run.png)")
    args = p.parse_args(argv)
    rows = read_metrics(args.run_dir)
    out = args.out or os.path.join(args.run_dir, "run.png")
    losses = [r["loss"] for r in rows]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    print(f"{'steps':>8} {'first loss':>11} {'last loss':>10} {'min loss':>9} {'median tok/s':>13}")
    print(
        f"{rows[-1]['step']:>8} {losses[0]:>11.4f} {losses[-1]:>10.4f} {min(losses):>9.4f} "
        f"{statistics.median(rates) if rates else 0:>13,.0f}"
    )
    plot(rows, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
