"""`glm53.parallel.load_pretrained` on gloo: a model built on meta and parallelized (FSDP dp4, TP tp4, dp2 x tp2,
and dp2 / tp2; expert parallel ep2 and dp2 x ep2) loads a tiny FP8 official-layout checkpoint (4 x 8 blocks, so
shard boundaries cut blocks) with each rank reading only its own slices; its loss and gradients equal one process's
`from_pretrained`.

The sharded loader at its edges (one process): an FP8 slice reads its own bytes plus exactly the scale blocks it
touches, also when it ends on a block edge, and its values equal the full dequantisation; a meta-built model with
tied embeddings is tied again after `to_empty`, and an MTP module the checkpoint lacks is initialised.

Legend: bo x bi the FP8 block (4 x 8 here); a slice [r0:r1, c0:c1] touches scale blocks r0 // bo .. ceil(r1 / bo)
and c0 // bi .. ceil(c1 / bi).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors.torch import save_file

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import fp8
from glm53.errors import CheckpointError
from glm53.parallel.load import SliceReader, dequantize_slice, load_pretrained
from tests.helpers.checkpoints import read_all, write_checkpoint
from tests.helpers.ckpt_jobs import (
    file_bytes,
    reference_load_step,
    sharded_load_error,
    sharded_load_step,
    write_test_checkpoint,
)

TOL = 1e-4  # relative to each reference tensor's largest magnitude (fp32, different summation orders)
LAYOUTS4 = [(4, 1), (1, 4), (2, 2)]


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sharded") / "fp8")
    write_test_checkpoint(path, fp8_blocks=True)
    ids = torch.randint(1, 320, (4, 16), generator=torch.Generator().manual_seed(5))
    return dict(path=path, ids=ids, refs={dp: reference_load_step(path, ids, dp) for dp in (1, 2, 4)})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / max(b.abs().max().item(), 1e-12)).item()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return rel_err(a, b) <= TOL


@pytest.mark.parametrize("dp,tp", LAYOUTS4, ids=lambda v: str(v))
def test_sharded_fp8_load_equals_from_pretrained(pool4, fp8_ckpt, dp, tp):
    results = pool4.run(sharded_load_step, path=fp8_ckpt["path"], ids=fp8_ckpt["ids"], dp=dp, tp=tp)
    ref = fp8_ckpt["refs"][dp]
    for r in results:
        for name, p in ref["params"].items():  # the load itself is exact
            assert torch.equal(r["params"][name], p), name
        assert close(r["loss"], ref["loss"]), (r["loss"], ref["loss"])
        assert set(r["grads"]) == set(ref["grads"])
        bad = [n for n, g in ref["grads"].items() if not close(r["grads"][n], g)]
        assert not bad, [(n, rel_err(r["grads"][n], ref["grads"][n])) for n in bad]
    total = file_bytes(fp8_ckpt["path"])
    for r in results:
        # Every stored element the rank holds, once (FP8 scales of the touched blocks on top), never the file.
        assert r["bytes_read"] == r["counted"]
        assert r["expected"] <= r["bytes_read"] <= r["expected"] * 1.1, (r["bytes_read"], r["expected"])
        assert r["bytes_read"] < 0.6 * total, (r["bytes_read"], total)


@pytest.mark.parametrize("world,dp,ep", [(2, 1, 2), (4, 2, 2)], ids=["ep2", "dp2xep2"])
def test_sharded_fp8_load_under_expert_parallelism(request, fp8_ckpt, world, dp, ep):
    """Experts Shard(0) over ep (and FSDP over dp): each rank reads only its own experts' keys, the gathered
    parameters are bit-equal to from_pretrained, the loss and gradients (mean over dp x ep slices) equal."""
    pool = request.getfixturevalue(f"pool{world}")
    results = pool.run(sharded_load_step, path=fp8_ckpt["path"], ids=fp8_ckpt["ids"], dp=dp, tp=1, ep=ep)
    ref = fp8_ckpt["refs"][dp * ep]
    experts = Glm53Config.from_pretrained(fp8_ckpt["path"]).n_routed_experts
    per = experts // ep
    for rank, r in enumerate(results):
        for name, p in ref["params"].items():
            assert torch.equal(r["params"][name], p), name
        assert close(r["loss"], ref["loss"]), (r["loss"], ref["loss"])
        assert set(r["grads"]) == set(ref["grads"])
        bad = [n for n, g in ref["grads"].items() if not close(r["grads"][n], g)]
        assert not bad, [(n, rel_err(r["grads"][n], ref["grads"][n])) for n in bad]
        read = {int(m.group(1)) for k in r["keys"] if (m := re.search(r"\.mlp\.experts\.(\d+)\.", k))}
        ep_rank = rank % ep  # init_device_mesh is row-major: ep is the fastest dimension
        assert read == set(range(ep_rank * per, (ep_rank + 1) * per)), (rank, sorted(read))
        assert r["bytes_read"] == r["counted"]
        assert r["expected"] <= r["bytes_read"] <= r["expected"] * 1.1, (r["bytes_read"], r["expected"])
        assert r["bytes_read"] < 0.6 * file_bytes(fp8_ckpt["path"])


def test_dequantize_slice_equals_full_dequantize():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(13, 29, generator=g)
    q, s = fp8.quantize(w, (4, 8))
    full = fp8.dequantize(q, s, (4, 8))
    for r0, r1, c0, c1 in [(0, 13, 0, 29), (3, 9, 5, 22), (4, 8, 8, 16), (12, 13, 28, 29)]:
        blocks = s[r0 // 4 : -(-r1 // 4), c0 // 8 : -(-c1 // 8)]
        part = dequantize_slice(q[r0:r1, c0:c1], blocks, (4, 8), (r0, c0))
        assert torch.equal(part, full[r0:r1, c0:c1]), (r0, r1, c0, c1)


def test_fp32_reads_exactly_the_rank_share(pool4, tmp_path):
    path = str(tmp_path / "fp32")
    write_test_checkpoint(path, fp8_blocks=False)
    ids = torch.randint(1, 320, (4, 8), generator=torch.Generator().manual_seed(1))
    results = pool4.run(sharded_load_step, path=path, ids=ids, dp=2, tp=2, to_empty=True)  # materialised already
    ref = reference_load_step(path, ids, 2)
    assert all(torch.equal(r["params"][n], p) for r in results for n, p in ref["params"].items())
    for r in results:  # each local element read once, nothing else (replicated tensors whole on every rank)
        assert r["bytes_read"] == r["counted"] == r["expected"], (r["bytes_read"], r["expected"])
    assert sum(r["bytes_read"] for r in results) < 2 * file_bytes(path)  # not 4 copies of the checkpoint


def test_bad_checkpoints_raise_from_pretrained_errors_on_every_rank(pool4, tmp_path):
    src = str(tmp_path / "good")
    write_test_checkpoint(src, fp8_blocks=False)
    config = (tmp_path / "good" / "config.json").read_text()
    state = read_all(src)
    cases = {}
    nan = dict(state)
    key = "model.language_model.layers.1.mlp.experts.5.up_proj.weight"  # one expert: on one dp rank only
    nan[key] = nan[key].clone()
    nan[key][3, 7] = float("nan")
    cases["nan"] = nan
    cases["missing"] = {k: v for k, v in state.items() if not k.endswith("layers.2.self_attn.o_proj.weight")}
    for name, tensors in cases.items():
        path = str(tmp_path / name)
        write_checkpoint(path, tensors, {})
        (tmp_path / name / "config.json").write_text(config)
        with pytest.raises(CheckpointError) as single:
            Glm53ForCausalLM.from_pretrained(path, dtype=torch.float32)
        messages = pool4.run(sharded_load_error, path=path, dp=2, tp=2)
        assert messages == [str(single.value)] * 4, (name, messages, str(single.value))


# -------------------------------------------------------------------------------------------- sharded load at its edges
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


def test_quantizing_reader_gives_the_whole_keys_quantisation_in_any_order(tmp_path):
    """SliceReader(quantize=True) on a wider (fp32) key of an FP8-held weight: any slice of its FP8 values and of its
    scales (a key the checkpoint lacks) is that slice of fp8.quantize of the whole key, whether the values or the
    scales are asked for first, by a rank that holds none of the values, or again after the buffer took them."""
    w = torch.randn(13, 29, generator=torch.Generator().manual_seed(4))
    q, s = fp8.quantize(w, BLOCK)
    path = str(tmp_path / "wide.safetensors")
    save_file({"w": w}, path)
    scale_key, rows = "w" + fp8.SCALE_SUFFIX, (slice(4, 9), slice(8, 29))
    reader = SliceReader({"w": path}, BLOCK, quantize=True)
    assert torch.equal(reader.values(scale_key, (slice(0, 4), slice(0, 4))), s)  # scales first: no values read yet
    assert torch.equal(reader.fp8_values("w", rows).view(torch.uint8), q[rows].view(torch.uint8))
    assert torch.equal(reader.values(scale_key, (slice(1, 3), slice(1, 4))), s[1:3, 1:4])
    assert torch.equal(reader.values(scale_key, (slice(0, 4), slice(0, 4))), s)  # asked again: quantised again
    assert reader.largest_read == w.numel() * w.element_size()  # whole-key reads, one tensor at a time
    plain = SliceReader({"w": path}, BLOCK)
    assert plain.fp8_values("w", rows).dtype == torch.float32  # without quantize: as stored, for _fill to refuse


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
