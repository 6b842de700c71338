"""torch.compile of whole decoder blocks (fullgraph=True: a graph break fails the test), forward and backward,
equal to eager. Kernels with data-dependent control flow are custom ops (glm53/kernels/opaque.py).

The "aot_eager" backend runs dynamo + AOT autograd (tracing, fake tensors, the joint graph) without generating
C++, so the test checks traceability in seconds; inductor compiles the same graphs.
"""

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.model.context import ForwardContext

# The per-head sparse attention (custom op) instead of the absorbed one. The default block kinds (KDA + dense and
# + MoE: chunk kernel, causal convs, mHC, router, grouped experts; MLA + MoE: indexer, absorbed sparse attention;
# the MTP layer) compile the same way, fullgraph, forward and every gradient against eager, in
# tests/compile/test_compile_parallel.py::test_compile_blocks_keeps_parameter_names_and_matches_eager_with_checkpointing
# (one compile of each kind serves both checks: each costs seconds of tracing).
BLOCKS = {"MLA-per-head-MoE": (3, False)}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Glm53ForCausalLM(Glm53Config.tiny())
    for p in m.parameters():  # random weights: default inits hide bugs
        torch.nn.init.normal_(p, std=0.2)
    return m


@pytest.mark.parametrize("index", BLOCKS.values(), ids=BLOCKS.keys())
def test_block_compiles_fullgraph_and_matches_eager(model, index):
    index, absorb = index
    torch._dynamo.reset()
    model.set_numerics(mla_absorb=absorb)
    block = model.model.layers[index]
    g = torch.Generator().manual_seed(index)
    streams = torch.randn(2, 21, model.config.hc_mult, model.config.hidden_size, generator=g)
    valid = torch.ones(2, 21, dtype=torch.bool)
    valid[1, :5] = False
    cot = torch.randn(streams.shape, generator=g)

    def run(fn):
        x = streams.clone().requires_grad_()
        out, _ = fn(x, ForwardContext(valid=valid))
        grads = torch.autograd.grad((out * cot).sum(), [x, *block.parameters()], allow_unused=True)
        return out, grads

    ref_out, ref_grads = run(block)
    out, grads = run(torch.compile(block, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for g_c, g_e in zip(grads, ref_grads):
        if g_e is not None:
            torch.testing.assert_close(g_c, g_e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_select_pools_custom_op_fake_and_schema(model, packed):
    """The indexer's pool choice (glm53::select_pools): torch.library.opcheck runs the op against its fake
    implementation (output shapes and dtypes), its schema and dispatch; the pool axis keeps pool 4, incomplete in
    every row, which the op never picks."""
    from glm53.model.indexer import kept_pools, select_pools

    ind = model.model.layers[3].self_attn.indexer
    valid = torch.ones(2, 19, dtype=torch.bool)
    valid[1, :4] = False
    cu = torch.tensor([0, 9, 19, 38]) if packed else None
    positions, complete = kept_pools(valid, ind.kpool, cu)
    scores = torch.randn(2, 19, positions.shape[1], generator=torch.Generator().manual_seed(0))
    args = (scores, positions, complete, valid, cu, 0, ind.index_topk, ind.kpool, ind.select_tail)
    torch.library.opcheck(select_pools, args, test_utils=("test_schema", "test_faketensor"))
    topk, candidate, selected = select_pools(*args)
    assert topk.shape == (2, 19, ind.num_slots) and candidate.shape == selected.shape == scores.shape
    dropped = ~complete.any(0)
    assert dropped.any() and not candidate[..., dropped].any() and not selected[..., dropped].any()


def test_compile_blocks_on_packed_documents_matches_eager():
    """Packed documents (cu_seqlens) through every block kind compiled without a graph break (KDA + dense,
    MLA + MoE, the MTP layer; the packed conv and indexer scores are custom ops, the packed pool count a size from
    the shapes), with every loss part (MTP, indexer KL, balance, z-loss): loss parts and all gradients equal
    eager."""

    import copy

    from torch._dynamo.utils import counters

    from glm53.model.compile import compile_blocks

    torch.manual_seed(0)
    config = Glm53Config.tiny(
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse"],
        router_z_loss_coef=1e-2,
        num_nextn_predict_layers=1,
        indexer_loss_weight=0.5,
    )
    eager = Glm53ForCausalLM(config)
    with torch.no_grad():
        for p in eager.parameters():
            p.normal_(std=0.2)
    ids = torch.randint(1, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 7, 19, 30, 38])  # documents of 7 + 12 and 11 + 8 tokens: 12 > index_topk, sparse
    torch._dynamo.reset()
    counters.clear()
    # fullgraph=False, breaks counted: under fullgraph=True dynamo would accept a data-dependent size silently
    compiled = compile_blocks(copy.deepcopy(eager), backend="aot_eager", fullgraph=False)
    runs = []
    for m in (eager, compiled):
        out = m(ids, labels=ids, cu_seqlens=cu)
        parts = [out.loss, out.lm_loss, out.mtp_loss, out.aux_loss, out.indexer_loss]
        runs.append((parts, torch.autograd.grad(out.loss, list(m.parameters()), allow_unused=True)))
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]  # KDA, MLA, MTP
    assert runs[0][0][4] > 0  # the indexer KL is on
    for got, ref in zip(runs[1][0], runs[0][0]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for got, ref in zip(runs[1][1], runs[0][1], strict=True):
        assert (got is None) == (ref is None)
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_compiled_block_is_not_recompiled_when_an_eager_call_logs_a_kernel_choice(model):
    """dispatch.kernel logs each backend choice once, on an eager call: the graph must not guard on that log (an
    eager call between two compiled steps would recompile every block, inside a benchmark's timed steps)."""
    from glm53.kernels import dispatch

    torch._dynamo.reset()
    block = model.model.layers[1]
    streams = torch.randn(1, 9, model.config.hc_mult, model.config.hidden_size)
    ctx = ForwardContext(valid=torch.ones(1, 9, dtype=torch.bool))
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    dispatch._LOGGED.clear()
    first, _ = compiled(streams, ctx)
    dispatch.kernel("kda")  # an eager call logs its choice now
    assert ("kda", dispatch.chosen_backend("kda")) in dispatch._LOGGED
    with torch.compiler.set_stance("fail_on_recompile"):
        again, _ = compiled(streams, ctx)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
