"""The tower under glm53.parallel on gloo: a VL model built on meta, parallelized and filled by load_pretrained
(dp2: FSDP per vision block, one rank's batch without any image; tp2: the tower replicated) equals one process's
from_pretrained: parameters bit for bit, loss and every gradient (text and vision) within fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ParallelStyle

from glm53 import Glm53ForConditionalGeneration
from glm53.parallel.parallelize import vision_tp_plan
from tests.helpers.vision import hf_vl_model, text_config, vl_batch
from tests.helpers.vision_jobs import reference_vl_step, sharded_vl_step

TOL = 1e-4  # relative to each reference tensor's largest magnitude: fp32, other summation orders (as test_sharded_load)


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vl-parallel") / "ckpt")
    hf_vl_model(text_config(index_topk=64), seed=7).save_pretrained(path)
    images = vl_batch([[1, 2, ("image", 4, 6), 3, 4], [5, ("video", 2, 2, 4), 6, 8]])
    text = dict(
        input_ids=torch.randint(1, 290, images["input_ids"].shape, generator=torch.Generator().manual_seed(2)),
        attention_mask=torch.ones_like(images["input_ids"]),
    )
    batches = [images, text]
    return dict(
        path=path, batches=batches, refs={1: reference_vl_step(path, batches[:1]), 2: reference_vl_step(path, batches)}
    )


def rel_err(a, b):
    return ((a - b).abs().max() / max(b.abs().max().item(), 1e-12)).item()


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)], ids=["dp2", "tp2"])
def test_sharded_vl_load_and_step_equal_one_process(pool2, vl_ckpt, dp, tp):
    results = pool2.run(sharded_vl_step, path=vl_ckpt["path"], batches=vl_ckpt["batches"], dp=dp, tp=tp)
    ref = vl_ckpt["refs"][dp]
    vision = [n for n in ref["grads"] if n.startswith("visual.")]
    assert len(vision) == 39
    for r in results:
        assert r["always_run_tower"] == (dp > 1)
        for name, p in ref["params"].items():
            assert torch.equal(r["params"][name], p), name
        assert rel_err(r["loss"], ref["loss"]) <= TOL
        assert set(r["grads"]) == set(ref["grads"])
        bad = [(n, rel_err(r["grads"][n], g)) for n, g in ref["grads"].items() if rel_err(r["grads"][n], g) > TOL]
        assert not bad, bad


def test_vision_tp_plan_covers_every_tower_parameter():
    from glm53.vision import with_vision
    from tests.helpers.vision import TOKENS, TOWER

    model = Glm53ForConditionalGeneration(with_vision(text_config(), TOWER, TOKENS))
    plan = vision_tp_plan(model)
    assert all(isinstance(style, ParallelStyle) for style in plan.values())
    covered = {f"{m}.{n}" for m in plan for n, _ in model.get_submodule(m).named_parameters(recurse=False)}
    assert covered == {n for n, _ in model.named_parameters() if n.startswith("visual.")}
