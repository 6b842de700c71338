"""The torch.compile boundary of the fast kernels.

Fast kernels whose Python control flow depends on the data (KDA's rebasing check, the absorbed attention's key
span) run as `torch.library` custom ops: opaque to torch.compile, with a fake implementation giving the output
shapes, and their hand-written backward registered as the op's autograd formula (itself a custom op, so the
compiled backward graph stays whole too). Eager behaviour and numerics are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Re-enable autograd inside a custom op's implementation (which runs below the autograd dispatch keys).

    For backward formulas that differentiate a recomputed forward (the KDA fallback for steep decays and
    single-token steps): without this, tensors made inside the op never require grad.
    """
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set().remove(C.DispatchKey.AutogradFunctionality)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


__all__ = ["autograd_inside_op"]
