"""Padding saved by packing documents into rows (glm53.training.data.pack), on a realistic length mix: a table + JSON.

    python benchmarks/bench_packing.py                  # 4000 documents, rows of 2048 / 4096 / 8192 tokens
    python benchmarks/bench_packing.py --step           # also a training step: packed vs one sequence vs padded

Legend: B batch (rows), T time (row length).
Lengths: log-normal, median 350 tokens, sigma 1.1, clipped to [8, 32768] (a mix like chat SFT data: many short
answers, a long tail of documents). Three ways to make rows of at most T tokens:
    one per row      each document in its own row padded to T (a longer one cut into rows)
    batch-longest    rows in batches of 8 in data order, each batch padded to its longest row (dynamic padding)
    packed           glm53's Packer: whole documents one after another, the next row when one does not fit
`--step` times one training step (forward with labels, default losses, backward) of `--layers` layers of the bench
model (benchmarks/bench_config.py) over the same `--step-len` tokens of the same mix, interleaved rep by rep:
    one sequence     input_ids [1, N], no boundaries (what packing is measured against; target: within 1.2x)
    packed           the same [1, N] tokens with `cu_seqlens`: each document computed as if alone
    padded           the same documents as a [documents, longest] batch with an attention mask
Ratios use the medians of the process's CPU time per step (one thread: the work done, which other jobs on a shared
machine barely change); wall-clock medians are recorded beside them.
Results: benchmarks/results/bench_packing.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from bench_config import bench_config, machine, median, positive_int, table, write_json

from glm53 import Glm53ForCausalLM
from glm53.training.data.pack import Packer
from glm53.training.data.tokenize import TokenDoc

MEDIAN_LEN, SIGMA, MIN_LEN, MAX_LEN = 350, 1.1, 8, 32768
DYNAMIC_BATCH = 8


def lengths(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * SIGMA + math.log(MEDIAN_LEN)
    return x.exp().round().clamp(MIN_LEN, MAX_LEN).long().tolist()


def one_per_row(lens: list[int], T: int) -> int:
    return sum(-(-n // T) for n in lens)  # rows, each T wide


def batch_longest(lens: list[int], T: int) -> int:
    """Padded tokens when batches of DYNAMIC_BATCH rows are padded to their longest row (cut rows included)."""
    rows = [min(T, n - k) for n in lens for k in range(0, n, T)]
    return sum(
        max(rows[i : i + DYNAMIC_BATCH]) * len(rows[i : i + DYNAMIC_BATCH]) for i in range(0, len(rows), DYNAMIC_BATCH)
    )


def packed(lens: list[int], T: int) -> tuple[int, int]:
    docs = [TokenDoc([1] * n, [True] * n, str(i)) for i, n in enumerate(lens)]
    packer = Packer(docs, T, seed=0, pad_id=0)
    while packer.epoch == 0:
        packer.row()
    return packer.stats.rows, packer.stats.split


def padding_table(n_docs: int) -> list[dict]:
    lens = lengths(n_docs)
    tokens = sum(lens)
    out = []
    for T in (2048, 4096, 8192):
        rows_packed, split = packed(lens, T)
        layouts = {
            "one per row": one_per_row(lens, T) * T,
            "batch-longest": batch_longest(lens, T),
            "packed": rows_packed * T,
        }
        for name, slots in layouts.items():
            out.append(
                {
                    "T": T,
                    "layout": name,
                    "token_slots": slots,
                    "padding": f"{1 - tokens / slots:.1%}",
                    "vs_packed": f"{slots / layouts['packed']:.2f}x",
                    "split_docs": split if name == "packed" else "",
                }
            )
    return out


def step_layouts(N: int, vocab: int) -> tuple[dict[str, dict], list[int]]:
    """The three layouts of the same N tokens (documents of the mix, the last one cut to fit)."""
    lens = []
    for n in lengths(64, seed=1):
        lens.append(min(n, N - sum(lens)))
        if sum(lens) == N:
            break
    lens[-1] += N - sum(lens)  # the mix ran short: the last document takes the rest
    ids = torch.randint(1, vocab, (1, N), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, *lens]).cumsum(0)
    padded = torch.zeros(len(lens), max(lens), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, (s, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        padded[i, :n], mask[i, :n] = ids[0, s : s + n], 1
    return {
        "one sequence": dict(input_ids=ids, labels=ids),
        "packed": dict(input_ids=ids, labels=ids, cu_seqlens=cu),
        "padded": dict(input_ids=padded, labels=padded.masked_fill(mask == 0, -100), attention_mask=mask),
    }, lens


def step_rate(N: int, layers: int, reps: int) -> dict:
    """CPU seconds and tokens per CPU second of one training step in each layout, medians over interleaved reps."""
    config = bench_config()
    config.num_hidden_layers = layers
    for name in ("layer_types", "mlp_layer_types", "indexer_types"):
        setattr(config, name, getattr(config, name)[:layers])
    torch.manual_seed(0)
    model = Glm53ForCausalLM(config).train()
    batches, lens = step_layouts(N, config.vocab_size)

    def step(batch) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        return time.process_time() - cpu, time.perf_counter() - wall

    for batch in batches.values():  # warm-up
        step(batch)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in batches}
    for _ in range(reps):  # interleaved, so machine load drifts hit every layout alike
        for name, batch in batches.items():
            runs[name].append(step(batch))
    cpu = {name: median([c for c, _ in r]) for name, r in runs.items()}
    rows = [
        dict(
            layout=name,
            shape="x".join(map(str, b["input_ids"].shape)),
            cpu_s=round(cpu[name], 3),
            wall_s=round(median([w for _, w in runs[name]]), 3),
            tokens_per_cpu_s=round(N / cpu[name]),
            vs_one_sequence=round(cpu[name] / cpu["one sequence"], 3),
        )
        for name, b in batches.items()
    ]
    return {"tokens": N, "layers": layers, "reps": reps, "documents": lens, "rows": rows, "runs_cpu_wall_s": runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=positive_int, default=4000)
    p.add_argument("--step", action="store_true", help="also time a packed training step of the bench model")
    p.add_argument("--reps", type=positive_int, default=3)
    p.add_argument("--step-len", type=positive_int, default=2048, help="tokens N of the timed step")
    p.add_argument("--layers", type=positive_int, default=4, help="layers of the bench model in the timed step")
    args = p.parse_args()
    torch.set_num_threads(1)  # CPU time per step is the measure: one thread keeps it the work done
    rows = padding_table(args.docs)
    print(table(rows, ["T", "layout", "token_slots", "padding", "vs_packed", "split_docs"]))
    payload = {
        "machine": machine(),
        "length_mix": dict(median=MEDIAN_LEN, sigma=SIGMA, docs=args.docs),
        "padding": rows,
    }
    if args.step:
        payload["step"] = step_rate(args.step_len, args.layers, args.reps)
        docs = payload["step"]["documents"]
        print(
            f"\none training step: {args.step_len} tokens as {len(docs)} documents ({min(docs)}-{max(docs)} tokens), "
            f"{args.layers} layers, {args.reps} reps, 1 thread"
        )
        print(
            table(
                payload["step"]["rows"], ["layout", "shape", "cpu_s", "wall_s", "tokens_per_cpu_s", "vs_one_sequence"]
            )
        )
    print("wrote", write_json("bench_packing.json", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
