"""Packed documents: training-step throughput and padding saved. A table + JSON.

    python benchmarks/bench_packing.py                      # 2048 tokens, 4 layers, 3 reps, 1 thread
    python benchmarks/bench_packing.py --tokens 4096 --reps 5

Throughput: one training step (forward with labels, every default loss, backward) of the bench model (issue 5,
`--layers` of it) over the same N tokens in three layouts, interleaved rep by rep, medians:
- "one sequence": input_ids [1, N], no boundaries (what packing is measured against; target: packed within 1.2x);
- "packed": the same [1, N] tokens as documents of a realistic length mix, `cu_seqlens` (each document alone);
- "padded": the same documents as a [n_docs, longest] batch with an attention mask (the layout packing replaces).
Padding: over many documents of the same mix, the slots a batch needs when each batch of `--batch` documents is
padded to its longest, vs packing them in order into rows of `--seq-len` tokens (a longer document is split):
the fraction of slots that hold no token. Results: benchmarks/results/bench_packing.json.
The ratios use the process's CPU time per step (one thread: the work done, which other jobs on a shared machine
barely change); wall-clock medians are recorded beside them.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from bench_config import bench_config, machine, median, table, timed, write_json

from glm53 import Glm53ForCausalLM

MEDIAN_LEN, SIGMA = 200, 1.0  # lognormal document lengths (SFT-like mix: median 200 tokens, long tail)


def length_mix(total: int, seed: int) -> list[int]:
    """Document lengths of the mix summing to exactly `total` (the last one cut)."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(math.exp(math.log(MEDIAN_LEN) + SIGMA * torch.randn((), generator=g).item()))
        lengths.append(max(1, min(n, total - sum(lengths))))
    return lengths


def layouts(N: int, vocab: int, seed: int) -> dict:
    lengths = length_mix(N, seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (1, N), generator=g)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    longest = max(lengths)
    padded = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, (s, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        padded[i, :n], mask[i, :n] = ids[0, s : s + n], 1
    return {
        "one sequence": dict(input_ids=ids, labels=ids),
        "packed": dict(input_ids=ids, labels=ids, cu_seqlens=cu),
        "padded": dict(input_ids=padded, labels=padded.masked_fill(mask == 0, -100), attention_mask=mask),
        "_lengths": lengths,
    }


def step(model, batch) -> None:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


def cpu_timed(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def padding_saved(docs: int, batch: int, seq_len: int, seed: int) -> dict:
    lengths = _sample(docs, seed)
    tokens = sum(lengths)
    padded = sum(len(b) * max(b) for b in (lengths[i : i + batch] for i in range(0, docs, batch)))
    packed_rows = math.ceil(tokens / seq_len)  # in order, splitting: only the last row is partly empty
    return dict(docs=docs, tokens=tokens, batch=batch, seq_len=seq_len, padded_slots=padded,
                padded_waste=round(1 - tokens / padded, 4), packed_slots=packed_rows * seq_len,
                packed_waste=round(1 - tokens / (packed_rows * seq_len), 4),
                slots_saved=round(1 - packed_rows * seq_len / padded, 4))  # fmt: skip


def _sample(docs: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [max(1, int(math.exp(math.log(MEDIAN_LEN) + SIGMA * torch.randn((), generator=g).item())))
            for _ in range(docs)]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=int, default=4096, help="documents for the padding statistics")
    p.add_argument("--batch", type=int, default=8, help="documents per padded batch (padding statistics)")
    p.add_argument("--seq-len", type=int, default=4096, help="packed row length (padding statistics)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = bench_config()
    config.num_hidden_layers = args.layers
    config.layer_types = config.layer_types[: args.layers]
    config.mlp_layer_types = config.mlp_layer_types[: args.layers]
    config.indexer_types = config.indexer_types[: args.layers]
    torch.manual_seed(args.seed)
    model = Glm53ForCausalLM(config).train()
    batches = layouts(args.tokens, config.vocab_size, args.seed)
    lengths = batches.pop("_lengths")
    for batch in batches.values():  # warm-up
        step(model, batch)
    times: dict[str, list[float]] = {name: [] for name in batches}
    cpu: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(args.reps):  # interleaved, so machine load drifts hit every layout alike
        for name, batch in batches.items():
            wall = timed(lambda: cpu[name].append(cpu_timed(lambda: step(model, batch))))
            times[name].append(wall)
    base = median(cpu["one sequence"])
    rows = [dict(layout=name, shape="x".join(map(str, b["input_ids"].shape)), cpu_s=round(median(cpu[name]), 3),
                 wall_s=round(median(times[name]), 3), tokens_per_cpu_s=round(args.tokens / median(cpu[name])),
                 vs_one_sequence=round(median(cpu[name]) / base, 3))
            for name, b in batches.items()]  # fmt: skip
    pad = padding_saved(args.docs, args.batch, args.seq_len, args.seed + 1)
    print(f"{args.tokens} tokens as {len(lengths)} documents (median {sorted(lengths)[len(lengths) // 2]}, "
          f"longest {max(lengths)}), {args.layers} layers, {args.reps} reps, {args.threads} thread(s)")  # fmt: skip
    print(table(rows, ["layout", "shape", "cpu_s", "wall_s", "tokens_per_cpu_s", "vs_one_sequence"]))
    print(f"padding over {pad['docs']} documents: padded batches of {pad['batch']} waste {pad['padded_waste']:.1%} "
          f"of their slots, packed rows of {pad['seq_len']} waste {pad['packed_waste']:.1%}; packing needs "
          f"{pad['slots_saved']:.1%} fewer slots")  # fmt: skip
    path = write_json("bench_packing.json", dict(machine=machine(), args=vars(args), lengths=lengths, rows=rows,
                                                 wall_times=times, cpu_times=cpu, padding=pad))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
