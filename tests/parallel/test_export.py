"""`glm53.parallel.export_pretrained` on gloo: a model sharded on dp2 x tp2 writes the official layout from
several ranks at once (no rank gathers the model); from_pretrained reloads it exactly, transformers 5.23.0 loads
it to equal logits, and an existing directory's foreign files survive."""

from __future__ import annotations

import json
import os

import pytest
import torch

from glm53 import Glm53ForCausalLM
from tests.helpers.checkpoints import read_all
from tests.helpers.ckpt_jobs import load_and_export, write_test_checkpoint

SHARD = 60_000  # bytes per file: several files per writer rank


def test_export_from_2x2_reloads_exactly_and_in_transformers(pool4, tmp_path):
    init = str(tmp_path / "init")
    state = write_test_checkpoint(init, fp8_blocks=False)
    out = tmp_path / "export"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # a foreign file, kept as save_pretrained keeps it
    results = pool4.run(load_and_export, init=init, out=str(out), dp=2, tp=2, max_shard_size=SHARD)
    written = read_all(str(out))
    assert set(written) == set(state)
    assert all(torch.equal(written[k], state[k]) for k in state)
    assert (out / "tokenizer.json").read_text() == "{}"
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(files) and len(files) > 4
    largest = max(v.nbytes for v in state.values())
    assert all(r["pending"] <= SHARD + largest for r in results)  # no rank held more than one file's worth

    ours = Glm53ForCausalLM.from_pretrained(out, dtype=torch.float32)
    from transformers import Glm5NextForConditionalGeneration

    hf, info = Glm5NextForConditionalGeneration.from_pretrained(out, output_loading_info=True,
                                                                attn_implementation="eager")  # fmt: skip
    assert not info["mismatched_keys"]
    assert all(k.startswith("model.visual.") for k in info["missing_keys"]), info["missing_keys"]
    hf.eval()
    ids = torch.randint(1, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
