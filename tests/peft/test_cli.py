"""`glm53 train --lora-rank ...` / `--base-dtype fp8` / `--freeze` / `--export-merged` and `glm53 generate
--adapter` (glm53/peft/cli.py through the training and generation CLIs' hooks)."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from safetensors.torch import load_file

import glm53
from glm53 import Glm53ForCausalLM
from glm53.__main__ import main
from glm53.peft import cli as peft_cli
from glm53.peft.files import CONFIG_FILE, WEIGHTS_FILE
from tests.helpers.checkpoints import fp8_source
from tests.peft.helpers import ids, rel_err

FAST = ["--batch-size", "2", "--seq-len", "16", "--log-every", "1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "ckpt"
    assert main(["train", "--steps", "1", *FAST, "--save", str(path)]) == 0
    return path


def test_lora_run_saves_adapter_resumes_exactly_and_exports_merged(base, tmp_path, capsys):
    run = ["train", "--init", str(base), "--lora-rank", "4", "--lora-alpha", "8", *FAST]
    assert (
        main(
            [
                *run,
                "--steps",
                "3",
                "--save-every",
                "2",
                "--save",
                str(tmp_path / "a"),
                "--export-merged",
                str(tmp_path / "merged"),
            ]
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        CONFIG_FILE,
        WEIGHTS_FILE,
        "metrics.jsonl",
        "run.toml",
        "step-2",
        "trainer_state.pt",
    ]
    # the optimizer held only the adapters
    state = torch.load(tmp_path / "a" / "trainer_state.pt", weights_only=True)
    model = Glm53ForCausalLM.from_pretrained(base)
    adapters = glm53.apply_lora(model, 4, 8)
    n_adapter = sum(1 for n, _ in model.named_parameters() if "lora_" in n)
    assert len(state["optimizer"]["state"]) == n_adapter and len(adapters) > 10
    # resume from step 2 (base re-read from the path the adapter config records): the same adapter at step 3
    assert (
        main(
            [
                "train",
                "--resume",
                str(tmp_path / "a" / "step-2"),
                "--lora-rank",
                "4",
                *FAST,
                "--steps",
                "3",
                "--save",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    a, b = load_file(tmp_path / "a" / WEIGHTS_FILE), load_file(tmp_path / "b" / WEIGHTS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the merged export (bf16) equals base + adapter
    glm53.load_lora(model, tmp_path / "a")
    x = ids(T=9)
    merged = Glm53ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        # bf16 weights: each rounded to 8 bits (2^-9 relative), through a 4-layer stack of ~D-long reductions
        assert rel_err(merged(x).logits, model.eval()(x).logits) <= 2**-9 * 4 * 8
    capsys.readouterr()


def test_generate_with_adapter_equals_the_merged_model(base, tmp_path, capsys):
    model = Glm53ForCausalLM.from_pretrained(base)
    glm53.apply_lora(model, 2, 4, targets=["attention"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    glm53.save_lora(model, tmp_path / "adapter")
    args = argparse.Namespace(adapter=str(tmp_path / "adapter"))
    loaded = peft_cli.with_adapter(args, Glm53ForCausalLM.from_pretrained(base)).eval()
    assert not glm53.peft.has_lora(loaded)
    x = ids(T=7)
    with torch.no_grad():
        glm53.merge_lora(model, dtype=torch.float32)
        assert torch.equal(loaded(x).logits, model.eval()(x).logits)
    assert (
        main(
            [
                "generate",
                "--model",
                str(base),
                "--adapter",
                str(tmp_path / "adapter"),
                "--prompt",
                "ab",
                "--max-new-tokens",
                "2",
            ]
        )
        == 0
    )
    capsys.readouterr()


def test_fp8_base_run(tmp_path, capsys):
    path, _ = fp8_source()
    ckpt = tmp_path / "fp8"
    shutil.copytree(path, ckpt)
    assert (
        main(
            [
                "train",
                "--init",
                str(ckpt),
                "--base-dtype",
                "fp8",
                "--lora-rank",
                "2",
                "--lora-targets",
                "attention",
                "experts",
                "--steps",
                "1",
                *FAST,
                "--save",
                str(tmp_path / "a"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "step     1" in out and "router is frozen" in out
    assert (tmp_path / "a" / WEIGHTS_FILE).is_file()


def test_freeze_without_lora_trains_the_rest(base, tmp_path, capsys):
    assert (
        main(
            [
                "train",
                "--init",
                str(base),
                "--freeze",
                "embeddings",
                "experts",
                "attention",
                *FAST,
                "--steps",
                "1",
                "--save",
                str(tmp_path / "a"),
            ]
        )
        == 0
    )
    before, after = Glm53ForCausalLM.from_pretrained(base), Glm53ForCausalLM.from_pretrained(tmp_path / "a")
    b, a = dict(before.named_parameters()), dict(after.named_parameters())
    assert torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert torch.equal(a["model.layers.1.mlp.experts.gate_up_proj"], b["model.layers.1.mlp.experts.gate_up_proj"])
    assert not torch.equal(a["model.norm.weight"], b["model.norm.weight"])
    capsys.readouterr()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-rank", "0"], "--lora-rank must be a positive integer"),
        (["--lora-rank", "4", "--lora-alpha", "x"], "--lora-alpha must be a number"),
        (["--lora-alpha", "4"], None),
        (["--base-dtype", "fp8", "--lora-rank", "4"], None),
        (["--lora-rank", "4", "--lora-targets", "nothing"], None),
        (["--lora-rank", "4", "--freeze", "attn"], None),
    ],
)
def test_flag_errors(flags, message, capsys):
    if message is not None:  # argparse: status 2, the flag named
        with pytest.raises(SystemExit) as err:
            main(["train", "--steps", "1", *flags])
        assert err.value.code == 2 and message in capsys.readouterr().err
        return
    assert main(["train", "--steps", "1", *FAST, *flags]) == 1
    err = capsys.readouterr().err
    assert {
        "--lora-alpha": "need --lora-rank",
        "--base-dtype": "needs --init",
        "--lora-targets": "'nothing'",
        "--freeze": "['attn']",
    }[next(f for f in flags if f != "--lora-rank" and f.startswith("--"))] in err
