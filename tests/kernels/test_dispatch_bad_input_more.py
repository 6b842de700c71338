"""use_backend given one op name as a string (not a list): a TypeError naming `ops`, not a KeyError about its
first letter; the forced choices are untouched. No tensors."""

import pytest

from glm53.kernels.dispatch import chosen_backend, use_backend


@pytest.mark.parametrize("ops", ["kda", "rms_norm", ""])
def test_ops_as_a_string(ops):
    before = chosen_backend("kda")
    with pytest.raises(TypeError, match=f"ops must be a list of op names or None, got the string {ops!r}"):
        with use_backend("reference", ops):
            pass
    assert chosen_backend("kda") == before
    with use_backend("reference", ["kda"]):
        assert chosen_backend("kda") == "reference"
