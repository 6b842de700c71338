"""The first-GPU check: does glm53 run on CUDA, and how fast. Under 5 minutes on one GPU; writes a JSON result.

    python benchmarks/gpu_check.py                  # on a GPU machine -> benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --cpu-smoke      # every part on CPU at tiny sizes (the CUDA parts say skipped)

Parts (each records ok / skipped / failed with its numbers, and one failing part does not stop the others):
  parity     fp32 forward + backward of the tiny config on CUDA vs CPU, same weights and batch: the logits' and every
             gradient's max relative difference (bound: fp32 eps x reduction depth, below)
  bf16_train `glm53 train --device cuda --bf16` for a few steps (one process: fp32 masters, bf16 autocast): the
             loss falls, the weights stay fp32, the metrics file has tokens/s
  compile    compile_blocks (inductor) forward + backward equals eager on the device (skipped in the CPU smoke)
  generate   cached greedy decoding equals greedy decoding by full forwards on the device
  bench_step the bench config (benchmarks/bench_config.py; the tiny preset in the smoke), a bf16 training step: tokens/s and MFU against the
             device's dense bf16 peak (H100/H200 989 TFLOP/s, A100 312; else --peak-tflops)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time
import traceback

import torch
from bench_config import RESULTS_DIR, bench_config, machine  # noqa: E402  (also puts the repository on sys.path)

from glm53 import Glm53ForCausalLM  # noqa: E402
from glm53.training.metrics import (
    PEAK_TFLOPS,  # noqa: E402
    flops_per_token,  # noqa: E402
)
from glm53.training.trainer import PRESETS  # noqa: E402

# fp32 parity bound: eps (1.2e-7) x a reduction depth of ~1e3 terms (hidden 32 x 8 layers x 4 ops, as a generous
# depth for the tiny model's longest dependency chain) ~ 1.2e-4, and GPU GEMMs reorder sums (TF32 is off here).
PARITY_RTOL = 2e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _batch(vocab: int, B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def part_parity(device: str, smoke: bool) -> dict:
    if device != "cuda":
        return {"status": "skipped", "why": "no CUDA device: CUDA vs CPU parity needs a GPU"}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    cpu = Glm53ForCausalLM(PRESETS["tiny"]())
    gpu = Glm53ForCausalLM(PRESETS["tiny"]()).cuda()
    gpu.load_state_dict(cpu.state_dict())
    ids = _batch(256, 2, 48)
    outs = []
    for model, dev in ((cpu, "cpu"), (gpu, "cuda")):
        x = ids.to(dev)
        out = model(x, labels=x)
        out.loss.backward()
        outs.append((out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    logits = _rel(outs[1][0], outs[0][0])
    grads = {n: _rel(outs[1][1][n], g) for n, g in outs[0][1].items()}
    worst = max(grads, key=grads.get)
    ok = logits <= PARITY_RTOL and grads[worst] <= PARITY_RTOL * 10  # gradients: one more chain of reductions
    return {
        "status": "ok" if ok else "failed",
        "logits_rel": logits,
        "worst_grad": worst,
        "worst_grad_rel": grads[worst],
        "bound": PARITY_RTOL,
    }


def part_bf16_train(device: str, smoke: bool) -> dict:
    from glm53.__main__ import main

    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        steps = 2 if smoke else 20
        argv = [
            "train",
            "--device",
            device,
            "--bf16",
            "--steps",
            str(steps),
            "--batch-size",
            "2" if smoke else "8",
            "--seq-len",
            "32" if smoke else "128",
            "--log-every",
            "1",
            "--save",
            run,
        ]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            status = main(argv)
        if status != 0:
            return {"status": "failed", "why": f"exit status {status}", "output": out.getvalue()[-2000:]}
        rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        model = Glm53ForCausalLM.from_pretrained(run)
    fell = rows[-1]["loss"] < rows[0]["loss"]
    ok = (fell or smoke) and "bf16 compute" in out.getvalue() and rows[-1]["tokens_per_s"] > 0
    return {
        "status": "ok" if ok else "failed",
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "tokens_per_s": rows[-1]["tokens_per_s"],
        "peak_memory_bytes": rows[-1]["peak_memory_bytes"],
        "saved_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


def part_compile(device: str, smoke: bool) -> dict:
    from glm53.model.compile import compile_blocks

    if smoke:
        return {"status": "skipped", "why": "CPU smoke: compiling takes minutes on a CPU (tests/compile covers it)"}
    torch.manual_seed(0)
    eager = Glm53ForCausalLM(PRESETS["tiny"]()).to(device)
    compiled = Glm53ForCausalLM(PRESETS["tiny"]()).to(device)
    compiled.load_state_dict(eager.state_dict())
    backend = "inductor"
    compile_blocks(compiled, backend=backend)
    ids = _batch(256, 2, 32).to(device)
    began = time.perf_counter()
    results = []
    for model in (eager, compiled):
        out = model(ids, labels=ids)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad for p in model.parameters()]))
    seconds = time.perf_counter() - began
    loss_rel = _rel(results[1][0], results[0][0])
    grad_rel = max(_rel(a, b) for a, b in zip(results[1][1], results[0][1]) if b is not None)
    ok = loss_rel <= 1e-4 and grad_rel <= 1e-3  # inductor fuses and reorders fp32 sums: a few eps per op
    return {
        "status": "ok" if ok else "failed",
        "backend": backend,
        "loss_rel": loss_rel,
        "grad_rel": grad_rel,
        "seconds_incl_compile": seconds,
    }


def part_generate(device: str, smoke: bool) -> dict:
    torch.manual_seed(0)
    model = Glm53ForCausalLM(PRESETS["tiny"]()).to(device).eval()
    ids = _batch(256, 2, 12).to(device)
    new = 3 if smoke else 32
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=new)
        full = ids
        for _ in range(new):  # greedy by full forwards, no cache
            full = torch.cat([full, model(full).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    same = bool(torch.equal(cached.cpu(), full.cpu()))
    return {"status": "ok" if same else "failed", "new_tokens": new, "cached_equals_full_forward": same}


def _peak(device: str, peak_tflops: float | None) -> float | None:
    if peak_tflops:
        return peak_tflops * 1e12
    if device == "cuda":
        name = torch.cuda.get_device_name()
        return next((t * 1e12 for k, t in PEAK_TFLOPS.items() if k in name), None)
    return None


def part_bench_step(device: str, smoke: bool, peak_tflops: float | None) -> dict:
    config = PRESETS["tiny"]() if smoke else bench_config()
    torch.manual_seed(0)
    model = Glm53ForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, T = (1, 32) if smoke else (8, 2048)
    ids = _batch(config.vocab_size, B, T).to(device)
    dtype = torch.bfloat16 if device == "cuda" else None
    times = []
    for _ in range(2 if smoke else 5):  # the first step warms up (allocator, kernels)
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        with torch.autocast(device, dtype=dtype) if dtype else contextlib.nullcontext():
            loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    step = min(times[1:])
    rate = B * T / step
    peak = _peak(device, peak_tflops)
    fpt = flops_per_token(model)
    return {
        "status": "ok" if math.isfinite(float(loss)) else "failed",
        "B": B,
        "T": T,
        "step_s": step,
        "tokens_per_s": rate,
        "flops_per_token": fpt,
        "mfu": None if peak is None else fpt * rate / peak,
        "dtype": "bf16 autocast" if dtype else "fp32",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="run every part on CPU at tiny sizes (CUDA parts skip)")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for the MFU")
    p.add_argument("--out", help="JSON file (default: benchmarks/results/gpu_check[_cpu_smoke].json)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    device = "cuda" if cuda else "cpu"
    if not cuda:
        print(
            "gpu_check: no CUDA device (or --cpu-smoke): CUDA-only parts are skipped, the rest run on CPU at tiny "
            "sizes",
            flush=True,
        )
    smoke = args.cpu_smoke or not cuda
    parts = {
        "parity": lambda: part_parity(device, smoke),
        "bf16_train": lambda: part_bf16_train(device, smoke),
        "compile": lambda: part_compile(device, smoke),
        "generate": lambda: part_generate(device, smoke),
        "bench_step": lambda: part_bench_step(device, smoke, args.peak_tflops),
    }
    results = {}
    for name, run in parts.items():
        began = time.perf_counter()
        try:
            results[name] = run()
        except Exception as e:  # one broken part must not hide the others' results
            results[name] = {
                "status": "failed",
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
        results[name]["seconds"] = round(time.perf_counter() - began, 2)
        detail = {k: v for k, v in results[name].items() if k not in ("traceback", "output")}
        print(f"{name:>10}  {results[name]['status']:<8} {json.dumps(detail)}", flush=True)
    payload = {
        "machine": machine(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "smoke": smoke,
        "parts": results,
    }
    out = args.out or os.path.join(RESULTS_DIR, "gpu_check_cpu_smoke.json" if smoke else "gpu_check.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {out}")
    return 0 if all(r["status"] != "failed" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
