"""Training the VL model on packed VL rows: the packed loss is the records' own, loss goes down, frozen groups
get no gradient and no optimizer state."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from glm53.training.data.vl_pack import make_batch
from glm53.training.vl_finetune import VLFileData, apply_freeze, model_inputs
from tests.helpers.vl_data import (
    save_tokenizer,
    tiny_vl_model,
    vl_corpus,
    vl_tokenizer,
    write_jsonl,
)


def _args(data: str, root: str, **overrides) -> argparse.Namespace:
    base = dict(
        data=data,
        media_root=root,
        batch_size=2,
        grad_accum=1,
        seq_len=96,
        seed=0,
        strict=False,
        image_min_tokens=16,
        image_max_tokens=64,
        video_max_tokens=64,
        freeze=None,
    )
    return argparse.Namespace(**{**base, **overrides})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vltrain")
    tok = vl_tokenizer()
    tok_dir = save_tokenizer(tok, str(tmp / "tok"))
    data = write_jsonl(str(tmp / "vl.jsonl"), vl_corpus(str(tmp / "media")))
    return tok, tok_dir, data, str(tmp / "media")


def test_packed_loss_equals_records_alone(setup):
    """Two VL records in one row (document segments) vs each in its own row: the same loss (the tower sees each
    image alone either way; the text model separates packed documents). fp32, 4 layers: 1e-5 relative."""
    tok, tok_dir, data, root = setup
    model = tiny_vl_model(tok).eval()
    fd = VLFileData(_args(data, root, seq_len=200), tok_dir, model, 1, 0)
    vl = [d for d in fd.docs if d.media][:2]
    packer = fd.packer

    def rows_of(docs, width):
        packer.docs, packer.order, packer.index, packer.offset = docs, list(range(len(docs))), 0, 0
        packer.seq_len = width
        (ids, labels, mask, pos), spans = packer.vl_row()
        pad = total - width  # padding after the document: attention_mask 0, no targets
        return (ids + [0] * pad, labels + [-100] * pad, mask + [0] * pad, pos + list(range(pad))), spans

    total = len(vl[0].ids) + len(vl[1].ids)
    packed = make_batch([rows_of(vl, total)], fd.encoder)
    assert [len(s) for s in packed.spans] == [len(vl[0].media) + len(vl[1].media)]  # both records in the row
    separate = make_batch([rows_of([d], len(d.ids)) for d in vl], fd.encoder)
    a, b = model_inputs(model, packed), model_inputs(model, separate)
    den = model.loss_counts(a["labels"], a["attention_mask"], a["position_ids"])
    other = model.loss_counts(b["labels"], b["attention_mask"], b["position_ids"])
    assert all(torch.equal(getattr(den, f.name), getattr(other, f.name)) for f in dataclasses.fields(den))
    with torch.no_grad():
        la = model(**a, loss_denominators=den, return_logits=False).lm_loss
        lb = model(**b, loss_denominators=den, return_logits=False).lm_loss
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)


def test_steps_decrease_loss_and_freeze(setup):
    tok, tok_dir, data, root = setup
    model = tiny_vl_model(tok, seed=1).train()
    frozen = apply_freeze(model, None)  # the default: the vision tower
    tower = ("visual.patch_embed.", "visual.blocks.", "visual.post_layernorm.")
    assert frozen == [n for n, _ in model.named_parameters() if n.startswith(tower)] and frozen
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    fd = VLFileData(_args(data, root), tok_dir, model, 1, 0)
    losses = []
    for _ in range(12):
        (batch,) = fd.next_step()
        inputs = model_inputs(model, batch)
        opt.zero_grad(set_to_none=True)
        den = model.loss_counts(inputs["labels"], inputs["attention_mask"], inputs["position_ids"])
        loss = model(**inputs, loss_denominators=den, return_logits=False).loss
        loss.backward()
        for name, p in model.named_parameters():
            if name.startswith(("visual.patch_embed.", "visual.blocks.", "visual.post_layernorm.")):
                assert p.grad is None, name
        if "pixel_values" in inputs:
            assert model.visual.merger.proj.weight.grad.abs().sum() > 0  # the projector trains
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 * 0.9
    state_ids = {id(p) for p in opt.state}
    assert not any(id(p) in state_ids for n, p in model.named_parameters() if n.startswith("visual.blocks."))
    assert id(model.visual.merger.proj.weight) in state_ids


def test_resume_data_cursor_exact(setup):
    tok, tok_dir, data, root = setup
    model = tiny_vl_model(tok)
    a = VLFileData(_args(data, root), tok_dir, model, 1, 0)
    for _ in range(3):
        a.next_step()
    state = a.state_dict()
    after = [a.next_step()[0] for _ in range(3)]
    b = VLFileData(_args(data, root), tok_dir, model, 1, 0)
    b.load_state_dict(state, "run")
    again = [b.next_step()[0] for _ in range(3)]
    for x, y in zip(after, again):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        assert (x.pixel_values is None) == (y.pixel_values is None)
        if x.pixel_values is not None:
            assert torch.equal(x.pixel_values, y.pixel_values) and torch.equal(x.image_grid_thw, y.image_grid_thw)
