"""The vision tower: glm53's VisionTower vs transformers' eager Glm5NextVisionModel, same weights, paired.

    python benchmarks/bench_vision.py                    # released widths, depth 2, 8 images at half scale
    python benchmarks/bench_vision.py --depth 4 --scale 1 --reps 3
    python benchmarks/bench_vision.py --quick            # depth 2, quarter scale, 1 rep (a smoke run)
    python benchmarks/bench_vision.py --quick --profile  # + where one fwd+bwd's time goes (GEMM / attention / rest)
    python benchmarks/bench_vision.py --quick --vl-step  # + the whole VL model step, images vs text-only
    python benchmarks/bench_vision.py --compile          # + glm53's tower compiled (compile_vision_blocks, inductor)

Released widths (hidden 1024, 16 heads, MLP 4096, out 4096, merger 10240, patch 14, merge 2) at `--depth` blocks
(the release has 24), on one batch of 8 images from 224^2 to 1080p (`--scale` multiplies every side, rounded to
the 28-pixel grid: the CPU default 0.5 keeps a shared machine's run to minutes). Rows: forward (no_grad) and
forward+backward (a fixed cotangent on the merged features) medians over `--reps`, alternating the two
implementations in each repetition after one untimed warm-up of each; "speedup" is transformers' time / glm53's.
`--compile` adds a third tower, the same weights with glm53.model.compile.compile_vision_blocks (backend inductor,
dynamic rows) timed in the same repetitions ("compiled_s", "compiled_speedup": transformers' / compiled); its
warm-up compiles the forward and the forward+backward graphs, reported apart ("compile_s"). "saved MiB/patch" is
what autograd keeps for backward per patch row (saved-tensor hooks, the same measure for each). Results:
benchmarks/results/bench_vision.json.
"""

from __future__ import annotations

import argparse
import math

import torch
from bench_config import machine, median, positive_int, table, timed, write_json

from glm53.model.compile import compile_vision_blocks
from glm53.vision import Glm53VisionConfig, VisionTower

RELEASED = dict(
    hidden_size=1024,
    num_heads=16,
    intermediate_size=4096,
    out_hidden_size=4096,
    projection_intermediate_size=10240,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
)
IMAGES = [(224, 224), (336, 336), (448, 448), (512, 640), (720, 720), (768, 1024), (1080, 1080), (1080, 1920)]
GRID = 28  # patch 14 x merge 2: pixels per merged token side


def grid_of(h: int, w: int, scale: float) -> tuple[int, int, int]:
    side = lambda x: max(1, math.ceil(x * scale / GRID)) * 2  # noqa: E731  (patches, a multiple of the merge)
    return 1, side(h), side(w)


def towers(depth: int, seed: int = 0, compiled: bool = False):
    """(glm53's tower, transformers', glm53's compiled with inductor or None), all with the same weights."""
    from transformers import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    hf_config = Glm5NextVisionConfig(depth=depth, **RELEASED)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = Glm5NextVisionModel(hf_config).eval()
    ours = VisionTower(Glm53VisionConfig.from_dict(hf_config.to_dict())).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    fast = None
    if compiled:
        fast = VisionTower(ours.config).eval()
        fast.load_state_dict(hf.state_dict(), strict=True)
        compile_vision_blocks(fast, backend="inductor")
    return ours, hf, fast


# Op categories of the profile split (self CPU time of each aten op, children excluded, forward and backward).
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::einsum")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "aten::_softmax", "aten::softmax", "aten::_softmax_backward")


def category(op: str) -> str:
    if any(op == g or op.startswith(g + "_") for g in GEMM_OPS):
        return "gemm"
    if any(a in op for a in ATTENTION_OPS):
        return "attention"
    return "other"


def profile_split(fn) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """One call of `fn` under torch.profiler -> (seconds per category, the 8 most expensive non-GEMM ops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    per_op: dict[str, float] = {}
    for e in prof.key_averages():
        per_op[e.key] = per_op.get(e.key, 0.0) + e.self_cpu_time_total / 1e6
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for op, t in per_op.items():
        split[category(op)] += t
    others = sorted(((op, t) for op, t in per_op.items() if category(op) != "gemm"), key=lambda x: -x[1])[:8]
    return split, others


VL_TOKENS = dict(
    image_token_id=4000,
    video_token_id=4001,
    image_start_token_id=4002,
    image_end_token_id=4003,
    video_start_token_id=4004,
    video_end_token_id=4005,
)


def vl_step(depth: int, grid: torch.Tensor, pixels: torch.Tensor, reps: int) -> dict:
    """The whole VL model's training step (lm_loss fwd+bwd) on one row holding the 8 images (their placeholder
    spans, 16 text tokens after each) vs the same ids with every placeholder / marker replaced by a text token
    and no pixels: benchmarks/bench_config.py's text model (hidden 256, 8 layers) under a tower of the released
    widths at `depth` blocks, its projector into width 256 (merger inner width 640: the release's 2.5 x)."""
    from bench_config import bench_config

    from glm53.vision import with_vision
    from glm53.vision.model import Glm53ForConditionalGeneration

    text = bench_config()
    tower = {**RELEASED, "depth": depth, "out_hidden_size": text.hidden_size, "projection_intermediate_size": 640}
    torch.manual_seed(0)
    model = Glm53ForConditionalGeneration(with_vision(text, tower, VL_TOKENS)).train()
    gen = torch.Generator().manual_seed(3)
    ids = []
    for _, h, w in grid.tolist():
        ids += [VL_TOKENS["image_start_token_id"], *[VL_TOKENS["image_token_id"]] * (h * w // 4)]
        ids += [VL_TOKENS["image_end_token_id"], *torch.randint(1, 3000, (16,), generator=gen).tolist()]
    with_images = torch.tensor([ids])
    text_only = with_images.masked_fill(with_images >= 4000, 7)
    runs = {
        "images": lambda: model(with_images, pixel_values=pixels, image_grid_thw=grid, labels=text_only).lm_loss,
        "text-only": lambda: model(text_only, labels=text_only).lm_loss,
    }
    for run in runs.values():  # warm-up, untimed
        run().backward()
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            model.zero_grad(set_to_none=True)
            times[name].append(timed(lambda: run().backward()))
    saved = {name: saved_bytes(run) for name, run in runs.items()}
    N = pixels.shape[0]
    rows = [
        dict(
            batch=name,
            tokens=with_images.shape[1],
            step_s=f"{median(times[name]):.3f}",
            saved_MiB=f"{saved[name] / 2**20:.1f}",
        )
        for name in runs
    ]
    extra = (saved["images"] - saved["text-only"]) / N / 2**20
    ratio = median(times["images"]) / median(times["text-only"])
    print(f"whole VL model step, one row of {with_images.shape[1]} tokens ({N} image patches, {N // 4} placeholders):")
    print(table(rows, ["batch", "tokens", "step_s", "saved_MiB"]))
    print(f"  images / text-only step time {ratio:.2f}x; saved for backward per image patch {extra:.3f} MiB")
    return dict(rows=rows, step_ratio=ratio, saved_mib_per_image_patch=extra, times=times)


def saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=positive_int, default=2)
    p.add_argument("--scale", type=float, default=0.5, help="multiplies every image side (1 = 224^2 .. 1080p)")
    p.add_argument("--reps", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--vl-step",
        action="store_true",
        help="also time the whole VL model's training step with the images vs text-only on the same tokens",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one fwd+bwd of each: time in GEMMs vs attention vs the rest (norms, rope, SwiGLU, copies)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time glm53's tower compiled (compile_vision_blocks, inductor); compile time reported apart",
    )
    p.add_argument("--out", default="bench_vision.json")
    args = p.parse_args(argv)
    if not 0 < args.scale <= 2:
        p.error(f"argument --scale: must lie in (0, 2], got {args.scale}")
    if args.quick:
        args.depth, args.scale, args.reps = 2, 0.25, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, hf, fast = towers(args.depth, compiled=args.compile)
    grid = torch.tensor([grid_of(h, w, args.scale) for h, w in IMAGES])
    N = int(grid.prod(-1).sum())
    pixels = torch.randn(N, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    cot = torch.randn(N // 4, RELEASED["out_hidden_size"], generator=torch.Generator().manual_seed(2))

    models = {"glm53": ours, "transformers": hf, **({"compiled": fast} if fast is not None else {})}
    runs = {
        "glm53": lambda: ours(pixels, grid).pooler_output,
        "transformers": lambda: hf(pixels, grid_thw=grid).pooler_output,
    }
    if fast is not None:
        runs["compiled"] = lambda: fast(pixels, grid).pooler_output
    compile_s = {}
    with torch.no_grad():
        a, b = runs["glm53"](), runs["transformers"]()
        if fast is not None:
            compile_s["fwd"] = timed(runs["compiled"])  # the no_grad graphs
    max_rel = ((a - b).abs().max() / b.abs().max()).item()
    for name, run in runs.items():  # warm-up, untimed: the process's first backward pays one-time set-up costs
        t = timed(lambda: (run() * cot).sum().backward())
        if name == "compiled":
            compile_s["fwd+bwd"] = t  # the forward and backward graphs of training
    if fast is not None:
        with torch.no_grad():
            c = runs["compiled"]()
        max_rel_compiled = ((c - b).abs().max() / b.abs().max()).item()
    times = {(name, mode): [] for name in runs for mode in ("fwd", "fwd+bwd")}
    for _ in range(args.reps):
        for name, run in runs.items():  # paired: all in every repetition
            with torch.no_grad():
                times[(name, "fwd")].append(timed(run))
            models[name].zero_grad(set_to_none=True)
            times[(name, "fwd+bwd")].append(timed(lambda: (run() * cot).sum().backward()))
    saved = {name: saved_bytes(run) for name, run in runs.items()}
    splits = {}
    if args.profile:
        for name, run in runs.items():
            models[name].zero_grad(set_to_none=True)
            split, others = profile_split(lambda: (run() * cot).sum().backward())
            splits[name] = dict(seconds=split, top_non_gemm=others)
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        t_ours, t_hf = median(times[("glm53", mode)]), median(times[("transformers", mode)])
        rows.append(
            dict(
                mode=mode,
                patches=N,
                images=len(IMAGES),
                depth=args.depth,
                glm53_s=f"{t_ours:.3f}",
                transformers_s=f"{t_hf:.3f}",
                speedup=f"{t_hf / t_ours:.2f}x",
            )
        )
        if fast is not None:
            t_fast = median(times[("compiled", mode)])
            rows[-1].update(
                compiled_s=f"{t_fast:.3f}", compiled_speedup=f"{t_hf / t_fast:.2f}x", compile_s=f"{compile_s[mode]:.1f}"
            )
    print(f"grids (t, h, w) in patches: {grid.tolist()}; {N} patches; max |glm53 - transformers| / max = {max_rel:.2e}")
    columns = ["mode", "patches", "images", "depth", "glm53_s", "transformers_s", "speedup"]
    if fast is not None:
        print(f"compiled (inductor): max |compiled - transformers| / max = {max_rel_compiled:.2e}")
        columns += ["compiled_s", "compiled_speedup", "compile_s"]
    print(table(rows, columns))
    per_patch = {k: v / N / 2**20 for k, v in saved.items()}
    print("saved for backward, MiB per patch: " + ", ".join(f"{k} {v:.3f}" for k, v in per_patch.items()))
    vl = vl_step(args.depth, grid, pixels, args.reps) if args.vl_step else None
    if splits:
        prof_rows = []
        for name, sp in splits.items():
            total = sum(sp["seconds"].values())
            row = dict(impl=name, total_s=f"{total:.2f}")
            row.update({f"{k}_share": f"{v / total:.1%}" for k, v in sp["seconds"].items()})
            prof_rows.append(row)
        print("profile of one fwd+bwd (self CPU time by op category):")
        print(table(prof_rows, ["impl", "total_s", "gemm_share", "attention_share", "other_share"]))
        for name, sp in splits.items():
            print(f"  {name} top non-GEMM ops: " + ", ".join(f"{op} {t:.2f}s" for op, t in sp["top_non_gemm"]))
    path = write_json(
        args.out,
        dict(
            machine=machine(),
            args=vars(args),
            grids=grid.tolist(),
            rows=rows,
            max_rel_diff=max_rel,
            max_rel_diff_compiled=max_rel_compiled if fast is not None else None,
            compile_s=compile_s,
            saved_mib_per_patch=per_patch,
            profile=splits,
            vl_step=vl,
            times={f"{k[0]}/{k[1]}": v for k, v in times.items()},
        ),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
