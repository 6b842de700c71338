"""The kernel dispatch (glm53/kernels/dispatch.py): logged once per choice at INFO, never while compiling, and
`use_backend` without ops forcing only the ops that have the backend.

use_backend given one op name as a string (not a list): a TypeError naming `ops`, not a KeyError about its
first letter; the forced choices are untouched. No tensors.
"""

from __future__ import annotations

import logging

import pytest
import torch

from glm53.kernels import dispatch
from glm53.kernels.dispatch import chosen_backend, kernel, use_backend


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(dispatch, "_LOGGED", set())


def test_each_choice_is_logged_once_at_info(fresh_log, caplog):
    with caplog.at_level(logging.INFO, logger="glm53.kernels"):
        for _ in range(3):
            kernel("sinkhorn")
        with use_backend("reference", ["sinkhorn"]):
            kernel("sinkhorn")
            kernel("sinkhorn")
        kernel("sinkhorn")
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "glm53.kernels"]
    assert messages == [
        (logging.INFO, "glm53 kernel sinkhorn: using the fast implementation"),
        (logging.INFO, "glm53 kernel sinkhorn: using the reference implementation"),
    ]


def test_compiled_call_neither_logs_nor_records(fresh_log, caplog):
    def f(x):
        return kernel("sinkhorn") is dispatch._REGISTRY["sinkhorn"]["fast"] and x + 1

    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="glm53.kernels"):
        out = torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2))
    assert torch.equal(out, torch.ones(2))
    assert dispatch._LOGGED == set() and not [r for r in caplog.records if r.name == "glm53.kernels"]


def test_use_backend_without_ops_forces_only_the_ops_that_have_it():
    with use_backend("chunk_reference"):
        assert chosen_backend("kda") == "chunk_reference" and chosen_backend("sinkhorn") == "fast"
    assert chosen_backend("kda") == "fast"


def test_use_backend_without_ops_rejects_a_backend_no_op_has():
    """A misspelt backend name forced nothing before (every kernel stayed "fast"): it raises, naming it."""
    with pytest.raises(ValueError, match=r"unknown backend 'refernce'.*'chunk_reference'.*'reference'"):
        with use_backend("refernce"):
            pass
    assert all(chosen_backend(op) == "fast" for op in dispatch.ops())


def test_unknown_op_error_lists_the_known_ops():
    with pytest.raises(KeyError, match=r"unknown kernel op 'no_such_op'; known: \[.*'sinkhorn'"):
        dispatch.backends("no_such_op")


def test_kernel_op_handles_follow_forcing_and_restore():
    """Model code holds kernel_op handles resolved once: set_backend / use_backend re-resolve them (every handle in
    glm53/model included), and leaving the scope restores the previous choice."""
    from glm53.kernels.dispatch import _HANDLES, _REGISTRY, kernel_op
    from glm53.model import hyper_connection, norm

    handle = kernel_op("sinkhorn")
    assert handle.fn is _REGISTRY["sinkhorn"]["fast"] and hyper_connection.sinkhorn.fn is _REGISTRY["sinkhorn"]["fast"]
    with use_backend("reference"):
        assert handle.fn is _REGISTRY["sinkhorn"]["reference"]
        assert hyper_connection.sinkhorn.fn is _REGISTRY["sinkhorn"]["reference"]
        assert norm.rms_norm.fn is _REGISTRY["rms_norm"]["reference"]
        x = torch.rand(2, 3, 3) + 0.1
        torch.testing.assert_close(handle(x, 4, 1e-6), _REGISTRY["sinkhorn"]["reference"](x, 4, 1e-6), rtol=0, atol=0)
    assert handle.fn is _REGISTRY["sinkhorn"]["fast"] and norm.rms_norm.fn is _REGISTRY["rms_norm"]["fast"]
    model_ops = {h.op for hs in _HANDLES.values() for h in hs}
    assert {"rms_norm", "kda", "sparse_attention", "moe_experts", "hc_mix", "indexer_scores"} <= model_ops
    with pytest.raises(KeyError, match="no_such_op"):
        kernel_op("no_such_op")


def test_a_preferred_backend_is_this_handle_s_default_and_forcing_still_wins():
    """kernel_op(op, prefer=...) (the generation path's "static" and "few_token" forms): that handle runs the
    preferred backend, other handles the default; use_backend reaches both and restores both; a per-device choice
    wins over the preference too; an unknown preference raises naming the op."""
    from glm53.kernels.moe import moe_experts_few_token, moe_experts_grouped, moe_experts_reference
    from glm53.model.moe import moe_experts
    from glm53.model.moe import moe_experts_few_token as handle

    assert handle.fn is moe_experts_few_token and moe_experts.fn is moe_experts_grouped
    assert "few_token" in repr(handle)
    with use_backend("reference", ["moe_experts"]):
        assert handle.fn is moe_experts_reference and moe_experts.fn is moe_experts_reference
    assert handle.fn is moe_experts_few_token and moe_experts.fn is moe_experts_grouped
    with dispatch.use_device_backend("moe_experts", "meta", "padded"):
        assert dispatch.resolve("moe_experts", "meta", "few_token") == "padded"
        assert dispatch.resolve("moe_experts", "cpu", "few_token") == "few_token"
    assert handle.fn is moe_experts_few_token
    with pytest.raises(ValueError, match="unknown backend 'nope' for kernel op 'moe_experts'"):
        dispatch.kernel_op("moe_experts", prefer="nope")


# ------------------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("ops", ["kda", "rms_norm", ""])
def test_ops_as_a_string(ops):
    before = chosen_backend("kda")
    with pytest.raises(TypeError, match=f"ops must be a list of op names or None, got the string {ops!r}"):
        with use_backend("reference", ops):
            pass
    assert chosen_backend("kda") == before
    with use_backend("reference", ["kda"]):
        assert chosen_backend("kda") == "reference"
