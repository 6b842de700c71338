"""The model's head + loss through the chunked `linear_cross_entropy` kernel (main head and every MTP depth).

Parity with the plain path (the kernel's "reference" backend: full logits) and with the loss as computed before
the chunked path (`causal_lm_loss(lm_head(hidden), ...)`): value and every gradient (parameters, the final hidden
state, each MTP depth's normed hidden state), fp32 and bf16, padding + ignored labels, packed documents and
global-batch denominators; `return_logits=False`; and that nothing [M, vocab] is built on the chunked path.
Logits blocks are forced to a few tokens (`small_chunks`) so every forward runs several chunks, the last short.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import glm53.kernels.linear_cross_entropy as lce
from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels import dispatch, use_backend
from glm53.losses import IGNORE_INDEX, causal_lm_loss
from glm53.model.inputs import packing_fields
from glm53.model.mtp import mtp_labels
from glm53.model.packing import document_labels

B, T, VOCAB = 2, 13, 320
CHUNK_TOKENS = 5  # rows per forced logits block: 26 tokens -> 6 chunks, the last of 1 token
DEPTH = 2
FP32_TOL = dict(rtol=1e-5, atol=1e-7)
GRAD_FLOOR = 1e-4
# fp32 gradients, chunked vs plain head: the only difference is how the GEMMs behind each token's hidden-state
# gradient (dlogits[m] @ W, a dot product of length VOCAB) and the head's weight gradient are blocked, so each
# gradient entry can differ by the worst-case rounding of a length-VOCAB fp32 sum, VOCAB * eps(fp32) = 3.8e-5
# relative to the largest entry; every later gradient is that hidden-state gradient times the same weights
GRAD_REL_FP32 = VOCAB * torch.finfo(torch.float32).eps
BF16_REL = 2e-2  # bf16: the head's weight gradient is summed per chunk in bf16 (the kernel's choice; ~5e-3 seen)


def make_model(dtype: torch.dtype = torch.float32) -> Glm53ForCausalLM:
    torch.manual_seed(0)
    config = Glm53Config.tiny(num_nextn_predict_layers=1, mtp_depth=DEPTH, indexer_loss_weight=1.0)
    return Glm53ForCausalLM(config).to_dtype(dtype)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(lce, "LOGITS_BUDGET_BYTES", CHUNK_TOKENS * 4 * VOCAB)
    assert lce.default_chunk(VOCAB) == CHUNK_TOKENS


def make_inputs(kind: str, model: Glm53ForCausalLM) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    labels = ids.clone()
    labels[0, 4] = labels[1, 9] = IGNORE_INDEX  # ignored labels inside the rows
    inputs = dict(input_ids=ids, labels=labels)
    if kind == "padded":
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, :3] = 0  # left padding
        inputs.update(attention_mask=mask, labels=labels.masked_fill(mask == 0, IGNORE_INDEX))
    elif kind == "packed":
        inputs["position_ids"] = torch.tensor([list(range(6)) + list(range(7)), list(range(9)) + list(range(4))])
    elif kind == "denominators":  # this batch as one of two equal micro-batches of a global batch
        counts = model.loss_counts(labels)
        inputs["loss_denominators"] = counts + counts
    return inputs


def run(model: Glm53ForCausalLM, inputs: dict, backend: str, return_logits: bool) -> dict:
    """Forward + backward of `.loss`; the loss parts, parameter gradients and hidden-state gradients."""
    model.zero_grad(set_to_none=True)
    mtp_hidden: list[torch.Tensor] = []

    def keep(_module, _args, outputs):
        for h, _, _ in outputs:
            h.retain_grad()
            mtp_hidden.append(h)

    handle = model.mtp.register_forward_hook(keep)
    try:
        with use_backend(backend, ["linear_cross_entropy"]):
            out = model(**inputs, return_logits=return_logits)
            out.last_hidden_state.retain_grad()
            out.loss.backward()
    finally:
        handle.remove()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["hidden"] = out.last_hidden_state.grad.float()
    grads.update({f"mtp_hidden_{d}": h.grad.float() for d, h in enumerate(mtp_hidden, start=1)})
    parts = {n: getattr(out, n).detach() for n in ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss")}
    return dict(out=out, parts=parts, grads=grads, mtp_hidden=[h.detach() for h in mtp_hidden])


def todays_losses(model: Glm53ForCausalLM, res: dict, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """lm and MTP losses as the model computed them before the chunked path: causal_lm_loss over lm_head logits."""
    labels, den = inputs["labels"], inputs.get("loss_denominators")
    segments = None
    if "position_ids" in inputs:
        segments = packing_fields(torch.ones(B, T, dtype=torch.bool), None, inputs["position_ids"])["segment_ids"]

    def depth_labels(d):
        if segments is not None:
            return document_labels(labels, segments, d, IGNORE_INDEX)
        return labels if d == 0 else mtp_labels(labels, d, IGNORE_INDEX)

    def count(d):
        return None if den is None else den.targets[d]

    with torch.no_grad():
        lm = causal_lm_loss(model.lm_head(res["out"].last_hidden_state), depth_labels(0), count(0))
        mtp = [causal_lm_loss(model.lm_head(h), depth_labels(d), count(d)) for d, h in enumerate(res["mtp_hidden"], 1)]
    return lm, torch.stack(mtp).mean()


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def grad_errors(got: dict, want: dict) -> dict:
    """Each gradient's error relative to its largest entry, floored at GRAD_FLOOR x the largest gradient entry of the
    model (tests/parallel/test_parallel_gloo.py: tiny cancelling gradients such as mHC `scale` carry rounding of
    their terms' size in any two fp32 runs that add in a different order)."""
    floor = GRAD_FLOOR * max(g.abs().max().item() for g in want.values())
    return {n: rel_err(g, want[n], floor) for n, g in got.items()}


@pytest.mark.parametrize("kind", ["padded", "packed", "denominators"])
def test_chunked_loss_equals_plain_fp32(small_chunks, kind):
    model = make_model()
    inputs = make_inputs(kind, model)
    fast = run(model, inputs, "fast", return_logits=False)
    plain = run(model, inputs, "reference", return_logits=True)
    assert fast["out"].logits is None and plain["out"].logits.shape == (B, T, VOCAB)
    for name, value in plain["parts"].items():
        torch.testing.assert_close(fast["parts"][name], value, **FP32_TOL, msg=name)
    lm, mtp = todays_losses(model, fast, inputs)
    torch.testing.assert_close(fast["parts"]["lm_loss"], lm, **FP32_TOL)
    torch.testing.assert_close(fast["parts"]["mtp_loss"], mtp, **FP32_TOL)
    assert set(fast["grads"]) == set(plain["grads"])
    assert {"hidden", "mtp_hidden_1", "mtp_hidden_2"} <= set(fast["grads"])
    assert fast["grads"]["lm_head.weight"].abs().max() > 0
    bad = grad_errors(fast["grads"], plain["grads"])
    assert max(bad.values()) <= GRAD_REL_FP32, {n: e for n, e in bad.items() if e > GRAD_REL_FP32}


def test_chunked_loss_equals_plain_bf16(small_chunks):
    model = make_model(torch.bfloat16)
    inputs = make_inputs("padded", model)
    fast = run(model, inputs, "fast", return_logits=False)
    plain = run(model, inputs, "reference", return_logits=True)
    assert fast["parts"]["lm_loss"].dtype == torch.float32  # the softmax runs in fp32, as causal_lm_loss's
    for name, value in plain["parts"].items():
        assert rel_err(fast["parts"][name], value) <= 1e-5, name
    lm, mtp = todays_losses(model, fast, inputs)
    assert rel_err(fast["parts"]["lm_loss"], lm) <= 1e-5 and rel_err(fast["parts"]["mtp_loss"], mtp) <= 1e-5
    bad = grad_errors(fast["grads"], plain["grads"])
    # the head's weight gradient is rounded to bf16 once per chunk (a few ulps); every other gradient reaches the
    # model through the per-token hidden-state gradient, which no chunk boundary changes
    assert bad.pop("lm_head.weight") <= BF16_REL
    assert max(bad.values()) <= 1e-3, {n: e for n, e in bad.items() if e > 1e-3}


def test_return_logits_false_gives_none_and_the_same_losses(small_chunks):
    model = make_model()
    inputs = make_inputs("padded", model)
    with_logits = run(model, inputs, "fast", return_logits=True)
    without = run(model, inputs, "fast", return_logits=False)
    assert without["out"].logits is None and with_logits["out"].logits.shape == (B, T, VOCAB)
    for name, value in with_logits["parts"].items():
        assert torch.equal(without["parts"][name], value), name
    for name, g in with_logits["grads"].items():
        assert torch.equal(without["grads"][name], g), name
    model.eval()
    out = model(inputs["input_ids"], return_logits=False)  # inference without labels: hidden states only
    assert out.logits is None and out.loss is None and out.last_hidden_state.shape == (B, T, model.config.hidden_size)
    torch.testing.assert_close(model(inputs["input_ids"]).logits, model.lm_head(out.last_hidden_state))
    with pytest.raises(TypeError, match="return_logits"):
        model(inputs["input_ids"], return_logits="no")


class LargestVocabBlock(TorchDispatchMode):
    """Records the largest row count of any new tensor (views such as weight.t() excluded) whose last dimension
    is the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB:
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


def test_training_forward_never_builds_full_logits(small_chunks, monkeypatch):
    """With return_logits=False no op output holds more than CHUNK_TOKENS rows over the vocabulary, forward or
    backward, and the loss goes through the kernel once per head (main + each MTP depth), never through lm_head."""
    model = make_model()
    inputs = make_inputs("packed", model)
    calls, head_calls = [], []
    original = lce.linear_cross_entropy
    model.lm_head.register_forward_hook(lambda *_: head_calls.append(1))

    def counting(hidden, weight, targets, chunk=None):
        calls.append(hidden.shape[0])
        return original(hidden, weight, targets, chunk)

    monkeypatch.setitem(dispatch._REGISTRY["linear_cross_entropy"], "fast", counting)  # restored after the test
    with LargestVocabBlock() as seen:
        model(**inputs, return_logits=False).loss.backward()
    assert calls == [B * T] * (1 + DEPTH) and not head_calls
    assert 0 < seen.rows <= CHUNK_TOKENS, seen.rows
    with LargestVocabBlock() as plain:  # the same probe sees the plain path's full logits
        with use_backend("reference", ["linear_cross_entropy"]):
            model(**inputs, return_logits=False).loss.backward()
    assert plain.rows >= B * T
