"""Scale evidence for sharded checkpoints, computed without data: the model is built on the meta device and
parallelized in one process that plays rank r of a `fake` process group, then the loader's own read plan
(load.planned_reads) and the exporter's key order are measured.

Legend: dp/tp the mesh dimensions; bytes are on-disk bytes of the FP8 release layout (block-scaled e4m3 for the
2-D projections, with fp32 scales per touched 128 x 128 block; fp32 for glm53.precision's keep-list; bf16 for
the rest: embeddings, norms, mHC, router, lm_head, as the release's modules_to_not_convert).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..checkpoint import fp8
from ..config import Glm53Config
from ..losses import Glm53ForCausalLM
from ..precision import keeps_fp32
from ..utils import ceil_div
from ..vision.model import model_class_for
from .export import official_regions
from .load import planned_reads
from .parallelize import parallelize
from .pieces import local_tensor

# stays bf16 in the FP8 release (the vision tower too: the release has no FP8 vision tensors)
NOT_FP8 = ("embed_tokens", "layernorm", "norm", "lm_head", "hc_", "gate.weight", "model.visual.")
BLOCK = fp8.DEFAULT_BLOCK_SIZE


@dataclasses.dataclass
class RankPlan:
    rank: int
    read_bytes: int  # what load_pretrained reads on this rank (scales included)
    replicated_bytes: int  # of which tensors every rank of the mesh reads whole
    checkpoint_bytes: int  # the whole checkpoint
    shard_bytes: int  # this rank's parameters and buffers in memory (their dtype)
    largest_key_bytes: int  # the largest official tensor (the exporter's one gathered buffer)


def _disk_width(key: str, name: str, shape: tuple[int, ...]) -> tuple[int, bool]:
    """(bytes per element on disk, FP8 block-scaled?) of an official key in the FP8 release."""
    if keeps_fp32(name):
        return 4, False
    if len(shape) == 2 and key.endswith(".weight") and not any(s in key for s in NOT_FP8):
        return 1, True
    return 2, False


def _scale_bytes(index: tuple[slice, ...]) -> int:
    (r, c), (bo, bi) = index, BLOCK
    return 4 * (ceil_div(r.stop, bo) - r.start // bo) * (ceil_div(c.stop, bi) - c.start // bi)


def _numel(index: tuple[slice, ...]) -> int:
    n = 1
    for s in index:
        n *= s.stop - s.start
    return n


def plan_rank(config: Glm53Config, rank: int, dp: int, tp: int) -> RankPlan:
    """Build `config` on meta as rank `rank` of a fake dp x tp world, parallelize, and measure its reads."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * tp)
    try:
        dims = [(size, name) for size, name in ((dp, "dp"), (tp, "tp")) if size > 1] or [(1, "dp")]
        mesh = init_device_mesh("cpu", tuple(s for s, _ in dims), mesh_dim_names=tuple(n for _, n in dims))
        with torch.device("meta"):
            model = model_class_for(config)(config)  # a config declaring a vision tower builds the VL model
        parallelize(model, mesh)
        return _measure(model, rank)
    finally:
        dist.destroy_process_group()


def _measure(model: Glm53ForCausalLM, rank: int) -> RankPlan:
    pieces: dict[str, list] = {}
    tensors: dict[str, torch.Tensor] = {}
    total = largest = 0
    widths = {}
    for key, name, region, shape in official_regions(model):
        width, is_fp8 = _disk_width(key, name, shape)
        widths[key] = (width, is_fp8)
        full = _numel(tuple(slice(0, s) for s in shape))
        total += full * width + (_scale_bytes(tuple(slice(0, s) for s in shape)) if is_fp8 else 0)
        largest = max(largest, full * 4)
        pieces.setdefault(name, []).append((key, region, 0 if len(shape) == len(region) else 1))
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    tensors = {name: own[_module_name(model, name)] for name in pieces}
    read = replicated = 0
    for name, target in tensors.items():
        whole = not hasattr(target, "placements") or all(p.is_replicate() for p in target.placements)
        for key, key_idx, _ in planned_reads(target, pieces[name]):
            width, is_fp8 = widths[key]
            n = _numel(key_idx) * width + (_scale_bytes(key_idx) if is_fp8 else 0)
            read += n
            replicated += n if whole else 0
    shard = sum(local_tensor(t).numel() * t.dtype.itemsize for t in own.values())
    return RankPlan(rank, read, replicated, total, shard, largest)


def _module_name(model: Glm53ForCausalLM, name: str) -> str:
    """named_state's name (MTP as model.layers.{N+j}) -> the module path (mtp.layers.{j})."""
    n = model.config.num_hidden_layers
    if name.startswith("model.layers."):
        layer, rest = name[len("model.layers.") :].split(".", 1)
        if int(layer) >= n:
            return f"mtp.layers.{int(layer) - n}.{rest}"
    return name


__all__ = ["RankPlan", "plan_rank"]
