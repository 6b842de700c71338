"""Bad forward inputs raise InputError (TypeError for a non-tensor) naming the argument and the culprit.

Glm53ForCausalLM.forward: document boundaries and loss denominators of the wrong type or on the meta device
name the argument (they failed in a host read or an attribute lookup). Legend: B batch, T time.
"""

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.errors import InputError


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Glm53ForCausalLM(Glm53Config.tiny()).eval()


IDS = torch.tensor([[1, 2, 3, 4]])
CASES = {
    "oov-high": (
        dict(input_ids=torch.tensor([[1, 2, 320]])),
        InputError,
        r"input_ids holds 320, outside \[0, vocab_size=320\)",
    ),
    "oov-negative": (dict(input_ids=torch.tensor([[1, -3]])), InputError, r"input_ids holds -3, .*vocab_size=320"),
    "T0": (dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), InputError, r"input_ids is empty \(shape \(2, 0\)\)"),
    "B0": (dict(input_ids=torch.zeros(0, 5, dtype=torch.long)), InputError, r"input_ids is empty \(shape \(0, 5\)\)"),
    "float-ids": (dict(input_ids=IDS.float()), InputError, r"input_ids must hold integer token ids.*float32"),
    "uint8-ids": (dict(input_ids=IDS.to(torch.uint8)), InputError, r"input_ids must hold integer token ids.*uint8"),
    "list": (dict(input_ids=[[1, 2, 3]]), TypeError, r"input_ids must be a torch.Tensor .* got list"),
    "meta-ids": (dict(input_ids=IDS.to("meta")), InputError, r"input_ids is on the meta device .* the model is on cpu"),
    "meta-mask": (
        dict(input_ids=IDS, attention_mask=torch.ones(1, 4, device="meta")),
        InputError,
        r"attention_mask is on the meta device .* the model is on cpu",
    ),
    "embeds-dtype": (
        dict(inputs_embeds=torch.randn(1, 4, 32, dtype=torch.float64)),
        InputError,
        r"inputs_embeds is torch.float64 but the model's embeddings are torch.float32",
    ),
    "embeds-width": (
        dict(inputs_embeds=torch.randn(1, 4, 31)),
        InputError,
        r"inputs_embeds must be \[batch, seq, hidden_size=32\], got shape \(1, 4, 31\)",
    ),
    "embeds-meta": (
        dict(inputs_embeds=torch.randn(1, 4, 32, device="meta")),
        InputError,
        r"inputs_embeds is on the meta device .* cpu",
    ),
    "embeds-T0": (dict(inputs_embeds=torch.randn(1, 0, 32)), InputError, r"inputs_embeds is empty"),
    "labels-oov": (
        dict(input_ids=IDS, labels=torch.tensor([[1, 2, 999, -100]])),
        InputError,
        r"labels holds 999, outside \[0, vocab_size=320\) or -100",
    ),
}


@pytest.mark.parametrize("kwargs,error,message", CASES.values(), ids=CASES.keys())
def test_bad_inputs_name_the_argument(model, kwargs, error, message):
    with pytest.raises(error, match=message):
        model(**kwargs)


def test_other_device_names_both_devices(model, monkeypatch):
    # No second device on a CPU machine: pretend the model lives on cuda:1.
    from glm53.model import inputs

    monkeypatch.setattr(inputs, "_device_matches", lambda found, expected: False)
    with pytest.raises(InputError, match=r"input_ids is on cpu but the model is on cpu"):
        model(IDS)


def test_dtype_as_a_string(tmp_path, model):
    model.save_pretrained(tmp_path / "ckpt")
    loaded = Glm53ForCausalLM.from_pretrained(tmp_path / "ckpt", dtype="bfloat16")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    fp64 = Glm53ForCausalLM.from_pretrained(tmp_path / "ckpt", dtype="torch.float64")
    assert fp64.lm_head.weight.dtype == torch.float64
    for bad, message in (
        (5, r"dtype must be a torch.dtype or its name, got 5"),
        ("bfloat17", r"dtype='bfloat17' is not a torch dtype name"),
        (torch.int8, r"dtype must be a floating dtype .* got torch.int8"),
    ):
        with pytest.raises(TypeError, match=message):
            Glm53ForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=bad)


def test_stored_config_dtype_must_be_floating(tmp_path, model):
    import json

    model.save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["dtype"] = config["text_config"]["dtype"] = "int64"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    from glm53.errors import ConfigError

    with pytest.raises(ConfigError, match=r"config.json: dtype must be a floating dtype .* got torch.int64"):
        Glm53ForCausalLM.from_pretrained(tmp_path / "ckpt")


# ---------------------------------------------------------------------------- document boundaries and loss denominators
B, T = 2, 8


CU = torch.tensor([0, 3, 8, 16])
POS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * B)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(cu_seqlens=CU.tolist()), TypeError, "cu_seqlens must be a torch.Tensor .* got list"),
        (dict(cu_seqlens=CU.numpy()), TypeError, "cu_seqlens must be a torch.Tensor .* got ndarray"),
        (dict(cu_seqlens=CU.to("meta")), InputError, "cu_seqlens is on the meta device"),
        (dict(position_ids=POS.tolist()), TypeError, "position_ids must be a torch.Tensor .* got list"),
        (dict(position_ids=POS.to("meta")), InputError, "position_ids is on the meta device"),
        (dict(labels=POS, loss_denominators=3), TypeError, "loss_denominators must be a LossCounts .* got int"),
        (dict(labels=POS, loss_denominators={"lm": 3}), TypeError, "loss_denominators must be a LossCounts"),
    ],
)
def test_bad_boundaries_and_denominators(model, kwargs, error, match):
    ids = torch.randint(1, 320, (B, T))
    with pytest.raises(error, match=match):
        model(ids, **kwargs)


def test_good_forms_still_run(model):
    ids = torch.randint(1, 320, (B, T))
    with torch.no_grad():
        assert model(ids, cu_seqlens=CU).logits.shape == (B, T, 320)
        out = model(ids, position_ids=POS, labels=POS, loss_denominators=model.loss_counts(POS, None, POS))
        assert torch.isfinite(out.loss)
