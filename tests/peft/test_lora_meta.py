"""A LoRA / --freeze run under torchrun from --init builds its model on the meta device and each rank reads only
its own slices of the base (glm53/training/distributed.py, glm53.parallel.load_pretrained); fresh adapters take
apply_lora's values. Run in the shared gloo pool (tests/helpers/lora_jobs.py's `cli_train`, as torchrun would).

Checked against the whole build (glm53.peft.build_model on every rank, then parallelize) and one process: the same
parameters bit for bit (dp2, tp2, ep2), the same losses and adapters after two AdamW steps; and no rank reads the whole base.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import glm53
from glm53 import Glm53ForCausalLM
from glm53.__main__ import main
from glm53.peft import load_base
from glm53.peft.files import WEIGHTS_FILE
from glm53.precision import keeps_fp32
from glm53.training import trainer
from tests.helpers.checkpoints import fp8_source
from tests.helpers.lora_jobs import cli_train, loaded_state

FAST = ["--batch-size", "2", "--seq-len", "16", "--log-every", "1", "--seed", "3"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


def _ok(results):
    for res in results:
        assert res["rc"] == 0, res["stdout"][-2000:]
    return results


def _losses(path) -> dict[int, float]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _tensor_bytes(path) -> list[int]:
    """The stored size in bytes of every tensor in the checkpoint directory's safetensors files."""
    sizes = []
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as f:
                for key in f.keys():
                    t = f.get_slice(key)
                    element = torch.empty(0, dtype=_DTYPES[t.get_dtype()]).element_size()
                    sizes.append(torch.Size(t.get_shape()).numel() * element)
    return sizes


def _stored_bytes(path) -> int:
    return sum(_tensor_bytes(path))


def _largest_tensor_bytes(path) -> int:
    return max(_tensor_bytes(path))


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "ckpt"
    assert main(["train", "--steps", "1", *FAST, "--save", str(path)]) == 0
    return path


def _one_process(argv, monkeypatch) -> dict:
    got = {}
    monkeypatch.setattr(trainer.Trainer, "run", lambda self: got.update(loaded_state(self, everything=True)) or 0)
    assert main(argv) == 0
    return got


def _same_params(got: dict, want: dict, where: str) -> None:
    assert got["params"].keys() == want["params"].keys(), where
    for name, value in want["params"].items():
        assert got["params"][name].dtype == value.dtype and torch.equal(got["params"][name], value), (where, name)
    assert got["trainable"] == want["trainable"], where
    assert got["scales"].keys() == want["scales"].keys(), where
    for name, value in want["scales"].items():
        assert torch.equal(got["scales"][name], value), (where, name)


def test_dp2_tp2_ep2_lora_from_init_build_on_meta_and_read_own_slices(pool2, base, tmp_path, monkeypatch):
    run = ["train", "--init", str(base), *LORA, *FAST, "--steps", "2"]
    meta = _ok(pool2.run(cli_train, argv=[*run, "--dp", "2"], inspect=True, build="meta", everything=True))
    tp2 = _ok(pool2.run(cli_train, argv=[*run, "--tp", "2"], inspect=True, build="meta", everything=True))
    ep2 = _ok(pool2.run(cli_train, argv=[*run, "--ep", "2"], inspect=True, build="meta", everything=True))
    one = _one_process(run, monkeypatch)
    assert len(one["adapters"]) > 50 and all("lora_" in n for n in one["trainable"])
    assert any(v.abs().sum() > 0 for n, v in one["adapters"].items() if "lora_A" in n)
    stored = _stored_bytes(base)
    for res in (*meta, *tp2, *ep2):  # base and adapters bit for bit: apply_lora's RNG draws on every rank
        _same_params(res["loaded"], one, "rank")
    read = [res["loaded"]["bytes_read"] for res in meta]
    # FSDP2 over dp2 splits every parameter's rows in two (one padded row at most): each rank reads about half;
    # only replicated buffers (the routers' balancing bias) are read by both ranks
    assert all(0 < b < 0.6 * stored for b in read), (read, stored)
    assert sum(read) >= stored
    assert all(0 < res["loaded"]["bytes_read"] < stored for res in (*tp2, *ep2))


def test_dp2_lora_on_meta_trains_as_the_whole_build(pool2, base, tmp_path):
    run = ["train", "--init", str(base), *LORA, *FAST, "--steps", "2", "--dp", "2"]
    a, b = tmp_path / "meta", tmp_path / "whole"
    _ok(pool2.run(cli_train, argv=[*run, "--save", str(a)], build="meta"))
    _ok(pool2.run(cli_train, argv=[*run, "--save", str(b)], build="whole"))
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == [1, 2] and la == lb  # the same values, the same computation: the same numbers
    fa, fb = load_file(a / WEIGHTS_FILE), load_file(b / WEIGHTS_FILE)
    assert fa.keys() == fb.keys() and len(fa) > 50
    for key in fa:
        assert torch.equal(fa[key], fb[key]), key


def test_dp2_freeze_from_init_builds_on_meta(pool2, base, monkeypatch):
    run = ["train", "--init", str(base), "--freeze", "embeddings", "attention", *FAST, "--steps", "1"]
    meta = _ok(pool2.run(cli_train, argv=[*run, "--dp", "2"], inspect=True, build="meta", everything=True))
    one = _one_process(run, monkeypatch)
    assert one["trainable"] and len(one["trainable"]) < len(one["params"])
    assert not any("embed_tokens" in n for n in one["trainable"])
    for res in meta:
        _same_params(res["loaded"], one, "dp2 --freeze")
        assert 0 < res["loaded"]["bytes_read"]


BF16_RUN = [*LORA, "--base-dtype", "bf16", *FAST, "--dp", "2"]


@pytest.fixture(scope="module")
def bf16_dp2_run(pool2, base, tmp_path_factory):
    """A dp2 LoRA run on a bf16-held base built on meta, two steps, saved (the tests below compare runs with it)."""
    path = tmp_path_factory.mktemp("bf16-dp2") / "run"
    run = ["train", "--init", str(base), *BF16_RUN, "--steps", "2", "--save", str(path)]
    _ok(pool2.run(cli_train, argv=run, build="meta"))
    return path


def test_dp2_bf16_base_on_meta_holds_bf16_shards_as_one_process(pool2, base, bf16_dp2_run, tmp_path, monkeypatch):
    """--base-dtype bf16 under torchrun: built on meta with the frozen text linears and experts held in bf16, so
    each rank's FSDP shards of them are bf16 (2 bytes) and read from its slices; the same values and dtypes as
    one process, and two steps train as the whole build does (the same losses and adapters)."""
    one_run = ["train", "--init", str(base), *BF16_RUN[:-2], "--steps", "2"]
    run = [*one_run, "--dp", "2"]
    meta = _ok(pool2.run(cli_train, argv=run, inspect=True, build="meta", everything=True))
    one = _one_process(one_run, monkeypatch)
    held = {n for n, v in one["params"].items() if v.dtype == torch.bfloat16}
    assert len(held) > 40 and not any("lora_" in n or "norm" in n for n in held)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= held  # the vocab tables too (glm53.peft.vocab_tables)
    assert all(v.dtype == torch.float32 for n, v in one["params"].items() if n not in held)
    stored = _stored_bytes(base)
    for res in meta:
        _same_params(res["loaded"], one, "dp2 bf16 base")
        assert all(v.dtype == one["params"][n].dtype for n, v in res["loaded"]["params"].items())
        local = res["loaded"]["local_bytes"]
        # this rank's shards: the held weights at 2 bytes of about half their elements (FSDP pads a row at most)
        assert 0.45 < local["bf16"] / (2 * sum(one["params"][n].numel() for n in held)) < 0.6, local
        assert 0 < res["loaded"]["bytes_read"] < 0.6 * stored
    # training: the meta build and the whole build (peft's build_model on every rank, then sharded) give the same
    # numbers; dp2 vs one process on one step's numbers is test_lora_parallel's bf16 case (the same held values)
    a, b = bf16_dp2_run, tmp_path / "whole"
    _ok(pool2.run(cli_train, argv=[*run, "--save", str(b)], build="whole"))
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == [1, 2] and la == lb
    fa, fb = load_file(a / WEIGHTS_FILE), load_file(b / WEIGHTS_FILE)
    assert fa.keys() == fb.keys() and len(fa) > 50 and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_dp2_bf16_base_under_the_bf16_policy_trains(pool2, base, bf16_dp2_run, tmp_path):
    """--bf16 under torchrun is FSDP's bf16 policy: the bf16-held base is widened to bf16 (a no-op) there, as the
    adapters and activations are; an fp32 widening would be refused by parallelize (test_lora_tp_refusals.py).
    Compared on step 1's loss (taken before any update) with the fp32-compute run `bf16_dp2_run`."""
    run = ["train", "--init", str(base), *BF16_RUN, "--steps", "1", "--bf16", "--save", str(tmp_path / "a")]
    _ok(pool2.run(cli_train, argv=run, build="meta"))
    la, lb = _losses(tmp_path / "a"), _losses(bf16_dp2_run)
    # bf16 compute vs fp32 compute on the same bf16 weights: bf16 roundings (2^-8) through the 4-layer stack
    assert sorted(la) == [1] and abs(la[1] - lb[1]) <= 4 * 2**-8 * abs(lb[1]) and la[1] != lb[1]


@pytest.fixture(scope="module")
def fp8_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "ckpt"
    shutil.copytree(fp8_source()[0], path)
    return path


FP8_RUN = [*LORA, "--base-dtype", "fp8", *FAST, "--steps", "1"]


@pytest.fixture(scope="module")
def fp8_dp2_run(pool2, fp8_base, tmp_path_factory):
    """A dp2 LoRA run on an FP8 base built on meta, one step, saved and exported merged (to ../merged; the tests
    below compare runs with it)."""
    path = tmp_path_factory.mktemp("fp8-dp2") / "run"
    run = ["train", "--init", str(fp8_base), *FP8_RUN, "--dp", "2", "--save", str(path)]
    _ok(pool2.run(cli_train, argv=[*run, "--export-merged", str(path.parent / "merged")], build="meta"))
    return path


def test_dp2_ep2_fp8_base_built_on_meta_reads_raw_fp8_as_one_process(
    pool2, fp8_base, fp8_dp2_run, tmp_path, monkeypatch
):
    """--base-dtype fp8 under torchrun: built on meta with FP8 placeholders, each rank reads its raw FP8 slices
    (block 4 x 8 on hidden 36: FSDP's row split cuts blocks) and the scales its buffers hold (whole under dp, its
    experts' under ep); the same FP8 bytes, scales and adapters as one process, and no rank reads the whole base."""
    run = ["train", "--init", str(fp8_base), *FP8_RUN]
    dp2 = _ok(pool2.run(cli_train, argv=[*run, "--dp", "2"], inspect=True, build="meta", everything=True))
    ep2 = _ok(pool2.run(cli_train, argv=[*run, "--ep", "2"], inspect=True, build="meta", everything=True))
    one = _one_process(run, monkeypatch)
    fp8 = {n for n, v in one["params"].items() if v.dtype == torch.uint8}  # FP8 values, as their bits
    assert len(fp8) > 40 and sum(".mlp.experts." in n for n in fp8) == 6 and len(one["scales"]) == len(fp8)
    stored = _stored_bytes(fp8_base)
    for res in (*dp2, *ep2):
        _same_params(res["loaded"], one, "fp8 base")
        assert 0 < res["loaded"]["bytes_read"] < 0.75 * stored
    # dp2 splits every FP8 weight's rows: each rank holds and reads about half of the FP8 bytes
    fp8_bytes = sum(one["params"][n].numel() for n in fp8)
    for res in dp2:
        assert 0.45 < res["loaded"]["local_bytes"]["float8_e4m3fn"] / fp8_bytes < 0.6
        assert res["loaded"]["bytes_read"] < 0.6 * stored
    # together they read every FP8 value (once) and the whole-scale buffers (each rank); the checkpoint's vision
    # tower and MTP tensors, which the text model does not load, nobody
    scales = sum(b.numel() * 4 for b in one["scales"].values())
    assert sum(r["loaded"]["bytes_read"] for r in dp2) >= fp8_bytes + 2 * scales
    # training from the meta build equals the whole build (peft's build_model on every rank, then sharded)
    a, b = fp8_dp2_run, tmp_path / "whole"
    _ok(pool2.run(cli_train, argv=[*run, "--dp", "2", "--save", str(b)], build="whole"))
    assert _losses(a) == _losses(b) and sorted(_losses(a)) == [1]
    fa, fb = load_file(a / WEIGHTS_FILE), load_file(b / WEIGHTS_FILE)
    assert fa.keys() == fb.keys() and len(fa) > 50 and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_dp2_ep2_quantize_base_on_meta_quantises_per_rank_as_one_process(pool2, base, monkeypatch):
    """--quantize-base under torchrun: built on meta with FP8 placeholders for every text linear and expert, each
    rank reads the wider (fp32) key of each one whole, one tensor at a time, quantises it per block as load_base does
    in one process and keeps its slices of the values and scales: the same FP8 bytes and scales as one process on dp2
    and ep2, and no rank builds or reads the whole model at once (build="meta": load_base / from_pretrained raise)."""
    run = ["train", "--init", str(base), *LORA, "--base-dtype", "fp8", "--quantize-base", *FAST, "--steps", "1"]
    dp2 = _ok(pool2.run(cli_train, argv=[*run, "--dp", "2"], inspect=True, build="meta", everything=True))
    ep2 = _ok(pool2.run(cli_train, argv=[*run, "--ep", "2"], inspect=True, build="meta", everything=True))
    one = _one_process(run, monkeypatch)
    fp8 = {n for n, v in one["params"].items() if v.dtype == torch.uint8}  # every text linear and expert tensor
    assert len(fp8) > 60 and sum(".mlp.experts." in n for n in fp8) == 8 and len(one["scales"]) == len(fp8)
    stored, largest = _stored_bytes(base), _largest_tensor_bytes(base)
    for res in (*dp2, *ep2):
        _same_params(res["loaded"], one, "quantize base")
        # one key in flight at a time: the largest read is one stored tensor, far from the whole model
        assert 0 < res["loaded"]["largest_read"] <= largest < stored / 10
        assert 0 < res["loaded"]["bytes_read"] <= stored
    # a rank holds its shards in FP8 (about half of the values under dp2), not a bf16 / fp32 copy of them
    fp8_bytes = sum(one["params"][n].numel() for n in fp8)
    for res in dp2:
        assert 0.45 < res["loaded"]["local_bytes"]["float8_e4m3fn"] / fp8_bytes < 0.6


def test_dp2_fp8_base_under_the_bf16_policy(pool2, fp8_base, fp8_dp2_run, tmp_path, monkeypatch):
    """--bf16 with --base-dtype fp8 under torchrun: FSDP's bf16 policy would cast FP8 values to bf16 numbers
    without their scales, so they are held as their uint8 bits (glm53.peft.fp8.hold_for_policy; the policy casts
    floating parameters only) and dequantised to bf16 per matmul: the same bytes as one process's FP8 values, each
    rank half of them, and a step within bf16 rounding of the fp32-compute run (`fp8_dp2_run`)."""
    one_run = ["train", "--init", str(fp8_base), *FP8_RUN]
    run = [*one_run, "--dp", "2"]
    bits = _ok(pool2.run(cli_train, argv=[*run, "--bf16"], inspect=True, build="meta", everything=True))
    one = _one_process(one_run, monkeypatch)
    fp8_bytes = sum(v.numel() for v in one["params"].values() if v.dtype == torch.uint8)
    for res in bits:
        _same_params(res["loaded"], one, "dp2 --bf16 fp8 base")
        assert 0.45 < res["loaded"]["local_bytes"]["uint8"] / fp8_bytes < 0.6
        assert "float8_e4m3fn" not in res["loaded"]["local_bytes"]
    _ok(pool2.run(cli_train, argv=[*run, "--bf16", "--save", str(tmp_path / "a")], build="meta"))
    la, lb = _losses(tmp_path / "a"), _losses(fp8_dp2_run)
    # bf16 compute vs fp32 compute on the same FP8 weights: bf16 roundings (2^-8) through the 4-layer stack
    assert sorted(la) == [1] and abs(la[1] - lb[1]) <= 4 * 2**-8 * abs(lb[1]) and la[1] != lb[1]


@pytest.mark.parametrize(
    "checkpoint, base_dtype, layout",
    [("fp8_base", "fp8", ["--dp", "2"]), ("fp8_base", "fp8", ["--ep", "2"]), ("base", "bf16", ["--tp", "2"])],
)
def test_export_merged_under_torchrun_equals_one_process_merge(
    pool2, request, tmp_path, checkpoint, base_dtype, layout
):
    """--export-merged under torchrun: every rank folds the adapters into its own shards (FSDP's row split cuts the
    FP8 base's 4 x 8 blocks, ep splits the experts; tp: a colwise base's rows with B's rows (q_b_proj, the
    absorbed form's kv_b_proj), a rowwise base's columns with A's columns (o_proj, down_proj), the experts' inner
    width; a bf16-held base is widened) and the ranks write the official layout together: the saved
    adapter merged in one process (load_base + load_lora + merge_lora, bf16); transformers loads the tp2 export."""
    path = request.getfixturevalue(checkpoint)
    if layout == ["--dp", "2"]:  # the run fp8_dp2_run made (the same flags) exported merged already
        saved = request.getfixturevalue("fp8_dp2_run")
        merged = saved.parent / "merged"
    else:
        saved, merged = tmp_path / "a", tmp_path / "m"
        run = ["train", "--init", str(path), *LORA, "--base-dtype", base_dtype, *FAST, "--steps", "1", *layout]
        _ok(pool2.run(cli_train, argv=[*run, "--save", str(saved), "--export-merged", str(merged)]))
    want = load_base(Glm53ForCausalLM, path, base_dtype, dtype=torch.float32)
    glm53.load_lora(want, saved)
    assert any(p.abs().max() > 0 for n, p in want.named_parameters() if "lora_B" in n)
    glm53.merge_lora(want)
    got = dict(Glm53ForCausalLM.from_pretrained(merged, dtype=torch.float32).named_parameters())
    for name, p in want.named_parameters():
        ref = p.float() if keeps_fp32(name) else p.to(torch.bfloat16).float()
        # the same fp32 terms per element (base + s * the r-long B A dot product over this rank's box), rounded to
        # bf16 once: equal, or one bf16 step apart (at most 2^-7 relative) where a BLAS sums in another order
        assert ((got[name] - ref).abs() <= 2**-7 * ref.abs()).all(), name
    if "--tp" in layout:
        from transformers import Glm5NextForConditionalGeneration

        _, info = Glm5NextForConditionalGeneration.from_pretrained(merged, output_loading_info=True)
        # transformers' Glm5NextModel always builds a (default) tower: its keys are the only missing ones; it has no
        # MTP module, so the MTP layer the official layout stores after the decoder layers is the only unexpected one
        mtp = f"model.language_model.layers.{want.config.num_hidden_layers}."
        assert all(k.startswith("model.visual.") for k in info["missing_keys"]), info["missing_keys"]
        assert info["unexpected_keys"] and all(k.startswith(mtp) for k in info["unexpected_keys"]), info
        assert not info["mismatched_keys"] and not info["error_msgs"], info
