"""The device mesh of a composed layout: the order of its dimensions and which of them each collective spans.

Legend: dp data-parallel (FSDP2), cp context-parallel (every rank one slice of each sequence), ep
expert-parallel (routed experts Shard(0), tokens moved by all-to-all), tp tensor-parallel (heads and MLP widths).

Order, outermost first: ("dp", "cp", "ep", "tp"), rank = ((dp_rank * cp + cp_rank) * ep + ep_rank) * tp + tp_rank
(init_device_mesh's row-major order). The innermost dimensions get the neighbouring ranks (one node's fast links
on a GPU cluster): tp, whose all-reduces run twice per block; then ep, whose all-to-alls move every routed
token twice per MoE layer; then cp, whose all-gathers move a latent or a summary per attention layer; dp's
FSDP traffic overlaps compute and goes outermost. Only the dimensions in use appear (size > 1), with "dp" kept
(even of size 1) whenever ep > 1: the routed experts are FSDP-sharded over it (`EXPERT_REPLICA_DIMS`).

Where ep takes its ranks: from the data-parallel side. An ep rank reads its own batches like a dp rank and holds
a replica of every non-expert parameter (sharded over tp like everywhere), so ep composes with tp without
changing attention: each (dp, cp, ep) coordinate is one tp group of replicated activations, and each (dp, cp,
tp) coordinate one ep group that exchanges tokens. Under tp x ep the routed experts are 2-D DTensors on
("ep", "tp"): Shard(0) over ep (whole experts) and split on their inner width over tp (ExpertTensorParallel),
so the tp ranks of a group send the same tokens to the same ep ranks and each computes its slice of the
width, summed over tp after the return trip. Borrowing ep from dp x tp instead (torchtitan's other choice)
would first have to split the tp-replicated tokens over tp and gather them back; with ep from dp, the
dispatch needs nothing from tp and every rank's expert weights stay 1/(ep * tp) of the model's.

Which dimensions each reduction spans (flattened into one FSDP mesh where FSDP needs it):
- `REPLICA_DIMS` (dp, cp, ep): ranks holding replicas of the non-expert parameters: their FSDP mesh.
- `EXPERT_REPLICA_DIMS` (dp, cp): ranks holding replicas of the same routed experts: the experts' FSDP mesh.
  FSDP averages expert gradients over these only, so the dispatch scales them by 1/ep (expert.py).
- `DATA_DIMS` (dp, ep): ranks that read different rows: loss denominators are summed over them (and divided
  by their number, FSDP's average); cp ranks count their whole sequences (cp_inputs.py).
- `LOAD_DIMS` (dp, cp, ep): expert loads (aux-loss-free router biases) are summed over them; the tp ranks of
  a group count the same loads and are averaged (parallelize.expert_load_sum).
- `clip_grad_norm_` completes each mesh's norm over all of its dimensions, then combines the meshes.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp", "cp", "ep", "tp")
REPLICA_DIMS = ("dp", "cp", "ep")
EXPERT_REPLICA_DIMS = ("dp", "cp")
DATA_DIMS = ("dp", "ep")
LOAD_DIMS = ("dp", "cp", "ep")


def mesh_layout(dp: int = 1, tp: int = 1, ep: int = 1, cp: int = 1) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, names) of the mesh for these degrees (see the module docstring): the dimensions in use in
    `MESH_DIMS` order, "dp" kept when ep > 1, ("dp",) of size 1 when none is in use."""
    sizes = dict(dp=dp, cp=cp, ep=ep, tp=tp)
    bad = {n: s for n, s in sizes.items() if not isinstance(s, int) or s < 1}
    if bad:
        raise ValueError(f"mesh degrees must be integers >= 1, got {bad}")
    dims = [(n, sizes[n]) for n in MESH_DIMS if sizes[n] > 1 or (n == "dp" and ep > 1)]
    if not dims:
        dims = [("dp", 1)]
    names, shape = zip(*dims)
    return tuple(shape), tuple(names)


def present(mesh: DeviceMesh, dims: Sequence[str]) -> list[str]:
    """The dimensions of `dims` that `mesh` has, in the mesh's order."""
    names = mesh.mesh_dim_names or ()
    return [n for n in names if n in dims]


def flat_mesh(mesh: DeviceMesh, dims: Sequence[str]) -> DeviceMesh | None:
    """The 1-D mesh over `mesh`'s dimensions among `dims` (flattened when several, named by joining them), or
    None when the mesh has none of them."""
    names = present(mesh, dims)
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[tuple(names)]._flatten("_".join(names))


def size_over(mesh: DeviceMesh, dims: Sequence[str]) -> int:
    """The number of ranks spanned by `mesh`'s dimensions among `dims` (1 when it has none)."""
    size = 1
    for name in present(mesh, dims):
        size *= mesh[name].size()
    return size


def coordinate(mesh: DeviceMesh, dims: Sequence[str]) -> int:
    """This rank's row-major index over `mesh`'s dimensions among `dims` (0 when it has none): e.g. the data
    rank over DATA_DIMS, dp_rank * ep + ep_rank, which picks this rank's rows of a global batch."""
    index = 0
    for name in present(mesh, dims):
        index = index * mesh[name].size() + mesh.get_local_rank(name)
    return index


__all__ = [
    "MESH_DIMS",
    "REPLICA_DIMS",
    "EXPERT_REPLICA_DIMS",
    "DATA_DIMS",
    "LOAD_DIMS",
    "mesh_layout",
    "present",
    "flat_mesh",
    "size_over",
    "coordinate",
]
