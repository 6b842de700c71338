"""The whole model in bf16, bounded by roundings: its logits differ from the fp32 model holding the same (bf16)
weights by a few bf16 roundings of those logits, like transformers' bf16 run.

Legend: B batch, T time, V vocab.
Discrete choices are taken out of play (every expert routed, top-k >= T), so one rounding cannot flip an expert
or a key pool and the error stays a sum of per-op roundings; a missing fp32 upcast (a norm, softmax, router or
KDA state in bf16) multiplies it.
"""

from __future__ import annotations

import copy

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.model.test_model_parity import make_inputs

ROUNDINGS = 6.0  # measured: max error 2.8x the largest rounding, mean 3.6x the mean rounding (transformers alike)


def test_bf16_logits_within_a_few_roundings_of_fp32_on_the_same_weights(tmp_path):
    from transformers import Glm5NextForConditionalGeneration

    torch.manual_seed(0)
    config = Glm53Config.tiny(n_routed_experts=2, num_experts_per_tok=2, index_topk=64)
    path = tmp_path / "checkpoint"
    Glm53ForCausalLM(config).save_pretrained(path)
    low = Glm53ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    same_weights = copy.deepcopy(low).float()  # the exact answer for these weights, up to fp32 noise
    hf_low = Glm5NextForConditionalGeneration.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    ids, mask = make_inputs(config.vocab_size, 2, 40, "left")
    with torch.no_grad():
        ref = same_weights(ids, attention_mask=mask).logits
        got = low(ids, attention_mask=mask).logits
        hf_got = hf_low(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == torch.bfloat16
    valid = mask.bool()
    rounding = (ref.to(torch.bfloat16).float() - ref)[valid].abs()
    err = (got.float() - ref)[valid].abs()
    hf_err = (hf_got.float() - ref)[valid].abs()
    assert err.max() <= ROUNDINGS * rounding.max(), f"max error {err.max():.2e}, rounding {rounding.max():.2e}"
    assert err.mean() <= ROUNDINGS * rounding.mean(), f"mean error {err.mean():.2e}, rounding {rounding.mean():.2e}"
    assert err.mean() <= 1.1 * hf_err.mean(), f"glm53 {err.mean():.2e} vs transformers {hf_err.mean():.2e}"
