"""The vision tower: glm53's VisionTower vs transformers' eager Glm5NextVisionModel, same weights, paired.

    python benchmarks/bench_vision.py                    # released widths, depth 2, 8 images at half scale
    python benchmarks/bench_vision.py --depth 4 --scale 1 --reps 3
    python benchmarks/bench_vision.py --quick            # depth 2, quarter scale, 1 rep (a smoke run)

Released widths (hidden 1024, 16 heads, MLP 4096, out 4096, merger 10240, patch 14, merge 2) at `--depth` blocks
(the release has 24), on one batch of 8 images from 224^2 to 1080p (`--scale` multiplies every side, rounded to
the 28-pixel grid: the CPU default 0.5 keeps a shared machine's run to minutes). Rows: forward (no_grad) and
forward+backward (a fixed cotangent on the merged features) medians over `--reps`, alternating the two
implementations in each repetition; "speedup" is transformers' time / glm53's. "saved MiB/patch" is what
autograd keeps for backward per patch row (saved-tensor hooks, the same measure for both). Results:
benchmarks/results/bench_vision.json.
"""

from __future__ import annotations

import argparse
import math

import torch
from bench_config import machine, median, positive_int, table, timed, write_json

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


def towers(depth: int, seed: int = 0):
    from transformers import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    hf_config = Glm5NextVisionConfig(depth=depth, **RELEASED)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = Glm5NextVisionModel(hf_config).eval()
    ours = VisionTower(Glm53VisionConfig.from_dict(hf_config.to_dict())).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours, hf


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
    p.add_argument("--out", default="bench_vision.json")
    args = p.parse_args(argv)
    if not 0 < args.scale <= 2:
        p.error(f"argument --scale: must lie in (0, 2], got {args.scale}")
    if args.quick:
        args.depth, args.scale, args.reps = 2, 0.25, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, hf = towers(args.depth)
    grid = torch.tensor([grid_of(h, w, args.scale) for h, w in IMAGES])
    N = int(grid.prod(-1).sum())
    pixels = torch.randn(N, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    cot = torch.randn(N // 4, RELEASED["out_hidden_size"], generator=torch.Generator().manual_seed(2))

    runs = {
        "glm53": lambda: ours(pixels, grid).pooler_output,
        "transformers": lambda: hf(pixels, grid_thw=grid).pooler_output,
    }
    with torch.no_grad():
        a, b = runs["glm53"](), runs["transformers"]()
    max_rel = ((a - b).abs().max() / b.abs().max()).item()
    times = {(name, mode): [] for name in runs for mode in ("fwd", "fwd+bwd")}
    for _ in range(args.reps):
        for name, run in runs.items():  # paired: both in every repetition
            with torch.no_grad():
                times[(name, "fwd")].append(timed(run))
            model = ours if name == "glm53" else hf
            model.zero_grad(set_to_none=True)
            times[(name, "fwd+bwd")].append(timed(lambda: (run() * cot).sum().backward()))
    saved = {name: saved_bytes(run) for name, run in runs.items()}
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
    print(f"grids (t, h, w) in patches: {grid.tolist()}; {N} patches; max |glm53 - transformers| / max = {max_rel:.2e}")
    print(table(rows, ["mode", "patches", "images", "depth", "glm53_s", "transformers_s", "speedup"]))
    per_patch = {k: v / N / 2**20 for k, v in saved.items()}
    print(
        f"saved for backward, MiB per patch: glm53 {per_patch['glm53']:.3f}, transformers "
        f"{per_patch['transformers']:.3f}"
    )
    path = write_json(
        args.out,
        dict(
            machine=machine(),
            args=vars(args),
            grids=grid.tolist(),
            rows=rows,
            max_rel_diff=max_rel,
            saved_mib_per_patch=per_patch,
            times={f"{k[0]}/{k[1]}": v for k, v in times.items()},
        ),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
