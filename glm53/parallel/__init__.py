"""glm53.parallel: FSDP2 and tensor parallelism over DTensor, the only glm53 package that imports torch.distributed.

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize(Glm53ForCausalLM.from_config(config), mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16))
    loss = model(ids, labels=ids, return_logits=False).loss  # under TP: the vocab-parallel chunked loss
    loss.backward()

Importing this package routes `glm53.hooks.as_local` through `boundary._resolve` (a no-op for plain tensors)
and a vocab-sharded head's loss through `vocab_loss.py`; `loss_parallel_context(model)` is for a loss of your own
over the vocab-sharded `out.logits`.
"""

from . import expert as _expert
from . import placements as _placements
from . import vocab_loss as _vocab_loss
from .cp_inputs import context_parallel_inputs
from .cp_shards import CpShards
from .expert import apply_expert_parallel, check_ep_size, clip_grad_norm_
from .export import export_pretrained
from .load import load_pretrained
from .parallelize import (
    apply_fsdp,
    apply_tensor_parallel,
    expert_load_sum,
    init_weights,
    loss_parallel_context,
    parallelize,
    zero_rows,
)
from .placements import LocalShard, PlacementError, Whole, local_shard, materialize_full, set_placement_rule
from .runtime import full_optimizer_state, full_state, init_mesh, load_full_optimizer_state, loss_denominators
from .tensor_parallel import (
    ExpertTensorParallel,
    LocalShardParams,
    ReplicateModule,
    ReplicateParams,
    check_tp_size,
    tp_plan,
)
from .train_state import read_training_state, write_training_state

_placements.install()
_expert.install()
_vocab_loss.install()

__all__ = [
    "materialize_full",
    "local_shard",
    "PlacementError",
    "Whole",
    "LocalShard",
    "set_placement_rule",
    "parallelize",
    "apply_tensor_parallel",
    "apply_fsdp",
    "loss_parallel_context",
    "init_weights",
    "zero_rows",
    "expert_load_sum",
    "apply_expert_parallel",
    "check_ep_size",
    "clip_grad_norm_",
    "init_mesh",
    "loss_denominators",
    "full_state",
    "full_optimizer_state",
    "load_full_optimizer_state",
    "load_pretrained",
    "export_pretrained",
    "write_training_state",
    "read_training_state",
    "context_parallel_inputs",
    "CpShards",
    "tp_plan",
    "check_tp_size",
    "ReplicateParams",
    "ReplicateModule",
    "LocalShardParams",
    "ExpertTensorParallel",
]
