"""Shared pieces of the glm53.peft tests: a tiny random model, random non-zero adapters, derived tolerances."""

from __future__ import annotations

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from tests.helpers.checkpoints import random_model

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
VOCAB = 320  # Glm53Config.tiny's vocabulary


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> Glm53ForCausalLM:
    """4 layers [KDA + dense MLP, MLA full + MoE, MLA shared + MoE, KDA + MoE] (tests/helpers/checkpoints.py);
    kv_lora_rank 12 <= qk + v head width 16, so MLA runs absorbed by default."""
    base = dict(
        hidden_size=36,
        q_lora_rank=20,
        kv_lora_rank=12,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
    )
    base.update(overrides)
    return random_model(Glm53Config.tiny(**base), seed).to(dtype).eval()


def randomize_adapters(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    """Non-zero A and B for every adapter (B starts at zero, which would hide the adapter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * std).to(p.dtype))


def ids(B: int = 2, T: int = 13, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (in fp64)."""
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())
