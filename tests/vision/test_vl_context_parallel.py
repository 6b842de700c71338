"""The VL model under context parallelism on gloo: every cp rank gets its slice of the whole rows and the pixels of
the images and videos its placeholders take from `context_parallel_inputs` (asserted: which pixels each rank's tower
ran on), runs the tower on them and splices its own feature rows. Against one process on the same rows: loss and every part (lm, MTP, balance, indexer
KL) on every rank, each rank's logits, every gradient (the tower's blocks, its merger and projector, the text
model), at cp2, dp2 x cp2 and cp2 x tp2 (the tower replicated over tp, the text model tensor-parallel).

The rows (T = 41, odd: cp pads one masked column; the slices are [0, 21) and [21, 42)): row 0 holds an image
whose 8 placeholders run across the slice boundary (15..22) and a second image wholly on rank 1; row 1 an image
on rank 0 (so rank 0's feature rows are not one contiguous run: row-major order over the whole batch) and a video
whose begin marker is on rank 0 and whose second temporal slice's placeholders are on rank 1 (a per-slice mask
would take them for an image's); the dp2 rows add an image on one dp rank only and a text-only row.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53ForConditionalGeneration
from glm53.parallel import context_parallel_inputs
from glm53.parallel.cp_inputs import PAIRS
from glm53.vision import with_vision
from glm53.vision.splice import media_for_slice, placeholder_masks, sliced_placeholders
from tests.helpers.vision import TOKENS, TOWER, randomize_parameters, text_config, vl_batch
from tests.helpers.vl_cp_jobs import VISION_KEYS, cp_vl_error_job, cp_vl_reference, cp_vl_step

# fp32 with other summation orders (a sliced sequence, FSDP's reduce over cp, the all-gathered MLA keys): eps 1.2e-7
# x the deepest reduction chain (~ 4 text layers + MTP + 2 tower blocks, each a few hundred-term sums, ~ 1e3 terms
# in all) ~ 1e-4 relative to each reference tensor's largest magnitude; as tests/parallel/test_context_parallel.py.
REL_TOL = 1e-4
T = 41


def _text(n: int, seed: int) -> list[int]:
    return torch.randint(1, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rows(items: list[list]) -> dict:
    """vl_batch of rows that are exactly T tokens (text fills the end of each)."""
    batch = vl_batch(items)
    assert batch["input_ids"].shape[1] == T and bool(batch["attention_mask"].all()), batch["input_ids"].shape
    return batch


ROW_IMAGE = [*_text(14, 1), ("image", 4, 8), *_text(4, 2), ("image", 2, 4), *_text(9, 3)]  # 14 + 10 + 4 + 4 + 9
ROW_VIDEO = [*_text(3, 9), ("image", 2, 4), *_text(8, 4), ("video", 2, 2, 4), *_text(14, 5)]  # 3 + 4 + 8 + 12 + 14
ROW_SMALL = [*_text(30, 6), ("image", 2, 4), *_text(7, 7)]
ROW_TEXT = _text(T, 8)


def _case(seed: int = 0):
    config = with_vision(
        text_config(
            num_nextn_predict_layers=1,
            indexer_loss_weight=1.0,
            router_aux_loss_coef=0.01,
            router_z_loss_coef=1e-3,
            index_topk=8,
        ),
        TOWER,
        TOKENS,
    )
    torch.manual_seed(seed)
    model = Glm53ForConditionalGeneration(config)
    randomize_parameters(model.visual, seed + 2)  # the tower's init leaves some parts near 0
    with torch.no_grad():
        for name, p in model.named_parameters():  # an indexer KL well away from 0
            if ".indexer." in name and p.dim() == 2:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(seed + 7))
    return config, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def case():
    config, state = _case()
    cp2 = [_rows([ROW_IMAGE, ROW_VIDEO])]
    dp2 = [cp2[0], _rows([ROW_SMALL, ROW_TEXT])]
    refs = {1: cp_vl_reference(config, state, cp2), 2: cp_vl_reference(config, state, dp2)}
    return dict(config=config, state=state, batches={1: cp2, 2: dp2}, refs=refs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def test_the_rows_cross_the_slice_boundary(case):
    """The case is the one described: a placeholder run across the boundary, a video whose marker is on rank 0."""
    ids = case["batches"][1][0]["input_ids"]
    images, videos = placeholder_masks(ids, Glm53ForConditionalGeneration(case["config"]).token_ids)
    assert images[0, 20] and images[0, 21] and images[1, :21].any() and not images[1, 21:].any()
    assert videos[1, 21:].any() and (ids[1, :21] == TOKENS["video_start_token_id"]).any()


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 1), (1, 2)], ids=["cp2", "dp2xcp2", "cp2xtp2"])
def test_vl_under_cp_matches_one_process(pool2, pool4, case, dp, tp):
    pool = pool2 if dp * tp == 1 else pool4
    batches = case["batches"][dp]
    results = pool.run(cp_vl_step, config=case["config"], state=case["state"], batches=batches, dp=dp, cp=2, tp=tp)
    ref = case["refs"][dp]
    assert {"lm_loss", "mtp_loss", "aux_loss", "indexer_loss"} <= set(ref["parts"])
    vision = [n for n in ref["grads"] if n.startswith("visual.")]
    assert len(vision) == 39 and any(".merger." in n for n in vision)
    for rank, r in enumerate(results):
        assert rel_err(r["loss"], ref["loss"]) <= REL_TOL, (rank, r["loss"], ref["loss"])
        assert set(r["parts"]) == set(ref["parts"])
        for name, value in r["parts"].items():
            assert rel_err(value, ref["parts"][name]) <= REL_TOL, (rank, name, value, ref["parts"][name])
        assert set(r["grads"]) == set(ref["grads"])
        bad = {n: rel_err(g, ref["grads"][n]) for n, g in r["grads"].items()}
        worst = sorted(bad.items(), key=lambda item: item[1])[-3:]
        assert max(bad.values()) <= REL_TOL, f"rank {rank}: gradients differ from one process: {worst}"
    pixels = batches[0]["pixel_values"]  # images: A (crossing, rows 0-31), B (rank 1, 32-39), C (row 1, rank 0)
    own = {0: torch.cat([pixels[:32], pixels[40:]]), 1: pixels[:40]}
    for r in results:  # each cp rank's tower ran on the images and the video its slice's placeholders take
        d, c = r["at"]
        if d == 0:
            assert torch.equal(r["media"]["pixel_values"], own[c]), r["at"]
            assert torch.equal(r["media"]["pixel_values_videos"], batches[0]["pixel_values_videos"])
        else:  # dp rank 1: its one image is on cp rank 1; cp rank 0 holds text only (the dummy tower run)
            assert set(r["media"]) == ({"pixel_values", "image_grid_thw"} if c == 1 else set()), r["at"]
    for r in results:  # each rank's slice of its dp rank's rows (the tp ranks of a slice hold the same)
        d, c = r["at"]
        expected = torch.nn.functional.pad(ref["logits"][2 * d : 2 * d + 2], (0, 0, 0, 1))[:, 21 * c : 21 * (c + 1)]
        assert rel_err(r["logits"][:, : 21 - c], expected[:, : 21 - c]) <= REL_TOL, r["at"]


def test_placeholder_count_error_is_the_one_process_error(pool2, case):
    """Placeholders that do not match the grids: every cp rank raises the one-process message (the whole
    batch's count), even the rank whose slice holds none of the missing ones."""
    bad = dict(case["batches"][1][0])
    bad["input_ids"] = bad["input_ids"].clone()
    bad["input_ids"][1, 35] = TOKENS["image_token_id"]  # one image placeholder more, on rank 1
    model = Glm53ForConditionalGeneration(case["config"])
    model.load_state_dict(case["state"])
    with pytest.raises(Exception) as one:
        model(**bad)
    messages = pool2.run(cp_vl_error_job, config=case["config"], state=case["state"], batch=bad)
    assert messages == [str(one.value)] * 2
    assert "input_ids hold 13 image placeholder tokens but pixel_values give 12" in messages[0]


def test_sliced_splice_equals_the_whole_splice(case):
    """One process, no ranks: at every cut (padding past T too) each slice's own images and videos
    (`media_for_slice`) through the tower, spliced at its placeholders, give the whole rows' embeddings."""
    model = Glm53ForConditionalGeneration(case["config"])
    model.load_state_dict(case["state"])
    batch = case["batches"][1][0]
    ids, merge = batch["input_ids"], model.vision_config.spatial_merge_size
    with torch.no_grad():
        whole = model.embed_multimodal(ids, *(batch[k] for k in VISION_KEYS))
        for cut in (1, 15, 16, 21, 22, 40):
            parts = []
            for columns in (slice(0, cut), slice(cut, T + 3)):
                media, placeholders = [], []
                for at, kind, (p, g) in zip(
                    sliced_placeholders(ids, model.token_ids, columns), ("image", "video"), PAIRS
                ):
                    pixels, grid, at = media_for_slice(at, batch[p], batch[g], merge, kind)
                    media += [pixels, grid]
                    placeholders.append(at)
                local = torch.nn.functional.pad(ids, (0, 3))[:, columns]
                parts.append(model.embed_multimodal(local, *media, placeholders=tuple(placeholders)))
            assert rel_err(torch.cat(parts, 1)[:, :T], whole) <= REL_TOL, cut


def test_cp_without_placeholders_and_text_model_errors(case):
    """Pixels under cp without the whole rows' placeholders, and pixels for a text-only model: clear errors."""
    from glm53 import Glm53ForCausalLM
    from tests.helpers.cp_jobs import OneRank

    model = Glm53ForConditionalGeneration(case["config"])
    batch = case["batches"][1][0]
    with pytest.raises(Exception, match="context_parallel_inputs"):
        model(**batch, cp=OneRank(T))
    at = sliced_placeholders(batch["input_ids"], model.token_ids, slice(0, T))
    with pytest.raises(Exception, match="not inputs_embeds"):
        model(inputs_embeds=torch.zeros(2, T, model.config.hidden_size), placeholders=at)
    text = Glm53ForCausalLM(text_config())
    with pytest.raises(ValueError, match="text-only model"):
        context_parallel_inputs(text, batch["input_ids"], mesh=_FakeMesh(), pixel_values=batch["pixel_values"])


class _FakeMesh:
    """A 1-D cp mesh of one rank, enough for context_parallel_inputs' slicing (no collective runs)."""

    mesh_dim_names = ("cp",)

    def size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0

    def get_group(self):
        return None
