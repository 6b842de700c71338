"""Host syncs of eager generation (glm53.profiling.HostSyncs): a decode or verify step on a prefilled cache reads
nothing from the device; `generate` reads one value per token (emit.py: whether every row has finished).

Legend: P prompt positions, k-pool 4, index_topk 8 (the tiny config): a prompt of P = 41 puts the steps in the
sparse regime (more complete pools than index_topk), so the indexer really selects. What used to sync per step: the
sparse attention's key spans (one `.tolist()` per MLA layer; the generation path prefers the "static" backends,
kernels/sparse_static.py) and, where torch's grouped GEMM is not the fast path (a GPU off bf16 Hopper/Blackwell:
the padded form reads the busiest expert's load), one read per MoE layer (the path prefers "few_token",
kernels/moe.py). The compiled step reads nothing either: tests/generation/test_step.py traces it with
fullgraph=True, where a read would raise.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import GenerationCache, generate, step
from glm53.kernels import moe as moe_kernels
from glm53.model import moe as moe_module
from glm53.profiling import HostSyncs
from tests.helpers.generation import left_padded, tiny_model

P = 41


def _steps_syncs(model) -> tuple[HostSyncs, HostSyncs, HostSyncs]:
    """(prefill, one decode step, one verify step of 3 tokens) on a left-padded batch of two."""
    ids, mask = left_padded(model.config.vocab_size, [P, P - 6])
    with torch.inference_mode():
        cache = GenerationCache(model, max_length=P + 8)
        with HostSyncs() as prefill:
            step(model, cache, ids, mask.bool())
        with HostSyncs() as decode:
            step(model, cache, ids[:, -1:])
        cache.mark()
        with HostSyncs() as verify:
            step(model, cache, ids[:, :3])
        cache.rewind(1)
    return prefill, decode, verify


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "per-head"])
@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped-mm", "padded-experts"])
def test_decode_and_verify_steps_read_nothing(absorb, grouped_mm, monkeypatch):
    if not grouped_mm:  # what a GPU runs in fp32: the padded expert form, whose capacity is a host read
        monkeypatch.setattr(moe_kernels, "_grouped_mm_usable", lambda *a: False)
    model = tiny_model(random_weights=False)
    model.set_numerics(mla_absorb=absorb)
    prefill, decode, verify = _steps_syncs(model)
    assert decode.total == 0 and verify.total == 0, (decode.counts, verify.counts)
    # the counter sees what the prefill reads (so the zeros above are not a blind counter): the key spans of the one
    # MLA layer and its blocked top-k's pool horizons, once per call (2 "tolist"), its mask and pool checks (4
    # "item") and, without grouped GEMM, each of the 3 MoE layers' capacity
    assert dict(prefill.counts) == {"item": 4 + (0 if grouped_mm else 3), "tolist": 2}, prefill.counts


def test_few_token_experts_are_only_for_few_pairs(monkeypatch):
    """A verify step of more than FEW_TOKEN_PAIRS (token, expert) pairs takes the grouped form (it reads each expert
    once): with the padded form, one capacity read per MoE layer comes back."""
    monkeypatch.setattr(moe_kernels, "_grouped_mm_usable", lambda *a: False)
    monkeypatch.setattr(moe_module, "FEW_TOKEN_PAIRS", 2)  # the model's choice reads its own name
    _, decode, verify = _steps_syncs(tiny_model(random_weights=False))
    assert dict(decode.counts) == {"item": 3} and dict(verify.counts) == {"item": 3}  # B * T * k = 4, 12 > 2


def test_generate_reads_one_value_per_token():
    """Eager greedy generate: per extra token exactly one host read (the loop's stop test), whatever the layers."""
    model = tiny_model(random_weights=False)
    ids, mask = left_padded(model.config.vocab_size, [P, P - 6])
    totals = {}
    for n in (2, 6):
        with torch.no_grad(), HostSyncs() as syncs:
            generate(model, ids, attention_mask=mask, max_new_tokens=n, eos_token_id=[])
        totals[n] = syncs.counts
    extra = {kind: totals[6][kind] - totals[2].get(kind, 0) for kind in totals[6]}
    assert {kind: n for kind, n in extra.items() if n} == {"item": 4}, totals


def test_an_eager_decode_step_builds_no_autograd_node(monkeypatch):
    """Under inference mode the kernels' autograd Functions run their forwards alone (kernels/function.py): no
    `Function.apply` (~3.5 us each, ~100 per decode step on the bench config). The counter is not blind: the same
    forward with gradients on goes through apply."""
    calls = []
    original = torch.autograd.Function.apply.__func__

    def counting(cls, *args, **kwargs):
        calls.append(cls.__name__)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counting))
    model = tiny_model(random_weights=False)
    ids, mask = left_padded(model.config.vocab_size, [P, P - 6])
    with torch.inference_mode():
        cache = GenerationCache(model, max_length=P + 8)
        step(model, cache, ids, mask.bool())
        step(model, cache, ids[:, -1:])
    assert calls == []
    model.model(ids[:, :8])  # gradients on: the same kernels through their nodes
    assert {"_Sinkhorn", "_RmsNorm", "_HcMix"} <= set(calls), sorted(set(calls))
