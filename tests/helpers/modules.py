"""Small glm53 modules with reproducible non-trivial weights, shared by kernel and model tests.

Legend: none (modules only).
"""

from __future__ import annotations

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.model.indexer import Indexer


def random_indexer(seed: int, **config) -> Indexer:
    """A tiny-config DSA indexer (`config` overrides Glm53Config.tiny) with N(0, 0.25) weights from `seed`: unit
    initialisation leaves most ReLU scores tied, which would hide a wrong pool choice."""
    module = Indexer(Glm53Config.tiny(**config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def packed_loss_batch(vocab: int, B: int = 2, T: int = 19) -> dict[str, torch.Tensor]:
    """ids [B, T], mask [B, T] (row 1 left-padded: packing and padding combined), labels [B, T] (some ignored):
    the batch the packed-batch compile tests run."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 7] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def packed_loss_model() -> Glm53ForCausalLM:
    """One KDA + one MLA layer (dense, then sparse MLP), MTP, every loss part on, random weights (default inits
    hide bugs): the model the packed-batch compile tests run."""
    torch.manual_seed(0)
    config = Glm53Config.tiny(
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse"],
        num_nextn_predict_layers=1,
        indexer_loss_weight=0.5,
        router_aux_loss_coef=0.1,
        router_z_loss_coef=1e-2,
    )
    m = Glm53ForCausalLM(config)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.2)
    return m


PACKED_LOSS_PARTS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss")


def assert_same_packed_run(got: dict, ref: dict, what: str = "") -> None:
    """Two runs of packed_loss_model (tests/compile): logits, every loss part (each on and not trivially 0),
    parameter gradients and expert loads agree at fp32 compile tolerances."""
    tol = dict(rtol=1e-5, atol=1e-6)
    for key in ("logits", "train_logits", *PACKED_LOSS_PARTS):
        assert ref[key] is not None and ref[key].abs().sum() > 0, key
        torch.testing.assert_close(got[key], ref[key], **tol, msg=lambda m: f"{what} {key}: {m}")
    assert sum(g is not None for g in ref["grads"]) > 0
    assert_same_grads_and_loads(got, ref, tol)


def assert_same_grads_and_loads(got: dict, ref: dict, tol: dict) -> None:
    """Two training runs' parameter gradients (None where the other is None, else close) and expert loads (equal:
    the same routing); `got` / `ref` hold "grads" and "loads" lists (tests/compile)."""
    for g, r in zip(got["grads"], ref["grads"], strict=True):
        assert (g is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(g, r, **tol)
    assert len(got["loads"]) == len(ref["loads"]) > 0
    for g, r in zip(got["loads"], ref["loads"]):
        torch.testing.assert_close(g, r, rtol=0, atol=0)  # expert counts: routing identical
