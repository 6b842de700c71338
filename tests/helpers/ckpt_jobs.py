"""Jobs for the sharded-checkpoint tests (run on every rank of a parallel_harness.WorkerPool) and the checkpoint
they read: a tiny official-layout checkpoint (FP8 with 4 x 8 blocks, or fp32) with 4 MLA and 4 KDA heads so TP
runs over 2 or 4 ranks, one MTP layer, and a layer pattern transformers runs (the export test loads it there).

Layouts are (dp, tp) or, with an ep degree, ("dp", "ep") / ("ep",) meshes (expert parallelism); every data rank
(dp, or dp x ep in init_device_mesh's row-major order) reads its own slice of the batch, so the single-process
reference averages over dp x ep slices.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint.layout import official_key
from glm53.checkpoint.reader import checkpoint_files
from glm53.parallel import context_parallel_inputs, loss_parallel_context, parallelize
from glm53.parallel.load import SliceReader, load_pretrained
from tests.helpers.checkpoints import BLOCK, fp8_config_dict, quantize_state, read_all, write_checkpoint
from tests.helpers.expert_jobs import build_ep_mesh
from tests.helpers.oracle import TINY_VISION, randomize
from tests.helpers.parallel_jobs import build_mesh, full


def ckpt_config(**overrides) -> Glm53Config:
    base = dict(
        hidden_size=36,
        num_attention_heads=4,
        num_key_value_heads=4,
        linear_num_heads=4,
        num_nextn_predict_layers=1,
        indexer_loss_weight=1.0,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
    )
    base.update(overrides)
    # Nested with a tiny vision tower, as the release's config.json is, so transformers builds a small model.
    text = Glm53Config.tiny(**base).to_dict()
    return Glm53Config.from_dict({"text_config": text, "vision_config": dict(TINY_VISION)})


def write_test_checkpoint(path: str, fp8_blocks: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random model written in the official layout (FP8 blocks of BLOCK when `fp8_blocks`); -> its state."""
    config = ckpt_config()
    model = Glm53ForCausalLM.from_config(config)
    randomize(model, seed)
    plain = path + ".plain"
    model.save_pretrained(plain)
    state = read_all(plain)
    if fp8_blocks:
        write_checkpoint(path, quantize_state(state, BLOCK), fp8_config_dict(config, BLOCK))
    else:
        d = config.to_official_dict()
        d["dtype"] = "float32"
        write_checkpoint(path, state, d)
    return state


class CountingReader(SliceReader):
    """Counts what reaches the disk reads on its own (independently of SliceReader.bytes_read)."""

    def read(self, key, index):
        part = super().read(key, index)
        self.counted = getattr(self, "counted", 0) + part.nbytes
        self.keys = getattr(self, "keys", set()) | {key}
        return part


def expected_bytes(model: torch.nn.Module, path: str) -> int:
    """This rank's share: every local element once at its on-disk width (FP8 scales not included)."""
    files = checkpoint_files(path)
    width = {}
    for key, file in files.items():
        with safe_open(file, framework="pt") as f:
            width[key] = f.get_slice(key).get_dtype()
    sizes = {"F32": 4, "BF16": 2, "F8_E4M3": 1}
    total = 0
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    n = model.config.num_hidden_layers
    for name, tensor in named.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = official_key(name.rsplit(".", 1)[0], n)
            key = f"{base}.0.{'down' if name.endswith('down_proj') else 'gate'}_proj.weight"
        else:
            key = official_key(name, n)
        total += local.numel() * sizes[width[key]]
    return total


def ckpt_mesh(dp: int, tp: int, ep: int = 1, cp: int = 1):
    """A (dp, tp) mesh, or with ep > 1 a ("dp", "ep") mesh (("ep",) when dp == 1); composed layouts (cp > 1, or
    ep with tp) as `glm53 train` builds them (init_mesh)."""
    if cp > 1 or (ep > 1 and tp > 1):
        from glm53.parallel import init_mesh

        return init_mesh(dp, tp, ep=ep, cp=cp)
    if ep > 1:
        return build_ep_mesh(dp, ep, one_dim=dp == 1)
    return build_mesh(dp, tp)


def data_share(mesh, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's slice of `ids`, number of slices): one slice per data rank over the mesh's dp and ep dims."""
    names = mesh.mesh_dim_names if mesh is not None else ()
    index, count = 0, 1
    for d in [d for d in ("dp", "ep") if d in names]:
        index, count = index * mesh[d].size() + mesh.get_local_rank(d), count * mesh[d].size()
    per = ids.shape[0] // count
    return ids[index * per : (index + 1) * per], count


def mean_over_data_ranks(value: torch.Tensor, mesh) -> torch.Tensor:
    """The mean of a per-rank value over the data ranks (tp ranks hold the same value)."""
    names = mesh.mesh_dim_names if mesh is not None else ()
    count = 1
    for d in [d for d in ("dp", "ep") if d in names]:  # tp and cp ranks hold the same value
        dist.all_reduce(value, group=mesh.get_group(d))
        count *= mesh[d].size()
    return value / count


def sharded_load_step(path: str, ids: torch.Tensor, dp: int, tp: int, to_empty: bool = False, ep: int = 1) -> dict:
    """Build on meta, parallelize (then `to_empty` when asked), load_pretrained, one forward/backward on this
    rank's data share."""
    mesh = ckpt_mesh(dp, tp, ep)
    config = Glm53Config.from_pretrained(path)
    with torch.device("meta"):
        model = Glm53ForCausalLM(config)
    parallelize(model, mesh)
    if to_empty:
        model.to_empty(device="cpu")
    load_pretrained(model, path, reader=CountingReader)
    reader = model.checkpoint_reader
    local_ids, _ = data_share(mesh, ids)
    with loss_parallel_context(model):
        out = model(local_ids, labels=local_ids)
        out.loss.backward()
    loss = mean_over_data_ranks(full(out.loss), mesh)
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    params = {n: full(p) for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return dict(
        loss=loss,
        grads=grads,
        params=params,
        buffers=buffers,
        bytes_read=reader.bytes_read,
        counted=reader.counted,
        expected=expected_bytes(model, path),
        keys=sorted(reader.keys),
    )


def reference_load_step(path: str, ids: torch.Tensor, dp: int) -> dict:
    """One process: from_pretrained, the mean over dp slices of each slice's loss, its gradients."""
    model = Glm53ForCausalLM.from_pretrained(path, dtype=torch.float32)
    per = ids.shape[0] // dp
    loss = sum(model(ids[k * per : (k + 1) * per], labels=ids[k * per : (k + 1) * per]).loss for k in range(dp)) / dp
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(loss=loss.detach(), grads=grads, params=params)


def file_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


LR = 1e-2  # AdamW learning rate of the resume tests


def _model_on(path: str, dp: int, tp: int, ep: int = 1, cp: int = 1):
    """(model loaded from `path` on a fresh (dp, tp) or (dp, ep) mesh, its mesh); dp = tp = 0 means one plain
    process."""
    config = Glm53Config.from_pretrained(path)
    if dp == 0:
        return Glm53ForCausalLM.from_pretrained(path, dtype=torch.float32), None
    mesh = ckpt_mesh(dp, tp, ep, cp)
    with torch.device("meta"):
        model = Glm53ForCausalLM(config)
    parallelize(model, mesh)
    load_pretrained(model, path)
    return model, mesh


def _train_step(model, mesh, optimizer, ids: torch.Tensor, step: bool = True) -> torch.Tensor:
    """Loss on this rank's data share of `ids` (mean over data ranks returned); then backward + AdamW when
    `step`."""
    local, _ = data_share(mesh, ids)
    optimizer.zero_grad()
    cp = mesh is not None and "cp" in mesh.mesh_dim_names
    kwargs = context_parallel_inputs(model, local, labels=local) if cp else dict(input_ids=local, labels=local)
    with loss_parallel_context(model):
        loss = model(**kwargs).loss
        if step:
            loss.backward()
    if step:
        optimizer.step()
    return mean_over_data_ranks(full(loss), mesh)


def save_then_continue(
    init: str, save: str, batches: list[torch.Tensor], dp: int, tp: int, ep: int = 1, cp: int = 1
) -> list[float]:
    """Step on batches[0], save the training state (DCP) to `save`, then step on batches[1] and read the loss on
    batches[2] -> [loss 1, loss 2, loss 3]."""
    from glm53.parallel.export import shared_atomic_directory
    from glm53.parallel.train_state import write_training_state

    model, mesh = _model_on(init, dp, tp, ep, cp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    first = _train_step(model, mesh, optimizer, batches[0])
    with shared_atomic_directory(save) as tmp:
        write_training_state(tmp, model, optimizer, {"step": 1, f"rng.rank{dist.get_rank()}": torch.get_rng_state()})
    second = _train_step(model, mesh, optimizer, batches[1])
    third = _train_step(model, mesh, optimizer, batches[2], step=False)
    return [first.item(), second.item(), third.item()]


def resume_and_continue(
    init: str, save: str, batches: list[torch.Tensor], dp: int, tp: int, ep: int = 1, cp: int = 1
) -> list[float]:
    """Build on another layout (dp = 0: one process), load the training state, step on batches[1], read the
    loss on batches[2] -> [loss 2, loss 3, restored step]."""
    from glm53.parallel.train_state import read_training_state

    model, mesh = _model_on(init, dp, tp, ep, cp)  # the initial weights: the saved state must overwrite them
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 3)  # lr restored from the saved param_groups
    extra = read_training_state(save, model, optimizer, {"step": 0})
    second = _train_step(model, mesh, optimizer, batches[1])
    third = _train_step(model, mesh, optimizer, batches[2], step=False)
    return [second.item(), third.item(), extra["step"]]


def load_and_export(init: str, out: str, dp: int, tp: int, max_shard_size: int, ep: int = 1) -> dict:
    """Load `init` sharded on (dp, tp) or (dp, ep), export it to `out` -> this rank's largest pending file bytes."""
    from glm53.parallel.export import export_pretrained

    model, _ = _model_on(init, dp, tp, ep)
    export_pretrained(model, out, max_shard_size=max_shard_size, overwrite=True)
    return dict(pending=model.export_peak_pending_bytes)


def sharded_load_error(path: str, dp: int, tp: int) -> str:
    """load_pretrained on (dp, tp) -> the CheckpointError message it raised ('' when none)."""
    from glm53.errors import CheckpointError

    mesh = build_mesh(dp, tp)
    with torch.device("meta"):
        model = Glm53ForCausalLM(Glm53Config.from_pretrained(path))
    parallelize(model, mesh)
    try:
        load_pretrained(model, path)
    except CheckpointError as e:
        return str(e)
    return ""


def _placed(full_value: torch.Tensor, layout: str):
    """`full_value` as a DTensor on a 4-rank layout: "rows" Shard(1) (FSDP on the packed dim, as under expert
    parallelism), "strided" _StridedShard(1, 2) (TP's packed gate/up), "2d" (Shard(0), _StridedShard(1, 2))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if layout == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        placements = [Shard(0), _StridedShard(1, split_factor=2)]
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("a",))
        placements = [Shard(1) if layout == "rows" else _StridedShard(1, split_factor=2)]
    return distribute_tensor(full_value, mesh, placements, src_data_rank=None)


def dcp_reshard(directory: str, value: torch.Tensor, saved: str, loaded: str) -> bool:
    """Save `value` placed as `saved` through the training-state chunks, load it placed as `loaded` -> equal?"""
    import torch.distributed.checkpoint as dcp

    from glm53.parallel.train_state import _entry, _LoadPlanner, _SavePlanner

    dcp.save({"w": _entry(_placed(value, saved))}, checkpoint_id=directory, planner=_SavePlanner())
    target = _placed(torch.zeros_like(value), loaded)
    dcp.load({"w": _entry(target)}, checkpoint_id=directory, planner=_LoadPlanner())
    return bool(torch.equal(target.full_tensor(), value))
