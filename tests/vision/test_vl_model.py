"""Glm53ForConditionalGeneration == transformers' Glm5NextForConditionalGeneration: logits, loss and every
gradient (text and vision) on batches with images and videos in different rows, left / right padding, KDA and
indexed layers, dense and sparse regimes; packed VL documents == each alone; text-only batches unchanged."""

from __future__ import annotations

import re

import pytest
import torch

from glm53 import Glm53ForCausalLM, Glm53ForConditionalGeneration
from glm53.checkpoint.convert import from_transformers_state_dict
from glm53.errors import ConfigError, InputError
from glm53.vision import with_vision
from tests.helpers.vision import TOKENS, TOWER, hf_vl_model, our_vl_model, randomize_parameters, text_config, vl_batch

# The text model's whole-model bounds (tests/model/test_model_parity.py, test_grad_parity.py): relative 1e-4 on
# logits and 5e-4 (L2) per gradient, the KDA chunked rounding amplified through four layers; the tower adds
# its own ~4e-5 (tests/vision/test_tower.py), well inside.
LOGITS_REL = 1e-4
GRAD_REL = 5e-4
ROWS = [[1, 2, ("image", 4, 6), 3, 4, 9, 10, 11], [5, ("video", 2, 2, 4), 6, ("image", 2, 2), 8]]


def labels_for(batch):
    """-100 at padding, placeholders and each row's first real token (the padding position before it predicts
    it from a padding query, where glm53's and transformers' sparse attention legitimately differ:
    tests/model/test_grad_parity.py)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    first = mask.long().argmax(-1)
    labels[torch.arange(ids.shape[0]), first] = -100
    return labels.masked_fill(labels == TOKENS["image_token_id"], -100)


def right_padded(batch):
    """The same rows right-padded (the tokens moved to the front of each row)."""
    out = dict(batch)
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        ids[b] = torch.cat([ids[b, -n:], ids[b, :-n]]) if n < ids.shape[1] else ids[b]
        mask[b] = torch.cat([mask[b, -n:], mask[b, :-n]]) if n < ids.shape[1] else mask[b]
    out["input_ids"], out["attention_mask"] = ids, mask
    return out


@pytest.fixture(scope="module")
def sparse_pair():
    # 16 indexer heads: tie-free scores, so transformers' torch.topk order and glm53's one tie rule (ties to the
    # earliest pool, tests/model/test_indexer.py) pick the same pools (tests/model/test_model_parity.py)
    hf = hf_vl_model(text_config(index_n_heads=16), seed=1)
    return hf, our_vl_model(hf)


@pytest.fixture(scope="module")
def dense_pair():
    hf = hf_vl_model(text_config(index_topk=64), seed=2)
    return hf, our_vl_model(hf)


def assert_logits_close(got, ref, mask):
    valid = mask.bool()
    err = (got - ref)[valid].abs().max().item()
    assert err <= LOGITS_REL * ref[valid].abs().max().item(), err


@pytest.mark.parametrize("regime", ["sparse", "dense"])
def test_logits_and_loss_match_transformers(request, regime):
    """Left padding in the dense regime (index_topk 64 >= T), right padding in the sparse one (index_topk 8 < T)."""
    hf, ours = request.getfixturevalue(f"{regime}_pair")
    batch = vl_batch(ROWS)
    batch = right_padded(batch) if ours.config.index_topk < batch["input_ids"].shape[1] else batch
    labels = labels_for(batch)
    with torch.no_grad():
        ref = hf(**batch, labels=labels)
        got = ours(**batch, labels=labels)
    assert_logits_close(got.logits, ref.logits, batch["attention_mask"])
    torch.testing.assert_close(got.lm_loss, ref.loss, rtol=1e-5, atol=0)
    lean = ours(**batch, labels=labels, return_logits=False)
    assert lean.logits is None and torch.equal(lean.loss, got.loss)


def grads_against_transformers(hf, ours, batch) -> None:
    """Every gradient of lm_loss (text, tower, projector) within GRAD_REL of transformers'; the tower's all reached."""
    labels = labels_for(batch)
    hf.zero_grad()
    ours.zero_grad()
    hf(**batch, labels=labels).loss.backward()
    ours(**batch, labels=labels).lm_loss.backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in hf.named_parameters()}
    want = from_transformers_state_dict(grads, vision=True)
    got = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ours.named_parameters()}
    assert set(got) == set(want)
    vision = [n for n in got if n.startswith("visual.")]
    assert len(vision) == 2 * 14 + 11  # every tower tensor: 14 per block, patch embed, post norm, projector
    for name in got:
        ref = want[name]
        if ref.abs().max() == 0:
            assert got[name].abs().max() == 0, name
            continue
        err = ((got[name] - ref).norm() / ref.norm()).item()
        assert err < GRAD_REL, f"{name}: {err:.2e}"
    assert all(want[n].abs().max() > 0 for n in vision)


def test_every_gradient_matches_transformers(dense_pair):
    hf, ours = dense_pair
    grads_against_transformers(hf, ours, vl_batch(ROWS, seed=4))


def topk_margins(model, batch) -> list[float]:
    """Per valid query that chooses among more candidate pools than it keeps (the sparse regime), the gap between
    its last kept and first dropped pool score, relative to the largest |score| of its indexer (glm53's scores)."""
    from glm53.model.indexer import Indexer

    calls = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: calls.append((mod, args)))
        for m in model.modules()
        if isinstance(m, Indexer)
    ]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    margins = []
    for mod, (x, q_resid, valid, *_) in calls:
        _, scores, candidate, selected = mod.score_and_select(x, q_resid, valid)
        scale = scores.abs().max()
        for b, t in valid.nonzero().tolist():
            c = candidate[b, t].bool()
            k = int((selected[b, t].bool() & c).sum())
            if c.sum() > k > 0:
                ranked = scores[b, t][c].sort(descending=True).values
                margins.append(((ranked[k - 1] - ranked[k]) / scale).item())
    return margins


# The sparse regime's selection is discontinuous in the inputs: the two models' gradients agree only where the
# tower's and text model's rounding differences (<= LOGITS_REL relative, as the logits) cannot change which pools a
# query keeps. Every sparse query's top-k margin is asserted >= 20 x LOGITS_REL of the score scale (measured 1.3e-2
# on this batch); there the dense regime's bound GRAD_REL holds unchanged.
MIN_TOPK_MARGIN = 20 * LOGITS_REL


def test_every_gradient_matches_transformers_in_the_sparse_regime(sparse_pair):
    """Right padding (index_topk 8 < T, as the sparse logits test): every text, tower and projector gradient;
    16 indexer heads keep the ReLU scores off exact ties (sparse_pair)."""
    hf, ours = sparse_pair
    batch = right_padded(vl_batch(ROWS, seed=4))
    margins = topk_margins(ours, batch)
    assert len(margins) >= 8, "the batch must be in the sparse regime"  # queries choosing 2 of up to 4 pools
    assert min(margins) >= MIN_TOPK_MARGIN, min(margins)
    grads_against_transformers(hf, ours, batch)


def test_text_only_batch_is_the_text_model(dense_pair):
    _, ours = dense_pair
    text = Glm53ForCausalLM(ours.config).eval()
    text.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("visual.")})
    ids = torch.randint(1, 290, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids, labels=ids), text(ids, labels=ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)


def test_packed_vl_documents_equal_each_alone(dense_pair):
    _, ours = dense_pair
    docs = [vl_batch([ROWS[0]], seed=0), vl_batch([ROWS[1]], seed=1)]
    ids = torch.cat([d["input_ids"] for d in docs], dim=1)
    lengths = [d["input_ids"].shape[1] for d in docs]
    packed = dict(input_ids=ids, pixel_values=docs[0]["pixel_values"], image_grid_thw=docs[0]["image_grid_thw"])
    packed["pixel_values"] = torch.cat([docs[0]["pixel_values"], docs[1]["pixel_values"]])
    packed["image_grid_thw"] = torch.cat([docs[0]["image_grid_thw"], docs[1]["image_grid_thw"]])
    packed["pixel_values_videos"], packed["video_grid_thw"] = docs[1]["pixel_values_videos"], docs[1]["video_grid_thw"]
    cu = torch.tensor([0, lengths[0], sum(lengths)])
    labels = labels_for(dict(input_ids=ids, attention_mask=torch.ones_like(ids)))
    with torch.no_grad():
        together = ours(**packed, cu_seqlens=cu, labels=labels)
        alone = [ours(**{k: v for k, v in d.items() if k != "attention_mask"}) for d in docs]
    assert_logits_close(together.logits[0, : lengths[0]], alone[0].logits[0], torch.ones(lengths[0]))
    assert_logits_close(together.logits[0, lengths[0] :], alone[1].logits[0], torch.ones(lengths[1]))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        by_positions = ours(**packed, position_ids=pos, labels=labels)
    torch.testing.assert_close(by_positions.loss, together.loss)


def test_training_losses_reach_the_tower():
    """MTP, indexer KL and balance run on the spliced embeddings, and the tower trains through them."""
    config = with_vision(text_config(num_nextn_predict_layers=1, indexer_loss_weight=0.5), TOWER, TOKENS)
    ours = Glm53ForConditionalGeneration.from_config(config).train()
    randomize_parameters(ours.visual)
    batch = vl_batch(ROWS)
    out = ours(**batch, labels=labels_for(batch))
    assert out.mtp_loss is not None and out.indexer_loss is not None and out.aux_loss is not None
    out.mtp_loss.backward()
    assert ours.visual.merger.down_proj.weight.grad.abs().max() > 0


def test_dummy_tower_forward_on_a_text_only_batch(dense_pair):
    """With always_run_tower (set under FSDP) a text-only batch still touches every tower parameter, with zero
    weight: the outputs are bit-identical and the tower's gradients exist and are zero."""
    _, ours = dense_pair
    ids = torch.randint(1, 290, (2, 9), generator=torch.Generator().manual_seed(1))
    ours.zero_grad(set_to_none=True)
    plain = ours(ids, labels=ids)
    ours.always_run_tower = True
    try:
        dummy = ours(ids, labels=ids)
        dummy.loss.backward()
    finally:
        ours.always_run_tower = False
    assert torch.equal(plain.logits, dummy.logits) and torch.equal(plain.loss, dummy.loss)
    for name, p in ours.visual.named_parameters():
        assert p.grad is not None and p.grad.abs().max() == 0, name
    assert ours.model.embed_tokens.weight.grad.abs().max() > 0


def test_video_spans_decide_image_vs_video(dense_pair):
    """Swapping which inputs carry the images and the videos is caught by the counts; an unterminated video span
    turns the later image placeholders into video ones."""
    _, ours = dense_pair
    batch = vl_batch(ROWS)
    swapped = dict(
        batch,
        pixel_values=batch["pixel_values_videos"],
        image_grid_thw=batch["video_grid_thw"],
        pixel_values_videos=batch["pixel_values"],
        video_grid_thw=batch["image_grid_thw"],
    )
    with pytest.raises(
        InputError,
        match=re.escape("input_ids hold 7 image placeholder tokens but pixel_values give 4 image feature rows"),
    ):
        ours(**swapped)
    from glm53.vision.splice import placeholder_masks

    ids = torch.tensor([[300, 304, 300, 305, 300, 304, 300, 300]])
    image, video = placeholder_masks(ids, ours.token_ids)
    assert image.tolist() == [[True, False, False, False, True, False, False, False]]
    assert video.tolist() == [[False, False, True, False, False, False, True, True]]


BAD = {
    "count-mismatch": (
        lambda b: dict(b, input_ids=b["input_ids"].masked_fill((b["input_ids"] == 300).cumsum(-1) == 1, 9)),
        InputError,
        "input_ids hold 6 image placeholder tokens but pixel_values give 7 image feature rows",
    ),  # row 0 lost one
    "grid-without-pixels": (
        lambda b: dict(b, pixel_values=None),
        InputError,
        "image_grid_thw was given without its pixels (pixel_values)",
    ),
    "pixels-without-grid": (
        lambda b: dict(b, image_grid_thw=None),
        InputError,
        "pixel_values was given without image_grid_thw",
    ),
    "placeholders-without-pixels": (
        lambda b: dict(b, pixel_values=None, image_grid_thw=None),
        InputError,
        "input_ids hold 7 image placeholder tokens but pixel_values give 0",
    ),
    "rows-vs-grid": (
        lambda b: dict(b, pixel_values=b["pixel_values"][:-1]),
        InputError,
        "pixel_values has 27 rows but image_grid_thw describes 28 patches",
    ),
    "merge-size": (
        lambda b: dict(b, video_grid_thw=torch.tensor([[2, 1, 8]])),
        InputError,
        "video_grid_thw[0] = (2, 1, 8): h and w must be divisible by spatial_merge_size 2",
    ),
    "embeds-with-pixels": (
        lambda b: dict(b, inputs_embeds=torch.zeros(2, 3, 36), input_ids=None),
        InputError,
        "pass input_ids (not inputs_embeds) with pixel_values",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_inputs_name_the_counts(dense_pair, case):
    _, ours = dense_pair
    make, error, message = BAD[case]
    with pytest.raises(error, match=re.escape(message)):
        ours(**make(vl_batch(ROWS)))


def test_a_text_only_config_has_no_vl_model():
    with pytest.raises(ConfigError, match="config has no vision_config"):
        Glm53ForConditionalGeneration(text_config())
