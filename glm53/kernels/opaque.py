"""The torch.compile boundary of the fast kernels.

Fast kernels whose Python control flow depends on the data (KDA's rebasing check, the absorbed attention's key
span) run as `torch.library` custom ops: opaque to torch.compile, with a fake implementation giving the output
shapes, and their hand-written backward registered as the op's autograd formula (itself a custom op, so the
compiled backward graph stays whole too). Eager behaviour and numerics are unchanged.

CUDA graphs: a custom op whose implementation reads device values on the host (a `.tolist()` of key spans, a
`nonzero` of document edges, the KDA path check when the gate is unbounded) cannot be captured in a CUDA graph
(the read would be frozen at capture time, or fail). Those ops carry `HOST_READING` (torch.Tag.cudagraph_unsafe).
Under torch.compile(mode="reduce-overhead") inductor's CUDA-graph trees then skip graphs holding such an op, or,
with inductor's graph partitioning turned on (the inductor config option `graph_partition`; set by the user, never
by glm53), split the graph around each tagged op and capture the partitions between them, running the tagged ops
eagerly. Ops without host reads (grouped_mm, indexer_scores, conv_taps_as_rows, the "static" sparse attention
ops of kernels/sparse_static.py that generation steps run) stay capturable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

HOST_READING = (torch.Tag.cudagraph_unsafe,)  # tags of the custom ops that read device values on the host


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


__all__ = ["HOST_READING", "autograd_inside_op"]
