"""Operating a run: run.toml (--config, resume inherits and checks it, --override), metrics.jsonl and TensorBoard,
the torch schedule (exact resume, --total-steps), decay groups, single-process bf16 with fp32 masters, --keep-last,
disk-full saves, and SIGTERM / SIGINT on a running `glm53 train`. Legend: no tensors beyond parameters."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.__main__ import main
from glm53.training import metrics as metrics_mod
from glm53.training import optim
from glm53.training.announce import dtype_text
from glm53.training.cli import add_arguments
from glm53.training.metrics import METRICS, flops_per_token, mfu
from glm53.training.state import TRAINER_STATE
from glm53.training.trainer import PRESETS, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["train", "--preset", "tiny", "--batch-size", "1", "--seq-len", "16", "--log-every", "1", "--lr", "1e-2"]


def lines(run) -> list[dict]:
    return [json.loads(line) for line in (run / METRICS).read_text().splitlines()]


def step_of(path) -> int:
    return torch.load(path / TRAINER_STATE, weights_only=True)["step"]


# ----------------------------------------------------------------------------------------------- run.toml
def test_config_file_flags_override_and_resume_checks(tmp_path, capsys):
    config, run = tmp_path / "run.toml", tmp_path / "run"
    config.write_text(
        "seed = 3\nseq-len = 16\nbatch_size = 1\nsteps = 2\nlog-every = 1\nlr = 0.01\nbetas = [0.8, 0.9]\n"
    )
    assert main(["train", "--config", str(config), "--steps", "3", "--save", str(run)]) == 0
    saved = (run / "run.toml").read_text()
    assert "seed = 3" in saved and "steps = 3" in saved and "betas = [0.8, 0.9]" in saved  # the flag won
    assert step_of(run) == 3
    capsys.readouterr()
    # a changed seed is another data order: refused, naming the key and the way out
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", str(run), "--steps", "4", "--seed", "4"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--seed 4 differs from the run's 3" in err and "--override seed" in err
    # without --save the run continues into the resumed directory; the seed and the rest come from run.toml
    assert main(["train", "--resume", str(run), "--steps", "4", "--log-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "saving into the resumed directory" in out and "changed on resume: --log-every: 1 -> 2" in out
    assert step_of(run) == 4 and "seed = 3" in (run / "run.toml").read_text()
    assert main(["train", "--resume", str(run), "--steps", "5", "--seed", "4", "--override", "seed"]) == 0
    assert "--seed: 3 -> 4 (--override)" in capsys.readouterr().out
    assert [m["step"] for m in lines(run)] == [1, 2, 3, 4, 5]  # one metrics file for the whole run


@pytest.mark.parametrize(
    "text,message",
    [
        ("sed = 1\n", "unknown key 'sed'"),
        ("steps = -1\n", "steps = -1: must be >= 1"),
        ("steps = [1, 2]\n", "steps takes one value"),
        ("bf16 = 1\n", "bf16 must be true or false"),
        ("schedule = 'cosin'\n", "expected one of cosine, linear, constant"),
        ("steps = \n", "not valid TOML"),
        ("seq-len = 8\nseq_len = 9\n", "given twice"),
    ],
)
def test_bad_config_file_is_a_usage_error_naming_the_key(tmp_path, capsys, text, message):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["train", "--config", str(config)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--save", "--resume", "--init", "--data", "--config"])
def test_empty_paths_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", flag, ""])
    assert info.value.code == 2 and "empty path" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ metrics
def test_metrics_file_fields_and_values(tmp_path, monkeypatch):
    norms = []
    real = torch.nn.utils.clip_grad_norm_

    def recording(*a, **k):
        norms.append(float(real(*a, **k)))
        return torch.tensor(norms[-1])

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    run = tmp_path / "run"
    assert main(SMALL + ["--steps", "3", "--save", str(run), "--peak-tflops", "0.5", "--grad-clip", "0.5"]) == 0
    got = lines(run)
    assert [m["step"] for m in got] == [1, 2, 3]
    assert [m["grad_norm"] for m in got] == norms  # the norm before clipping, clip_grad_norm_'s return
    assert norms[0] > 0.5  # the case clips, so a clipped norm (0.5) would differ
    model = Glm53ForCausalLM(PRESETS["tiny"]())
    for m in got:
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss", "lr", "peak_memory_bytes", "time"):
            assert key in m, key
        assert m["tokens"] == 16 and m["padding"] == 0.0 and m["tokens_per_s"] > 0
        assert m["tokens_per_s_rank"] == [m["tokens_per_s"]]
        assert m["flops_per_token"] == flops_per_token(model)
        assert m["mfu"] == pytest.approx(m["flops_per_token"] * m["tokens_per_s"] / 0.5e12, rel=1e-12)
        assert 0 <= m["expert_load_min"] <= m["expert_load_mean"] <= m["expert_load_max"]
        # top-k choices per token over the routed experts: 3 MoE layers route 16 tokens, the MTP layer 15 (the
        # last token has no MTP target)
        cfg = model.config
        mean = (3 * 16 + 15) / 4 * cfg.num_experts_per_tok / cfg.n_routed_experts
        assert m["expert_load_mean"] == pytest.approx(mean, rel=1e-12)
    assert got[0]["lr"] == pytest.approx(optim.lr_at(1, 3, 1e-2))


def test_flops_per_token_on_a_known_config():
    model = Glm53ForCausalLM(PRESETS["tiny"]())
    cfg = model.config
    expected = 0
    for name, p in model.named_parameters():  # every matrix but the embedding; routed experts at top-k / E
        if p.dim() >= 2 and "embed_tokens" not in name:
            expert = "experts.gate_up_proj" in name or "experts.down_proj" in name
            expected += p.numel() * cfg.num_experts_per_tok // cfg.n_routed_experts if expert else p.numel()
    assert flops_per_token(model) == 6 * expected
    assert mfu(1000, 2.0, 4000.0) == 0.5 and mfu(1000, 2.0, None) is None


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert main(SMALL + ["--steps", "2", "--save", str(run), "--tensorboard"]) == 0
    acc = EventAccumulator(str(run / metrics_mod.TENSORBOARD_DIR))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert losses == [(m["step"], pytest.approx(m["loss"], rel=1e-6)) for m in lines(run)]
    assert "train/grad_norm" in acc.Tags()["scalars"]


# ------------------------------------------------------------------------------------------ optimisation
def test_decay_groups_follow_the_one_list():
    model = Glm53ForCausalLM(PRESETS["tiny"]())
    groups = optim.param_groups(model, 0.1)
    ids = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert len(ids) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        no_decay = p.dim() == 1 or "_hc." in name or name.endswith("mlp.gate.weight")  # norms, biases, A_log,
        assert ids[id(p)] == (0.0 if no_decay else 0.1), name  # dt_bias, mHC base/scale/fn, the router gate
    assert not any("e_score_correction_bias" in n for n, _ in model.named_parameters())  # a buffer: never decayed


def test_schedule_resumes_exactly_and_total_steps_is_the_schedule(tmp_path, capsys):
    straight, part = tmp_path / "straight", tmp_path / "part"
    common = ["--warmup", "2", "--total-steps", "6", "--schedule", "linear", "--min-lr", "1e-3"]
    assert main(SMALL + common + ["--steps", "6", "--save", str(straight)]) == 0
    assert main(SMALL + common + ["--steps", "3", "--save", str(part)]) == 0
    assert main(["train", "--resume", str(part), "--steps", "8"]) == 0  # --steps does not stretch the schedule
    want = [optim.lr_at(s, 6, 1e-2, warmup=2, floor=0.1, kind="linear") for s in range(1, 9)]
    got = [m["lr"] for m in lines(part)]
    assert got[:6] == [m["lr"] for m in lines(straight)]
    assert got == pytest.approx(want, rel=1e-12) and got[-1] == pytest.approx(1e-3)
    assert [m["loss"] for m in lines(part)][:6] == pytest.approx([m["loss"] for m in lines(straight)], rel=1e-5)
    assert "scheduler" in torch.load(part / TRAINER_STATE, weights_only=True)


# ------------------------------------------------------------------------------------- precision / device
def test_bf16_one_process_keeps_fp32_masters(tmp_path, capsys):
    init = tmp_path / "bf16"
    Glm53ForCausalLM(PRESETS["tiny"]()).save_pretrained(init, dtype=torch.bfloat16)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--init", str(init), "--bf16", "--steps", "1", "--batch-size", "1", "--seq-len", "8"])
    trainer = Trainer.__new__(Trainer)  # the model, optimizer and step of a Trainer, without a data file
    trainer.args, trainer.par, trainer.device, trainer.autocast, trainer.state = args, None, "cpu", torch.bfloat16, None
    trainer.vl_record = None  # a text run
    model = Glm53ForCausalLM.from_pretrained(init)
    assert torch.bfloat16 in {p.dtype for p in model.parameters()}  # (a keep-list stays fp32)
    model = Trainer._build_model(trainer)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # fp32 masters, whatever the file holds
    assert "trained as fp32 masters" in dtype_text(trainer) and "bf16 compute" in dtype_text(trainer)
    trainer.model, trainer.optimizer = model, optim.build_optimizer(model, args)
    trainer.scheduler = optim.build_scheduler(trainer.optimizer, args)
    ids = torch.randint(1, 256, (1, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the step runs under: bf16 compute
        assert (
            model.model.embed_tokens(ids).dtype == torch.float32
            and model.lm_head(torch.ones(1, 32)).dtype == torch.bfloat16
        )
    before = [p.detach().clone() for p in model.train().parameters()]  # (Trainer.__init__ sets train mode)
    Trainer.step(trainer, 1, [dict(input_ids=ids, labels=ids)])
    states = [s for s in trainer.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
    moved = [(p - b).abs().max() for p, b in zip(model.parameters(), before) if p.grad is not None]
    # a 1e-2 Adam step on fp32 masters moves weights by ~lr; a bf16 weight near 1 could not move by < 4e-3
    assert max(moved) > 0 and all(p.dtype == torch.float32 for p in model.parameters())


def test_cuda_without_a_gpu_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: benchmarks/gpu_check.py covers --device cuda")
    with pytest.raises(SystemExit, match="no CUDA device"):
        main(SMALL + ["--steps", "1", "--device", "cuda"])


# ------------------------------------------------------------------------------------------------ saving
def test_keep_last_and_a_failing_final_save_keeps_the_earlier_checkpoint(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert main(SMALL + ["--steps", "5", "--save", str(run), "--save-every", "1", "--keep-last", "2"]) == 0
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-3", "step-4"]
    from glm53.training import trainer as trainer_mod

    real, calls = trainer_mod.save_run, []

    def full_disk(model, path, *a, **k):
        calls.append(path)
        if not str(path).endswith("step-1"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(model, path, *a, **k)

    monkeypatch.setattr(trainer_mod, "save_run", full_disk)
    other = tmp_path / "other"
    assert main(SMALL + ["--steps", "2", "--save", str(other), "--save-every", "1"]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and f"the last complete checkpoint is {other / 'step-1'}" in err
    assert step_of(other / "step-1") == 1 and "Traceback" not in err


def test_a_checkpoint_appearing_in_save_during_the_run_is_not_replaced(tmp_path, monkeypatch, capsys):
    from glm53.training import trainer as trainer_mod

    run, foreign = tmp_path / "run", tmp_path / "foreign"
    assert main(SMALL + ["--steps", "1", "--save", str(foreign)]) == 0
    real = trainer_mod.Trainer.step

    def step_then_intrude(self, step, micro):
        out = real(self, step, micro)
        if step == 1:  # another job writes its checkpoint into --save DIR mid-run
            for name in ("config.json", "model.safetensors", "trainer_state.pt", "run.toml"):
                os.replace(foreign / name, run / name)
        return out

    monkeypatch.setattr(trainer_mod.Trainer, "step", step_then_intrude)
    assert main(SMALL + ["--steps", "2", "--save", str(run)]) == 0
    err = capsys.readouterr().err
    assert "holds a checkpoint this run did not write" in err
    assert step_of(run) == 1  # the other job's checkpoint is intact
    beside = [p for p in tmp_path.iterdir() if p.name.startswith("run.step-2-")]
    assert len(beside) == 1 and step_of(beside[0]) == 2


# ------------------------------------------------------------------------------------------------ signals
@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["TERM", "INT"])
def test_signal_finishes_the_step_saves_and_resumes(tmp_path, sig, status):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "glm53", *SMALL, "--steps", "100000", "--save", str(run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step     2"):
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    last = max(int(line.split()[1]) for line in seen + out.splitlines() if line.startswith("step "))
    assert step_of(run) == last >= 2  # the step in flight was finished, then saved
    assert f"saved {run}" in err and "Traceback" not in err
    assert main(["train", "--resume", str(run), "--steps", str(last + 1)]) == 0
    assert step_of(run) == last + 1


def test_lr_is_finite_everywhere():
    for kind in optim.SCHEDULES:
        assert all(math.isfinite(optim.lr_at(s, 10, 1.0, kind=kind)) for s in range(1, 20))


@pytest.mark.parametrize("rank", ["0", "1"])
def test_ep_that_does_not_divide_the_experts_is_one_line_from_rank_0(monkeypatch, capsys, rank):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as info:  # before any process group: the tiny preset has 8 routed experts
        main(SMALL + ["--steps", "1", "--ep", "3"])
    if rank == "0":
        assert "--ep 3 does not divide the 8 routed experts" in str(info.value.code)
    else:
        assert info.value.code == 1  # the other ranks exit quietly: one message, not one per rank


def test_one_process_save_replaces_a_torchrun_train_state(tmp_path):
    from glm53.training.state import save_single

    run = tmp_path / "run"
    (run / "train_state").mkdir(parents=True)
    (run / "train_state" / "__0_0.distcp").write_bytes(b"old")
    (run / "notes.txt").write_text("mine")
    model = Glm53ForCausalLM(PRESETS["tiny"]())
    opt = torch.optim.AdamW(model.parameters())
    save_single(
        model,
        str(run),
        {
            "step": 3,
            "optimizer": opt.state_dict(),
            "data_rng": torch.get_rng_state(),
            "torch_rng": torch.get_rng_state(),
        },
    )
    assert not (run / "train_state").exists()  # a later resume cannot pick the older DCP state
    assert (run / "notes.txt").read_text() == "mine" and step_of(run) == 3


class FileTokenizer:
    """A stand-in tokenizer whose files are fixed bytes (run_files reads only .path and .save)."""

    def __init__(self, path: str, content: bytes) -> None:
        self.path, self.content = path, content

    def save(self, path: str) -> None:
        with open(os.path.join(path, "tokenizer.json"), "wb") as f:
            f.write(self.content)


def test_tokenizer_files_are_never_written_through_a_link(tmp_path):
    """--save DIR/tokenizer.json as a symlink: to other bytes or dangling it is refused before any work; to the same
    bytes it is left as it is by the save (the file it points to is never rewritten or replaced)."""
    from glm53.training.run_files import check_tokenizer_files, write_tokenizer

    tok = FileTokenizer(str(tmp_path / "source"), b'{"mine": 1}')
    outside = tmp_path / "outside.json"
    run = tmp_path / "run"
    run.mkdir()
    for content in (b'{"theirs": 2}', None):  # a link to another tokenizer's file, a dangling link
        (run / "tokenizer.json").unlink(missing_ok=True)
        outside.unlink(missing_ok=True)
        if content is not None:
            outside.write_bytes(content)
        (run / "tokenizer.json").symlink_to(outside)
        with pytest.raises(SystemExit, match=r"holds a tokenizer\.json that is not this run's"):
            check_tokenizer_files(tok, str(run))
    outside.write_bytes(tok.content)
    check_tokenizer_files(tok, str(run))  # the same bytes behind the link: accepted
    before = os.stat(outside)
    tok.content = b'{"changed": 3}'  # were the save to write through the link, this would land in outside.json
    write_tokenizer(tok, str(run))
    assert (run / "tokenizer.json").is_symlink() and outside.read_bytes() == b'{"mine": 1}'
    assert os.stat(outside).st_mtime_ns == before.st_mtime_ns
