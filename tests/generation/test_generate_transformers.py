"""Greedy `generate` equals transformers 5.23.0 `generate(do_sample=False)` on checkpoints transformers wrote.

Dense regime only (prompt + new tokens <= index_topk): there transformers' cached generation equals its own full
forward; in the sparse regime it departs from it (MODEL_NOTES.md), so test_incremental.py uses glm53's forward.
Prompts are not multiples of the KDA chunk (64) or the k-pool (4); the batch is left-padded with different lengths.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.helpers.generation import left_padded
from tests.helpers.oracle import hf_model

NEW = 10
SHARED = dict(
    num_hidden_layers=5,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
    indexer_types=["full", "full", "shared", "full", "full"],
)
CASES = {
    "leftpad-23-18-7": dict(config=dict(index_topk=64), lengths=[23, 18, 7], eos=True),
    # adjacent attention layers: the only shared top-k pattern transformers supports
    "shared-topk": dict(config=dict(index_topk=64, **SHARED), lengths=[15, 9]),
}


def load_pair(tmp_path, overrides: dict):
    hf = hf_model(Glm53Config.tiny(**overrides), seed=1)
    hf.save_pretrained(tmp_path)
    return hf, Glm53ForCausalLM.from_pretrained(tmp_path).eval()


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_greedy_equals_transformers(tmp_path, case):
    spec = CASES[case]
    hf, ours = load_pair(tmp_path, spec["config"])
    ids, mask = left_padded(ours.config.vocab_size, spec["lengths"])
    assert ids.shape[1] + NEW <= ours.config.index_topk  # dense regime
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    got = ours.generate(ids, mask, max_new_tokens=NEW)
    assert got.shape == ref.shape == (len(spec["lengths"]), ids.shape[1] + NEW)
    assert torch.equal(got, ref)
    if spec.get("eos"):
        check_eos(hf, ours, ids, mask, got)


def check_eos(hf, ours, ids, mask, free):
    """Each row stops at its first EOS; later positions hold pad_token_id; as transformers does."""
    eos = int(free[0, ids.shape[1] + 4])  # row 0 stops after 5 new tokens; the others run on unless they meet it
    ref = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos
    )
    got = ours.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos)
    assert torch.equal(got, ref)
    assert got[0, ids.shape[1] + 4] == eos and (got[0, ids.shape[1] + 5 :] == 0).all()
