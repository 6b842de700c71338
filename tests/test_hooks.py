"""glm53.hooks on one process: each hook is the identity (or None) until one is installed, an installed hook
sees the module, the attribute name and the tensor and its result is what the model gets, and each setter hands
back the hook it replaced so a caller can restore it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from glm53 import hooks


def module() -> nn.Module:
    m = nn.Linear(3, 2, bias=False)
    nn.init.constant_(m.weight, 0.5)
    return m


# (setter, call made through the hook, what the installed hook returns for it)
HOOKS = {
    "param": (
        hooks.set_param_resolver,
        lambda m, x: hooks.as_local(m, "weight"),
        lambda mod, name, p: p * 2 if name == "weight" and mod.weight is p else None,
    ),
    "value": (hooks.set_value_resolver, lambda m, x: hooks.as_plain(x), lambda v: v + 1),
    "input": (
        hooks.set_input_resolver,
        lambda m, x: hooks.into_head_parallel(m, "weight", x),
        lambda mod, name, v: v * 3 if name == "weight" and isinstance(mod, nn.Linear) else None,
    ),
    "expert": (
        hooks.set_expert_dispatcher,
        lambda m, x: hooks.expert_dispatcher(m),
        lambda mod: lambda: mod.weight.sum(),
    ),
    "vocab": (
        hooks.set_vocab_parallel_loss,
        lambda m, x: hooks.vocab_parallel_loss(m),
        lambda mod: lambda: mod.weight.sum() - 1,
    ),
}
EXPECTED = {
    "param": torch.full((2, 3), 1.0),
    "value": torch.arange(1.0, 5.0),
    "input": torch.arange(0.0, 12.0, 3.0),
    "expert": torch.tensor(3.0),
    "vocab": torch.tensor(2.0),
}


@pytest.mark.parametrize("kind", HOOKS)
def test_installed_hook_is_used_and_the_previous_one_returned(kind):
    setter, call, hook = HOOKS[kind]
    m, x = module(), torch.arange(4.0)
    earlier = setter(None)  # start without a hook, whatever an earlier test (glm53.parallel.install) left
    try:
        assert call(m, x) is (None if kind in ("expert", "vocab") else m.weight if kind == "param" else x)
        assert setter(hook) is None
        out = call(m, x)
        torch.testing.assert_close(out() if callable(out) else out, EXPECTED[kind], rtol=0, atol=0)
        assert setter(None) is hook  # removing it hands it back
    finally:
        setter(earlier)
