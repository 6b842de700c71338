"""Jobs for the compiled parallel tests: one training forward+backward under `parallelize`, with and without
per-block torch.compile, on the same weights and this rank's rows of the batch.

Legend: B batch (the global batch's rows), T time.
"""

from __future__ import annotations

import warnings

import torch
from torch._dynamo.utils import counters
from torch.distributed.fsdp import MixedPrecisionPolicy

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel import loss_parallel_context, parallelize
from tests.helpers.parallel_jobs import build_mesh, full

PARTS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss")


def step(
    config: dict,
    state: dict,
    ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    dp: int,
    compile: bool,
    bf16: bool = False,
    checkpointing: bool = False,
    tp: int = 1,
) -> dict:
    """This rank's dp share of the rows through a parallelized model (a dp x tp mesh) -> loss parts, full
    gradients, graph breaks."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    torch._dynamo.reset()
    counters.clear()
    mesh = build_mesh(dp, tp)
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    parallelize(
        model,
        mesh,
        mp_policy=policy,
        activation_checkpointing=checkpointing,
        compile=compile,
        compile_backend="aot_eager",
    )
    rows = slice(mesh.get_local_rank("dp") * (ids.shape[0] // dp) if dp > 1 else 0, None)
    rows = slice(rows.start, rows.start + ids.shape[0] // dp)
    with loss_parallel_context(model):
        out = model(ids[rows], attention_mask=mask[rows], labels=labels[rows])
        out.loss.backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    parts = {n: full(getattr(out, n)) for n in PARTS if getattr(out, n) is not None}
    return dict(
        parts=parts,
        grads=grads,
        graph_breaks=sum(counters["graph_break"].values()),
        graphs=counters["stats"]["unique_graphs"],
    )


def refused(config: dict) -> list[str]:
    """The errors parallelize(compile=True) raises for the combinations it refuses (before changing the model)."""
    from torch.distributed.device_mesh import init_device_mesh

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cases = [
        (build_mesh(2, 1), dict(mp_policy=policy, activation_checkpointing=True)),
        (init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)), {}),
    ]
    errors = []
    for mesh, options in cases:
        model = Glm53ForCausalLM(Glm53Config(**config))
        try:
            parallelize(model, mesh, compile=True, **options)
        except ValueError as e:
            errors.append(str(e))
        assert not any(hasattr(b.forward, "_torchdynamo_orig_callable") for b in model.model.layers)
    return errors


def vocab_loss_compiled(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> dict:
    """The vocab-parallel loss (W Shard(0) over the world) eager and under torch.compile(fullgraph=True) -> both
    losses and gradients (hidden's and W's full), and the graph breaks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from glm53.parallel.vocab_loss import vocab_parallel_cross_entropy

    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    compiled = torch.compile(vocab_parallel_cross_entropy, backend="aot_eager", fullgraph=True)
    runs = {}
    for name, fn in (("eager", vocab_parallel_cross_entropy), ("compiled", compiled)):
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)], src_data_rank=None).requires_grad_()
        h = hidden.clone().requires_grad_()
        loss = fn(h, targets, w, chunk)
        loss.backward()
        runs[name] = dict(loss=loss.detach(), hidden=h.grad, weight=w.grad.full_tensor())
    return dict(runs, graph_breaks=sum(counters["graph_break"].values()), graphs=counters["stats"]["unique_graphs"])
