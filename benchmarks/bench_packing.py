"""Padding saved by packing documents into rows (glm53.training.data.pack), on a realistic length mix: a table + JSON.

    python benchmarks/bench_packing.py                  # 4000 documents, rows of 2048 / 4096 / 8192 tokens
    python benchmarks/bench_packing.py --step           # also tokens/s of a packed [1, 512] step (bench model)

Legend: B batch (rows), T time (row length).
Lengths: log-normal, median 350 tokens, sigma 1.1, clipped to [8, 32768] (a mix like chat SFT data: many short
answers, a long tail of documents). Three ways to make rows of at most T tokens:
    one per row      each document in its own row padded to T (a longer one cut into rows)
    batch-longest    rows in batches of 8 in data order, each batch padded to its longest row (dynamic padding)
    packed           glm53's Packer: whole documents one after another, the next row when one does not fit
`--step` times forward+backward of the bench model (benchmarks/bench_config.py) on one packed [1, --step-len] row vs
the same tokens as one unbroken sequence: position_ids go to the model only when its forward takes them (packed
documents); until then both runs compute the same thing and the ratio is ~1.
Results: benchmarks/results/bench_packing.json.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys

import torch

from bench_config import bench_config, machine, median, table, timed, write_json

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
    return sum(max(rows[i : i + DYNAMIC_BATCH]) * len(rows[i : i + DYNAMIC_BATCH]) for i in range(0, len(rows),
                                                                                            DYNAMIC_BATCH))  # fmt: skip


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
        layouts = {"one per row": one_per_row(lens, T) * T, "batch-longest": batch_longest(lens, T),
                   "packed": rows_packed * T}  # fmt: skip
        for name, slots in layouts.items():
            out.append({"T": T, "layout": name, "token_slots": slots, "padding": f"{1 - tokens / slots:.1%}",
                        "vs_packed": f"{slots / layouts['packed']:.2f}x", "split_docs": split if name == "packed" else ""})
    return out


def step_rate(T: int, reps: int) -> dict:
    """fwd+bwd tokens/s of one [1, T] row of packed documents vs the same tokens as one sequence."""
    torch.manual_seed(0)
    model = Glm53ForCausalLM(bench_config())
    lens, row = lengths(64, seed=1), []
    for n in lens:
        row += list(range(min(n, T - len(row))))
        if len(row) == T:
            break
    position_ids = torch.tensor(row + list(range(T - len(row))))[None]
    ids = torch.randint(1, model.config.vocab_size, (1, T))
    takes = "position_ids" in inspect.signature(model.forward).parameters

    def run(packed_docs: bool):
        extra = {"position_ids": position_ids} if packed_docs and takes else {}
        model(ids, labels=ids, **extra).loss.backward()

    result = {}
    for name, flag in (("one sequence", False), ("packed", True)):
        run(flag)  # warm-up
        result[name] = T / median([timed(lambda: run(flag)) for _ in range(reps)])
    return {"T": T, "documents": int((position_ids == 0).sum()), "model_takes_position_ids": takes,
            **{f"{k} tok/s": f"{v:,.0f}" for k, v in result.items()},
            "packed / one sequence": f"{result['packed'] / result['one sequence']:.2f}"}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--step", action="store_true", help="also time a packed training step of the bench model")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--step-len", type=int, default=512, help="row length T of the timed step")
    args = p.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = padding_table(args.docs)
    print(table(rows, ["T", "layout", "token_slots", "padding", "vs_packed", "split_docs"]))
    payload = {"machine": machine(), "length_mix": dict(median=MEDIAN_LEN, sigma=SIGMA, docs=args.docs), "padding": rows}
    if args.step:
        payload["step"] = step_rate(args.step_len, args.reps)
        print(table([payload["step"]], list(payload["step"])))
    print("wrote", write_json("bench_packing.json", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
