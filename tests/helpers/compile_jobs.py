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


def step(config: dict, state: dict, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, dp: int,
         compile: bool, bf16: bool = False, checkpointing: bool = False) -> dict:  # fmt: skip
    """This rank's dp share of the rows through a parallelized model -> loss parts, full gradients, graph breaks."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    torch._dynamo.reset()
    counters.clear()
    mesh = build_mesh(dp, 1)
    model = Glm53ForCausalLM(Glm53Config(**config))
    model.load_state_dict(state)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    parallelize(model, mesh, mp_policy=policy, activation_checkpointing=checkpointing, compile=compile,
                compile_backend="aot_eager")  # fmt: skip
    rows = slice(mesh.get_local_rank("dp") * (ids.shape[0] // dp), None)
    rows = slice(rows.start, rows.start + ids.shape[0] // dp)
    with loss_parallel_context(model):
        out = model(ids[rows], attention_mask=mask[rows], labels=labels[rows])
        out.loss.backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    parts = {n: full(getattr(out, n)) for n in PARTS if getattr(out, n) is not None}
    return dict(parts=parts, grads=grads, graph_breaks=sum(counters["graph_break"].values()),
                graphs=counters["stats"]["unique_graphs"])  # fmt: skip


def refused(config: dict) -> list[str]:
    """The errors parallelize(compile=True) raises for the combinations it refuses (before changing the model)."""
    from torch.distributed.device_mesh import init_device_mesh

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cases = [(build_mesh(2, 1), dict(mp_policy=policy, activation_checkpointing=True)),
             (init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)), {})]  # fmt: skip
    errors = []
    for mesh, options in cases:
        model = Glm53ForCausalLM(Glm53Config(**config))
        try:
            parallelize(model, mesh, compile=True, **options)
        except ValueError as e:
            errors.append(str(e))
        assert not any(hasattr(b.forward, "_torchdynamo_orig_callable") for b in model.model.layers)
    return errors
