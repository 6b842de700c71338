"""Train the tiny preset for a few steps on a (dp, tp) DeviceMesh with FSDP2 and tensor parallelism.

    torchrun --nproc-per-node 4 examples/train_distributed.py --dp 2 --tp 2            # CPU/gloo or GPU/nccl
    torchrun --nproc-per-node 4 examples/train_distributed.py --dp 4 --tp 1 --bf16

Every rank builds the same seeded model, `glm53.parallel.parallelize` shards it, each data-parallel rank takes
its slice of the global batch, and the loss is computed under `loss_parallel_context` (vocab-sharded logits).
`torchrun ... -m glm53 train --dp K --tp M` is the full training command (MTP, checkpoints, resume); this file
shows the bare API, plus bf16 mixed precision.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import loss_parallel_context, parallelize
from glm53.training.data import VOCAB_SIZE, batches, corpus_text, encode

VOCAB_MULTIPLE = 64  # round the byte vocabulary up so it splits evenly over any small TP size


def build_mesh(dp: int, tp: int, device_type: str):
    shape, names = zip(*[(n, name) for n, name in ((dp, "dp"), (tp, "tp")) if n > 1]) or ((1,), ("dp",))
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=2, help="data-parallel (FSDP2) ranks")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (split over dp)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 master weights")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if use_cuda else "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.dp * args.tp != world:
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} must equal the world size {world}")
    if args.batch_size % args.dp:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by --dp {args.dp}")
    mesh = build_mesh(args.dp, args.tp, device.type)

    vocab = -(-VOCAB_SIZE // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    heads = max(2, args.tp)
    config = Glm53Config.tiny(
        vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=heads, linear_num_heads=heads
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Glm53ForCausalLM(config).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    parallelize(model, mesh, mp_policy=policy, activation_checkpointing=args.checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    dp_rank = mesh.get_local_rank("dp") if "dp" in mesh.mesh_dim_names and args.dp > 1 else 0
    per_rank = args.batch_size // args.dp
    data = batches(encode(corpus_text()), args.batch_size, args.seq_len, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = next(data)[dp_rank * per_rank : (dp_rank + 1) * per_rank].to(device)
        with loss_parallel_context(model):
            loss = model(ids, labels=ids, return_logits=False).loss
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.update_router_bias()  # expert loads summed over dp ranks (parallelize set model.expert_load_reduce)
        loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG if use_cuda else dist.ReduceOp.SUM)
        if not use_cuda:
            loss /= world  # gloo has no AVG; every tp rank holds the same dp-local loss
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if rank == 0:
            rate = step * args.batch_size * args.seq_len / (time.perf_counter() - start)
            print(f"step {step:3d}  loss {loss.item():.4f}  grad-norm {norm.item():.3f}  {rate:,.0f} tok/s", flush=True)
    # free the sharded model and optimizer (reference cycles) while the group is alive: collected only at exit,
    # after destroy_process_group, they can make gloo abort the process
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
