"""Helpers that build the transformers 5.23.0 glm5_next oracle on tiny random configs."""

from __future__ import annotations

import math

import torch

from glm53 import Glm53Config

TINY_VISION = dict(
    depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32, projection_intermediate_size=16
)


def hf_text_kwargs(config: Glm53Config) -> dict:
    d = config.to_dict()
    for key in ("output_router_logits",):
        d.pop(key, None)
    return {k: v for k, v in d.items() if not k.startswith("_")}


def hf_model(config: Glm53Config, seed: int = 0):
    """A Glm5NextForConditionalGeneration with every parameter and buffer randomised (fp32, eager)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    hf_config = Glm5NextConfig(
        text_config=hf_text_kwargs(config), vision_config=TINY_VISION, tie_word_embeddings=config.tie_word_embeddings
    )
    hf_config._attn_implementation = "eager"
    hf_config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(hf_config).eval()
    randomize(model, seed)
    return model


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Overwrite every floating parameter and buffer with values that exercise the numerics."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point():
                continue
            r = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):
                value = r * 0.5
            elif name.endswith("dt_bias"):
                value = r
            elif name.endswith(("scale",)) and "hc" in name:
                value = 1 + 0.5 * r
            elif name.endswith("e_score_correction_bias"):
                value = 0.1 * r
            elif t.dim() == 1 and name.endswith("weight"):
                value = 1 + 0.2 * r  # norm weights
            elif t.dim() == 1:
                value = 0.2 * r  # biases, hc base
            else:
                fan_in = t.shape[-1] if t.dim() > 1 else 1
                value = r / math.sqrt(fan_in)
            t.copy_(value.to(t.dtype))
