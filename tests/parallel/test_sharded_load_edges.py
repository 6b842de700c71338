"""The sharded loader at its edges (one process): an FP8 slice reads its own bytes plus exactly the scale blocks it
touches, also when it ends on a block edge, and its values equal the full dequantisation; a meta-built model with
tied embeddings is tied again after `to_empty`, and an MTP module the checkpoint lacks is initialised.

Legend: bo x bi the FP8 block (4 x 8 here); a slice [r0:r1, c0:c1] touches scale blocks r0 // bo .. ceil(r1 / bo)
and c0 // bi .. ceil(c1 / bi).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import fp8
from glm53.parallel.load import SliceReader, load_pretrained

BLOCK = (4, 8)


@pytest.fixture(scope="module")
def fp8_file(tmp_path_factory):
    w = torch.randn(13, 29, generator=torch.Generator().manual_seed(3))
    q, s = fp8.quantize(w, BLOCK)  # scale blocks [4, 4]
    path = os.path.join(tmp_path_factory.mktemp("slices"), "w.safetensors")
    save_file({"w": q, "w" + fp8.SCALE_SUFFIX: s}, path)
    return dict(files={"w": path, "w" + fp8.SCALE_SUFFIX: path}, full=fp8.dequantize(q, s, BLOCK))


@pytest.mark.parametrize(
    "rows,cols,blocks",
    [((0, 8), (0, 16), 4), ((4, 8), (8, 16), 1), ((3, 5), (7, 9), 4), ((12, 13), (24, 29), 1), ((0, 13), (0, 29), 16)],
)
def test_fp8_slice_reads_its_bytes_and_the_blocks_it_touches(fp8_file, rows, cols, blocks):
    reader = SliceReader(fp8_file["files"], BLOCK)
    index = (slice(*rows), slice(*cols))
    values = reader.values("w", index)
    assert torch.equal(values, fp8_file["full"][index])
    n = (rows[1] - rows[0]) * (cols[1] - cols[0])
    assert reader.bytes_read == n + 4 * blocks  # e4m3 values, one fp32 scale per touched block


def _meta_model(config: Glm53Config) -> Glm53ForCausalLM:
    with torch.device("meta"):
        return Glm53ForCausalLM(config)


def test_tied_embeddings_stay_tied_after_a_meta_load(tmp_path):
    """to_empty gives lm_head and the embedding separate storage: the load must tie them again, or lm_head keeps
    whatever memory to_empty handed it (a tied checkpoint stores no lm_head)."""
    config = Glm53Config.tiny(tie_word_embeddings=True)
    source = Glm53ForCausalLM(config)
    source.save_pretrained(tmp_path / "tied")
    model = load_pretrained(_meta_model(config), tmp_path / "tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(1, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits)


def test_checkpoint_without_mtp_initialises_the_meta_mtp_module(tmp_path):
    Glm53ForCausalLM(Glm53Config.tiny()).save_pretrained(tmp_path / "no-mtp")
    model = load_pretrained(_meta_model(Glm53Config.tiny(num_nextn_predict_layers=1)), tmp_path / "no-mtp")
    layer = model.mtp.layers[0]
    for norm in (
        layer.enorm,
        layer.hnorm,
        layer.input_layernorm,
        layer.post_attention_layernorm,
        layer.shared_head.norm,
    ):
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    std = layer.eh_proj.weight.std().item()
    assert 0.5 * model.config.initializer_range < std < 1.5 * model.config.initializer_range
