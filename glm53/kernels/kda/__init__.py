"""KDA (the gated delta rule with a per-channel forget gate): chunk.py holds the recurrent reference, the chunked
reference and the fast chunk kernel; decay.py the intra-chunk decayed products they share; recurrent.py the token-by-token form for short inputs
(decode and verify steps), returning every state."""

from . import fla_backend  # noqa: F401  (registers "fla" when flash-linear-attention is installed)
from .chunk import DEFAULT_CHUNK_SIZE, kda_chunk, kda_chunk_reference, kda_recurrent_reference, l2norm
from .recurrent import kda_recurrent_states

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "kda_chunk",
    "kda_chunk_reference",
    "kda_recurrent_reference",
    "kda_recurrent_states",
    "l2norm",
]
