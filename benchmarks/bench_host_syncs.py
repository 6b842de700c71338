"""Host syncs per training step and per eager decode token (glm53.profiling.HostSyncs), and ATen ops (kernel
launches, glm53.profiling.KernelLaunches) per KDA / MLA layer per step. Not a test.

    python benchmarks/bench_host_syncs.py                       # T = 256 and 512, 4 and 8 layers
    python benchmarks/bench_host_syncs.py --seqlens 512 1024 --decode-tokens 4
    python benchmarks/bench_host_syncs.py --seqlens 4096 --layouts unpacked packed --no-decode   # steps only

Widths: the released attention widths (glm53.config defaults: KDA 64 heads x 128, MLA 64 heads x 256, latent 512,
indexer 32 x 128, index_topk 2048, kpool 4, 288 experts top-8) with a narrow residual stream and narrow experts
(hidden 512, expert width 64, vocab 4096) so that a few layers fit a shared CPU: no count here depends on those
widths (syncs follow the Python control flow: per call, per block of chunks, per layer). The indexer KL is on.
Per step = forward + backward of model(ids, labels=ids). The released 45 layers are extrapolated from runs with
4 and 8 layers (the schedule repeats every 4: KDA, KDA, KDA, MLA): step(45) = step(4) + (45 - 4) / 4 * (step(8) -
step(4)). Decode: generate() (eager, greedy) with two lengths, syncs per extra token = the difference / the extra
tokens; and one decode step (T = 1) and one verify step (T = 3) on a prefilled cache alone, also with the padded
expert form a GPU runs off bf16 Hopper/Blackwell (torch's grouped GEMM unusable). `--layouts packed` measures a
packed step (4 documents per row, from position_ids: the boundaries made and checked once per step). Each row is
printed as it is measured. Results: benchmarks/results/bench_host_syncs.json.
"""

from __future__ import annotations

import argparse

import torch
from bench_config import machine, positive_int, table, write_json

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.generation import GenerationCache, generate, step
from glm53.kernels import moe as moe_kernels
from glm53.profiling import HostSyncs

RELEASED_LAYERS = 45


def released_attention_config(layers: int) -> Glm53Config:
    mlp = ["dense"] + ["sparse"] * (layers - 1)
    return Glm53Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        mlp_layer_types=mlp,
        indexer_loss_weight=0.01,
        pad_token_id=0,
    )


def step_syncs(model: Glm53ForCausalLM, T: int, packed: bool = False) -> HostSyncs:
    """One training step's syncs (packed: 4 documents of T / 4 tokens, as position_ids)."""
    ids = torch.randint(1, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    kwargs = {}
    if packed:
        kwargs["position_ids"] = torch.cat([torch.arange(n) for n in (T // 4,) * 3 + (T - 3 * (T // 4),)])[None]
    with HostSyncs() as syncs:
        model(ids, labels=ids, return_logits=False, **kwargs).loss.backward()
    model.zero_grad(set_to_none=True)
    return syncs


def decode_syncs(model: Glm53ForCausalLM, prompt: int, new: tuple[int, int]) -> float:
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    totals = []
    for n in new:
        with torch.no_grad(), HostSyncs() as syncs:
            generate(model, ids, max_new_tokens=n, eos_token_id=[])
        totals.append(syncs.total)
    return (totals[1] - totals[0]) / (new[1] - new[0])


def cached_step_syncs(model: Glm53ForCausalLM, prompt: int, grouped_mm: bool) -> dict:
    """Syncs of one decode step and one verify step (3 tokens) after a prefill of `prompt` tokens."""
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(2))
    usable = moe_kernels._grouped_mm_usable
    if not grouped_mm:
        moe_kernels._grouped_mm_usable = lambda *a: False
    try:
        with torch.inference_mode():
            cache = GenerationCache(model, max_length=prompt + 4)
            step(model, cache, ids)
            with HostSyncs() as decode:
                step(model, cache, ids[:, -1:])
            cache.mark()
            with HostSyncs() as verify:
                step(model, cache, ids[:, :3])
    finally:
        moe_kernels._grouped_mm_usable = usable
    return {"grouped_mm": grouped_mm, "decode_step": decode.total, "verify_step_3": verify.total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=positive_int, nargs="+", default=[256, 512])
    parser.add_argument("--decode-tokens", type=positive_int, default=4, help="extra tokens of the longer decode")
    parser.add_argument(
        "--layouts", nargs="*", choices=("unpacked", "packed"), default=["unpacked"], help="none: decode only"
    )
    parser.add_argument("--no-decode", action="store_true", help="the training steps only")
    parser.add_argument("--out", default="bench_host_syncs.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    rows = []
    models = {n: Glm53ForCausalLM(released_attention_config(n)) for n in (4, 8)}
    for T in args.seqlens:
        for packed in (layout == "packed" for layout in args.layouts):
            counts = {n: step_syncs(m, T, packed) for n, m in models.items()}
            per_group = counts[8].total - counts[4].total
            released = counts[4].total + (RELEASED_LAYERS - 4) / 4 * per_group
            kinds = counts[8].counts
            rows.append(
                {
                    "T": T,
                    "packed": packed,
                    "step_4_layers": counts[4].total,
                    "step_8_layers": counts[8].total,
                    "per_4_layers": per_group,
                    "released_45_layers": round(released),
                    "kinds_8_layers": " ".join(f"{k}={v}" for k, v in sorted(kinds.items())),
                }
            )
            print(rows[-1], flush=True)
    if rows:
        print(table(rows, list(rows[0])))
    if args.no_decode:
        print("wrote", write_json(args.out, {"machine": machine(), "step": rows}))
        return
    decode = decode_syncs(models[4], 16, (2, 2 + args.decode_tokens))
    decode8 = decode_syncs(models[8], 16, (2, 2 + args.decode_tokens))
    per_group = decode8 - decode
    released = decode + (RELEASED_LAYERS - 4) / 4 * per_group
    print(
        f"eager decode syncs per token: 4 layers {decode:.1f}, 8 layers {decode8:.1f}, released 45 layers "
        f"{released:.1f}"
    )
    steps = [{"layers": n, **cached_step_syncs(models[n], 16, g)} for n in (4, 8) for g in (True, False)]
    print(table(steps, list(steps[0])))
    path = write_json(
        args.out,
        {
            "machine": machine(),
            "step": rows,
            "decode_per_token": {"4_layers": decode, "8_layers": decode8, "released_45_layers": released},
            "cached_steps": steps,
        },
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
