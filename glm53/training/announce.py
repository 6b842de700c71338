"""What `glm53 train` says when a run starts (the opening lines of the log), apart from the loop in trainer.py."""

from __future__ import annotations

from .optim import total_steps


def announce(trainer) -> None:
    """The run's opening lines: what it trains, its layout, dtype and schedule, resume notes, the data."""
    args = trainer.args
    params = sum(p.numel() for p in trainer.model.parameters())
    how = (
        f"resuming {args.resume} at step {trainer.start}"
        if trainer.state
        else f"preset {args.preset}, seed {args.seed}"
    )
    how = f"fine-tuning {args.init}, seed {args.seed}" if args.init else how
    ep = f" x ep {args.ep}" if args.ep > 1 else ""
    ep += f" x cp {args.cp}" if args.cp > 1 else ""
    layout = f", dp {args.dp} x tp {args.tp}{ep}" if trainer.par is not None else ""
    accum = f"{args.grad_accum}x" if args.grad_accum > 1 else ""
    print(
        f"glm53 train: {how}, {params:,} parameters{layout}, {args.steps} steps of {accum}{args.batch_size}x"
        f"{args.seq_len} tokens",
        flush=True,
    )
    print(
        f"dtype: {dtype_text(trainer)}; device {trainer.device}; schedule {args.schedule}, {total_steps(args)} steps",
        flush=True,
    )
    for note in getattr(args, "config_notes", []):
        print(f"changed on resume: {note}", flush=True)
    if getattr(args, "save_from_resume", False):
        print(f"saving into the resumed directory {args.save} (no --save given)", flush=True)
    if trainer.data is not None:
        print(trainer.data.describe(), flush=True)
    else:  # said, not silent: a user who forgot --data sees what the run trains on
        print("data: the built-in byte corpus (token = byte + 1; --data FILE trains on your own)", flush=True)
    if trainer.start >= args.steps:
        print(f"already at step {trainer.start} >= --steps {args.steps}; nothing to do", flush=True)


def dtype_text(trainer) -> str:
    """The training precision, said in the log (never silently bf16 weights)."""
    if trainer.par is not None:
        return "bf16 compute, fp32 master weights (FSDP2 policy)" if trainer.args.bf16 else "fp32"
    loaded = getattr(trainer, "loaded_dtypes", ["float32"])
    source = "" if loaded == ["float32"] else f" (checkpoint {'/'.join(loaded)}, trained as fp32 masters)"
    if trainer.autocast is not None:
        return f"bf16 compute (autocast), fp32 master weights and optimizer state{source}"
    return f"fp32{source}"
