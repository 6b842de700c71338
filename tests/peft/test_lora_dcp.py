"""A LoRA run under torchrun saves with DCP and resumes: `glm53 train --lora-rank ... --dp 2` run in the shared gloo
pool (tests/helpers/lora_jobs.py's `cli_train`: the CLI on each rank, as torchrun would start it).

The save holds the adapter in peft's format (any layout, peft and `glm53 generate --adapter` read it) and the
DCP state of the trainable parameters and their AdamW state only (the frozen base is re-read from --init). A run of 4
steps equals one of 2 steps saved and resumed for 2 (same layout: the same batches); the dp2 save loads on tp2 and
in one process with the same adapters and optimizer state.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from glm53.__main__ import main
from glm53.parallel.train_state import saved_keys
from glm53.peft.files import CONFIG_FILE, WEIGHTS_FILE
from glm53.training import trainer
from tests.helpers.lora_jobs import cli_train, loaded_state

FAST = ["--batch-size", "2", "--seq-len", "16", "--log-every", "1", "--seed", "2"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


def _losses(path) -> dict[int, float]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _ok(results):
    for res in results:
        assert res["rc"] == 0, res["stdout"][-2000:]
    return results


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "ckpt"
    assert main(["train", "--steps", "1", *FAST, "--save", str(path)]) == 0
    return path


def test_dp2_lora_save_resumes_exactly_and_across_layouts(pool2, base, tmp_path, monkeypatch):
    straight, resumed = tmp_path / "a", tmp_path / "b"
    run = ["train", "--init", str(base), *LORA, *FAST, "--dp", "2"]
    _ok(pool2.run(cli_train, argv=[*run, "--steps", "4", "--save", str(straight), "--save-every", "2"]))
    saved = straight / "step-2"
    # the adapter in peft's format, and the DCP state of the adapters and their AdamW state only
    assert sorted(os.listdir(saved)) == [CONFIG_FILE, WEIGHTS_FILE, "run.toml", "train_state"]
    keys = saved_keys(str(saved / "train_state"))
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all("lora_" in k for k in model_keys)
    assert not {k for k in keys if k.startswith("optim.") and "lora_" not in k and "param_groups" not in k}
    assert any(k.startswith("optim.") and k.endswith("lora_A.weight.exp_avg") for k in keys)
    assert json.loads((saved / CONFIG_FILE).read_text())["base_model_name_or_path"] == os.path.abspath(base)

    again = ["train", "--resume", str(saved), *LORA, *FAST, "--dp", "2", "--steps", "4", "--save", str(resumed)]
    _ok(pool2.run(cli_train, argv=again))
    a, b = _losses(straight), _losses(resumed)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]
    for step in (3, 4):  # the same batches, adapters, AdamW state and RNG: the same numbers
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=0), (step, a, b)
    final_a, final_b = load_file(straight / WEIGHTS_FILE), load_file(resumed / WEIGHTS_FILE)
    assert final_a.keys() == final_b.keys()
    for key in final_a:  # fp32 Adam updates of the same values in the same order: a few ulps at most
        assert torch.allclose(final_b[key], final_a[key], rtol=1e-5, atol=1e-7), key
    assert not torch.equal(final_a[next(iter(final_a))], load_file(saved / WEIGHTS_FILE)[next(iter(final_a))])

    # across layouts: the dp2 save loads on tp2 and in one process with the same adapters and AdamW state
    inspect = ["train", "--resume", str(saved), *LORA, *FAST, "--steps", "4"]
    on_tp2 = _ok(pool2.run(cli_train, argv=[*inspect, "--tp", "2"], inspect=True))
    got = {}
    monkeypatch.setattr(trainer.Trainer, "run", lambda self: got.update(loaded_state(self)) or 0)
    assert main(inspect) == 0
    for res in on_tp2:
        for layout, state in (("tp2", res["loaded"]), ("one process", got)):
            assert state["step"] == 2, layout
            assert state["adapters"].keys() == got["adapters"].keys() and len(got["adapters"]) > 50
            for name, value in state["adapters"].items():
                assert torch.equal(value, got["adapters"][name]), (layout, name)
            assert state["optim"].keys() == got["adapters"].keys()
            for name, st in state["optim"].items():
                assert float(st["step"]) == 2.0, (layout, name)
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(st[k], got["optim"][name][k]), (layout, name, k)
    saved_b = load_file(saved / WEIGHTS_FILE)
    assert len(saved_b) == len(got["adapters"])
    assert any(got["optim"][n]["exp_avg"].abs().sum() > 0 for n in got["optim"])
