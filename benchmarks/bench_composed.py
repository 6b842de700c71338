"""Counted vs analytic bytes per MoE and attention layer on composed layouts (gloo, world 4 and 8), used by
bench_parallel.py.

A tiny hybrid model (KDA + MoE, MLA with its indexer + MoE; no MTP, no indexer KL) parallelized by the real
`glm53.parallel.parallelize` on init_mesh(dp, tp, ep=, cp=); every rank runs forward + backward on its share of
`batch` x `seq` tokens. The model-parallel collectives (TP all-reduces, EP all-to-alls, CP all-gathers and their
backward reduce-scatters) are counted at dispatch (glm53.parallel.comm.CommBytes) and attributed to the layer
running them (module hooks on each block's self_attn and mlp, forward and backward); FSDP's unit collectives
(c10d all-gather / reduce-scatter) are counted apart, as one total per step. Analytic: glm53.tools.comm_model.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.multiprocessing as mp

COMPOSED = {
    4: {
        "dp4": (4, 1, 1, 1),
        "tp2xep2": (1, 2, 2, 1),
        "cp2xep2": (1, 1, 2, 2),
        "cp2xtp2": (1, 2, 1, 2),
        "dp2xcp2": (2, 1, 1, 2),
    },
    8: {"dp2xtp2xep2": (2, 2, 2, 1), "tp2xep2xcp2": (1, 2, 2, 2)},
}  # name -> (dp, tp, ep, cp)
FSDP_OPS = (
    "_allgather_base_",
    "allgather_into_tensor_coalesced_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
)


def bench_model_config():
    from glm53 import Glm53Config

    return Glm53Config.tiny(
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        mlp_layer_types=["sparse", "sparse"],
        indexer_types=["full", "full"],
        num_nextn_predict_layers=0,
        indexer_loss_weight=0.0,
        hidden_size=64,
    )


class _Scoped:
    """CommBytes attributed to the layer whose hooks set `scope` (None outside any: FSDP's unit gathers)."""

    def __init__(self) -> None:
        from collections import defaultdict

        self.scope = None
        self.bytes = defaultdict(lambda: defaultdict(int))

    def hook(self, model) -> None:
        for i, block in enumerate(model.model.layers):
            for part in ("self_attn", "mlp"):
                module = getattr(block, part)
                name = f"{'kda' if block.is_linear else 'mla'}" if part == "self_attn" else "moe"
                key = f"{i}.{name}"
                module.register_forward_pre_hook(lambda *_a, key=key: setattr(self, "scope", key))
                module.register_forward_hook(lambda *_a, key=key: setattr(self, "scope", None))
                module.register_full_backward_pre_hook(lambda *_a, key=key: setattr(self, "scope", key))
                module.register_full_backward_hook(lambda *_a, key=key: setattr(self, "scope", None))


def _mode(scoped: _Scoped):
    from torch.utils._python_dispatch import TorchDispatchMode

    from glm53.parallel.comm import _count

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counted = _count(func, args)
            if counted is not None:
                fsdp = func.__name__.split(".")[0] in FSDP_OPS
                scoped.bytes["fsdp" if fsdp else (scoped.scope or "other")][counted[0]] += counted[1]
            return func(*args, **(kwargs or {}))

    return Mode()


def _worker(rank: int, world: int, init_file: str, batch: int, seq: int, results) -> None:
    import gc

    import torch.distributed as dist

    from glm53 import Glm53ForCausalLM
    from glm53.parallel import context_parallel_inputs, init_mesh, parallelize
    from glm53.parallel.mesh import DATA_DIMS, coordinate, size_over

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    out = {}
    for name, (dp, tp, ep, cp) in COMPOSED[world].items():
        torch.manual_seed(0)
        mesh = init_mesh(dp, tp, ep=ep, cp=cp)
        model = parallelize(Glm53ForCausalLM(bench_model_config()), mesh)
        scoped = _Scoped()
        scoped.hook(model)
        g = torch.Generator().manual_seed(coordinate(mesh, DATA_DIMS))
        ids = torch.randint(1, 300, (batch, seq), generator=g)
        kwargs = context_parallel_inputs(model, ids, labels=ids) if cp > 1 else dict(input_ids=ids, labels=ids)
        with _mode(scoped):
            model(**kwargs, return_logits=False).loss.backward()
        out[name] = {k: dict(v) for k, v in scoped.bytes.items()}
        del model
        gc.collect()
        dist.barrier()
        assert size_over(mesh, DATA_DIMS) >= 1
    results.put((rank, out))
    dist.destroy_process_group()


def measure(world: int, batch: int, seq: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "init"), batch, seq, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=900) for _ in procs)
        for p in procs:
            p.join()
    return [got[r] for r in range(world)]


def analytic(config, layer: str, dp: int, tp: int, ep: int, cp: int, batch: int, seq: int) -> dict[str, int]:
    """Model-parallel bytes (FSDP excluded) of one layer kind from glm53.tools.comm_model."""
    from glm53.tools import comm_model as cm

    if layer == "moe":
        return cm.moe_layer_bytes(config, dp, ep, batch * -(-seq // cp), 4, tp=tp, cp=cp, fsdp=False)
    if layer == "mla":
        return cm.mla_layer_bytes(config, dp, ep, batch, seq, 4, tp=tp, cp=cp, fsdp=False)
    return cm.kda_layer_bytes(config, dp, ep, batch, seq, 4, tp=tp, cp=cp, fsdp=False)


__all__ = ["COMPOSED", "measure", "analytic", "bench_model_config"]
