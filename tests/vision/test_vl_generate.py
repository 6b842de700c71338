"""`generate` with images and videos: greedy equals transformers' greedy generate (dense regime: prompt + new
tokens <= index_topk, where transformers' cached generation equals its own forward) and glm53's own full-forward
greedy decode (sparse regime); the tower runs once, at prefill."""

from __future__ import annotations

import torch

from tests.helpers.vision import hf_vl_model, our_vl_model, text_config, vl_batch

NEW = 6
ROWS = [[1, 2, ("image", 4, 6), 3, 4], [5, ("video", 2, 2, 4), 6, ("image", 2, 2), 8]]


def count_tower_calls(model) -> list:
    calls = []
    model.visual.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_greedy_equals_transformers_and_the_tower_runs_once():
    hf = hf_vl_model(text_config(index_topk=64), seed=3)
    ours = our_vl_model(hf)
    batch = vl_batch(ROWS)  # left-padded
    assert batch["input_ids"].shape[1] + NEW <= 64
    ref = hf.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    calls = count_tower_calls(ours)
    got = ours.generate(
        batch["input_ids"],
        batch["attention_mask"],
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
        pixel_values_videos=batch["pixel_values_videos"],
        video_grid_thw=batch["video_grid_thw"],
        max_new_tokens=NEW,
    )
    assert got.shape == ref.shape == (2, batch["input_ids"].shape[1] + NEW)
    assert torch.equal(got, ref)
    assert len(calls) == 1


def test_greedy_equals_full_forward_decode_in_the_sparse_regime():
    ours = our_vl_model(hf_vl_model(text_config(), seed=4))
    batch = vl_batch(ROWS)
    assert batch["input_ids"].shape[1] > ours.config.index_topk  # sparse regime
    vision = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    got = ours.generate(batch["input_ids"], batch["attention_mask"], **vision, max_new_tokens=3)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        for _ in range(3):
            nxt = ours(ids, mask, **vision).logits[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    assert torch.equal(got, ids)
