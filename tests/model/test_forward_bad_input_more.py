"""Glm53ForCausalLM.forward: document boundaries and loss denominators of the wrong type or on the meta device
name the argument (they failed in a host read or an attribute lookup). Legend: B batch, T time."""

import pytest
import torch

from glm53 import Glm53ForCausalLM
from glm53.config import Glm53Config
from glm53.errors import InputError

B, T = 2, 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Glm53ForCausalLM(Glm53Config.tiny()).eval()


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
