"""glm53 `generate` vs transformers 5.23 `generate` (glm5_next, eager) on the bench config: same weights, same CPU.

    python benchmarks/bench_generate.py                        # prompts 512 and 2048, 8 new tokens, 2 reps
    python benchmarks/bench_generate.py --prompts 512 2048 8192 --new 16 --reps 3
    python benchmarks/bench_generate.py --quick                # prompt 2048 only, fewer tokens and reps (minutes)
    python benchmarks/bench_generate.py --spec-only --spec-k 1 2 3 --reps 3   # only the speculative table

Batch 1, greedy. Per prompt length P, both models run generate(max_new_tokens=1 + new) with a streamer that stamps
each token: prefill = start to the first new token (the prompt forward and its pick), decode = the time per later
token. The two models alternate (glm53, transformers, glm53, ...) and ratios are medians of per-pair ratios;
glm53's generate(compile=True) joins the rotation (compiled before timing; compiled_decode_* columns).
The decode step alone (one token after the same prefill, no generate loop) is timed interleaved for transformers'
cached forward, glm53's step (generation/step.py, what generate runs) and the same step compiled (what
generate(compile=True) runs; compile_s: its first call, the compile; --no-compile leaves it out), median and
fastest of several steps each; the step speed-up is the median of per-round ratios (and the ratio of the fastest
steps, the measure least disturbed by other load on a shared machine).
Also reported: glm53's decode step time per token at each context length; cache bytes per cached token after the prefill (glm53's GenerationCache.nbytes vs every tensor in
transformers' DynamicCache) and per extra token of context, beside the analytic per-token bytes (cache.py) and the
bf16 / int8 latent caches (`latent_dtype=torch.bfloat16` / `torch.int8`, not exact); MTP speculative decoding (k
draft tokens, with the measured split of its decode time: draft, verify, bookkeeping) against plain greedy decoding, with the random MTP layer (acceptance ~0: the cost of drafting) and with
an exact draft (every block's output projection zeroed so the next token is a function of the current one, and the
MTP layer built to predict it: acceptance 1.0, the ceiling), eager and (unless --no-compile) with compile=True on
both sides (the compiled verify and draft steps against the compiled decode step; compiled=True rows).
Results: benchmarks/results/bench_generate.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from bench_config import bench_config, machine, median, positive_int, table, write_json

from glm53 import Glm53ForCausalLM
from glm53.generation import GenerationCache, Stepper, step


def build_pair(path: str):
    from tests.helpers.oracle import hf_model

    config = bench_config().replace(num_nextn_predict_layers=1)
    hf = hf_model(config, seed=0)
    hf.save_pretrained(path)
    return hf, Glm53ForCausalLM.from_pretrained(path).eval(), config


class TimingStreamer:
    """Records when each put() arrives: both generate loops put the prompt first, then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, ids) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_generate(model, ids, new: int, is_hf: bool, compile: bool = False) -> tuple[float, float]:
    """-> (prefill seconds: start to the first new token, decode seconds per later token); `compile`: glm53's
    generate(compile=True) (warm it up first: its first decode step compiles)."""
    streamer = TimingStreamer()
    start = time.perf_counter()
    if is_hf:
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                streamer=streamer,
            )
    else:
        model.generate(ids, max_new_tokens=new, streamer=streamer, compile=compile)
    first, last = streamer.times[1], streamer.times[-1]
    return first - start, (last - first) / max(1, len(streamer.times) - 2)


def decode_steps(hf, ours, ids, steps: int, compile: bool = True) -> tuple[dict[str, list[float]], float | None]:
    """Seconds of one decode step after the same prefill, interleaved per round: transformers' cached forward,
    glm53's step (eager: what generate runs) and (`compile`) the same step through torch.compile (what
    generate(compile=True) runs), each with its own cache, all at the same positions -> (times, the compiled step's
    first call in seconds: its compile, paid once per process and config; None without `compile`)."""
    with torch.no_grad():
        pkv = hf(input_ids=ids, use_cache=True).past_key_values
    size = ids.shape[1] + steps + 2
    eager, comp = GenerationCache(ours, max_length=size), GenerationCache(ours, max_length=size)
    compiled = Stepper(compile=True) if compile else None
    with torch.inference_mode():
        for cache in (eager,) + ((comp,) if compile else ()):
            step(ours, cache, ids)
    token = ids[:, -1:]
    compile_s = None
    if compile:
        start = time.perf_counter()
        with torch.inference_mode():
            compiled(ours, comp, token)
        compile_s = time.perf_counter() - start

    def compiled_step():
        with torch.inference_mode():
            ours.lm_head(compiled(ours, comp, token)[:, -1])

    def hf_step():
        nonlocal pkv
        with torch.no_grad():
            pkv = hf(input_ids=token, past_key_values=pkv, use_cache=True).past_key_values

    def eager_step():
        with torch.inference_mode():
            ours.lm_head(step(ours, eager, token)[:, -1])

    runs = {"transformers": hf_step, "glm53": eager_step}
    if compile:
        runs["glm53_compiled"] = compiled_step
    times = {name: [] for name in runs}
    for _ in range(steps):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times, compile_s


def step_columns(times: dict[str, list[float]], compile_s: float | None) -> dict:
    ms = lambda xs: round(1e3 * xs, 2)  # noqa: E731
    hf, fast = times["transformers"], times["glm53"]
    row = {
        "glm53_step_ms_med": ms(median(fast)),
        "glm53_step_ms_min": ms(min(fast)),
        "hf_step_ms_med": ms(median(hf)),
        "hf_step_ms_min": ms(min(hf)),
        "step_speedup": round(median([h / f for h, f in zip(hf, fast)]), 2),
        "step_speedup_min": round(min(hf) / min(fast), 2),
    }
    if "glm53_compiled" in times:
        comp = times["glm53_compiled"]
        row.update(
            {
                "compiled_step_ms_med": ms(median(comp)),
                "compiled_step_ms_min": ms(min(comp)),
                "compiled_speedup": round(median([h / c for h, c in zip(hf, comp)]), 2),
                "compiled_speedup_min": round(min(hf) / min(comp), 2),
                "compiled_vs_eager": round(median([f / c for f, c in zip(fast, comp)]), 2),
                "compile_s": round(compile_s, 1),
            }
        )
    return row


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every distinct tensor reachable from a transformers cache object (attributes, lists, dicts)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and id(obj) not in seen:
        seen.add(id(obj))
        return sum(tensor_bytes(x, seen) for x in vars(obj).values())
    return 0


def analytic_bytes_per_token(config, elem: int = 4) -> tuple[int, int]:
    """Bytes per cached token summed over the MLA layers (cache.py's docstring): glm53 keeps the latent Z and one
    pooled key K per L tokens (full-indexer layers); transformers the latent and per token the indexer key, its gate
    logits and a valid flag (2K + 1)."""
    Z, K, L = config.kv_lora_rank, config.index_head_dim, config.index_kpool
    full = [config.indexer_types[i] == "full" for i in config.attention_layers]
    ours = sum(elem * Z + (elem * K // L if f else 0) for f in full)
    theirs = sum(elem * Z + (elem * (2 * K + 1) if f else 0) for f in full)
    return ours, theirs


def cache_bytes(hf, ours, ids, step: int = 64) -> dict:
    """Cache bytes per cached token after a prefill of P (KDA states amortised), and per extra token (the growth
    from P - step to P: what a longer context costs); also with a bf16 and an int8 latent (not exact)."""

    def both(x):
        with torch.no_grad():
            hf_bytes = tensor_bytes(hf(input_ids=x, use_cache=True).past_key_values)
        sizes = []
        with torch.inference_mode():
            for dtype in (None, torch.bfloat16, torch.int8):
                cache = GenerationCache(ours, latent_dtype=dtype)
                ours.model(x, cache=cache)
                sizes.append(cache.nbytes())
        return sizes[0], hf_bytes, sizes[1], sizes[2]

    P = ids.shape[1]
    (ours_p, hf_p, bf_p, i8_p), (ours_q, hf_q, bf_q, i8_q) = both(ids), both(ids[:, : P - step])
    analytic = analytic_bytes_per_token(ours.config)
    return {
        "glm53_bytes_per_token": ours_p / P,
        "transformers_bytes_per_token": hf_p / P,
        "cache_ratio": ours_p / hf_p,
        "glm53_bytes_per_extra_token": (ours_p - ours_q) / step,
        "transformers_bytes_per_extra_token": (hf_p - hf_q) / step,
        "extra_token_ratio": (ours_p - ours_q) / (hf_p - hf_q),
        "analytic_glm53_per_token": analytic[0],
        "analytic_hf_per_token": analytic[1],
        "bf16_latent_bytes_per_extra_token": (bf_p - bf_q) / step,
        "bf16_latent_extra_token_ratio": (bf_p - bf_q) / (hf_p - hf_q),
        "int8_latent_bytes_per_extra_token": (i8_p - i8_q) / step,
        "int8_latent_extra_token_ratio": (i8_p - i8_q) / (hf_p - hf_q),
    }


def layer_split(ours, ids, new: int) -> dict:
    """glm53's eager decode step time per token at this context length (KDA's part stays flat; MLA's grows)."""
    with torch.inference_mode():
        cache = GenerationCache(ours, max_length=ids.shape[1] + new + 1)
        step(ours, cache, ids)
        token = ids[:, -1:]
        total = time.perf_counter()
        for _ in range(new):
            step(ours, cache, token)
        total = time.perf_counter() - total
    return {"decode_ms_per_token": 1e3 * total / new}


def exact_draft(model) -> None:
    """Zero every block's output projection and build the MTP layer to predict the main model's next token."""
    D = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight") or "down_proj" in name:
                p.zero_()
        layer = model.mtp.layers[0]
        layer.eh_proj.weight.copy_(torch.cat([torch.eye(D), torch.zeros(D, D)], dim=1))
        layer.enorm.weight.fill_(1.0)
        layer.shared_head.norm.weight.copy_(model.model.norm.weight)


def speculative(ours, ids, new: int, ks: list[int], reps: int, label: str, compile: bool = False) -> list[dict]:
    """Per k: plain greedy and MTP speculative generate alternating (same weights, prompt and settings), eager;
    with `compile` also both with compile=True (inductor: the compiled decode step against the compiled verify and
    draft steps, each compiled by a first untimed call)."""
    rows = []
    for k in ks:
        for comp in (False, True) if compile else (False,):
            if comp:
                ours.generate(ids, max_new_tokens=3, compile=True)
                ours.generate(ids, max_new_tokens=k + 3, speculative="mtp", num_speculative_tokens=k, compile=True)
            plain, fast, draft, verify, rate = [], [], [], [], 0.0
            for _ in range(reps):
                _, s0 = ours.generate(ids, max_new_tokens=new, return_stats=True, compile=comp)
                _, s1 = ours.generate(
                    ids,
                    max_new_tokens=new,
                    speculative="mtp",
                    num_speculative_tokens=k,
                    return_stats=True,
                    compile=comp,
                )
                plain.append(s0.decode_seconds)
                fast.append(s1.decode_seconds)
                draft.append(s1.draft_seconds)
                verify.append(s1.verify_seconds)
                rate = s1.acceptance_rate
            decoded = new - 1  # the first new token comes from the prefill
            rows.append(
                {
                    "draft": label,
                    "compiled": comp,
                    "P": ids.shape[1],
                    "k": k,
                    "new": new,
                    "acceptance": round(rate, 3),
                    "plain_decode_s": round(median(plain), 3),
                    "spec_decode_s": round(median(fast), 3),
                    "spec_draft_s": round(median(draft), 3),
                    "spec_verify_s": round(median(verify), 3),
                    "spec_bookkeeping_s": round(median(fast) - median(draft) - median(verify), 3),
                    "plain_tok_s": round(decoded / median(plain), 1),
                    "spec_tok_s": round(decoded / median(fast), 1),
                    "speedup": round(median([a / b for a, b in zip(plain, fast)]), 2),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=positive_int, nargs="+", default=[512, 2048])
    ap.add_argument(
        "--glm53-only-prompts", type=positive_int, nargs="*", default=[], help="decode split without transformers"
    )
    ap.add_argument("--new", type=positive_int, default=8, help="decode tokens timed per run (after the first)")
    ap.add_argument("--reps", type=positive_int, default=2)
    ap.add_argument("--spec-k", type=positive_int, nargs="*", default=[1, 3])
    ap.add_argument("--spec-prompt", type=positive_int, default=512)
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    ap.add_argument("--out", default="bench_generate.json")
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled decode step (its compile)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="prompt 2048 (split also at 512, 4096), 4 new tokens, 1 rep, k = 1, 2, 3 at prompt 128",
    )
    ap.add_argument(
        "--spec-only",
        action="store_true",
        help="only the speculative table (--spec-k, --spec-prompt, 4 x --new tokens, --reps)",
    )
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new, args.reps, args.spec_k, args.spec_prompt = [2048], 4, 1, [1, 2, 3], 128
        args.glm53_only_prompts = args.glm53_only_prompts or [512, 4096]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf, ours, config = build_pair(tempfile.mkdtemp(prefix="glm53-bench-gen-"))
    if args.spec_only:
        args.prompts, args.glm53_only_prompts = [], []
    rows, split = [], []
    for P in args.prompts:
        ids = torch.randint(1, config.vocab_size, (1, P))
        for model, is_hf in ((ours, False), (hf, True)):  # warm-up
            run_generate(model, ids[:, :64], 2, is_hf)
        runs = [("glm53", ours, False, False), ("transformers", hf, True, False)]
        if not args.no_compile:  # generate(compile=True): compiled once here, at this prompt's shapes
            run_generate(ours, ids, 1 + args.new, False, compile=True)
            runs.append(("glm53_compiled", ours, False, True))
        times = {name: ([], []) for name, *_ in runs}
        for _ in range(args.reps):
            for name, model, is_hf, comp in runs:
                prefill, decode = run_generate(model, ids, 1 + args.new, is_hf, comp)
                times[name][0].append(prefill)
                times[name][1].append(decode)
        (gp, gd), (tp, td) = times["glm53"], times["transformers"]
        row = {
            "P": P,
            "new": args.new,
            "glm53_prefill_tok_s": round(P / median(gp)),
            "hf_prefill_tok_s": round(P / median(tp)),
            "prefill_speedup": round(median([b / a for a, b in zip(gp, tp)]), 2),
            "glm53_decode_tok_s": round(1 / median(gd), 1),
            "hf_decode_tok_s": round(1 / median(td), 1),
            "decode_speedup": round(median([b / a for a, b in zip(gd, td)]), 2),
        }
        if "glm53_compiled" in times:
            cd = times["glm53_compiled"][1]
            row.update(
                {
                    "compiled_decode_tok_s": round(1 / median(cd), 1),
                    "compiled_decode_speedup": round(median([b / a for a, b in zip(cd, td)]), 2),
                }
            )
        row.update(step_columns(*decode_steps(hf, ours, ids, 4 * args.new, not args.no_compile)))
        row.update({k: round(v, 3) for k, v in cache_bytes(hf, ours, ids).items()})
        rows.append(row)
        print(table([row], list(row)), flush=True)
    for P in sorted(set(args.prompts) | set(args.glm53_only_prompts)):
        ids = torch.randint(1, config.vocab_size, (1, P))
        split.append({"P": P, **{k: round(v, 2) for k, v in layer_split(ours, ids, args.new).items()}})
    spec_ids = torch.randint(1, config.vocab_size, (1, args.spec_prompt))
    comp = not args.no_compile
    spec = speculative(ours, spec_ids, 4 * args.new, args.spec_k, args.reps, "random MTP", comp)
    exact_draft(ours)
    spec += speculative(ours, spec_ids, 4 * args.new, args.spec_k, args.reps, "exact draft", comp)
    if rows:
        print("\nglm53 vs transformers generate (batch 1, greedy)\n" + table(rows, list(rows[0])))
    if split:
        print("\nglm53 decode cost per token vs context\n" + table(split, list(split[0])))
    if spec:  # `--spec-k` with no values leaves speculative decoding out
        print("\nMTP speculative decoding (glm53)\n" + table(spec, list(spec[0])))
    path = write_json(
        args.out,
        {
            "machine": machine(),
            "config": config.to_dict(),
            "args": vars(args),
            "generate": rows,
            "decode_split": split,
            "speculative": spec,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
