"""Generation: `generate` with greedy or sampled decoding and MTP speculative decoding, through the model's own
blocks on a GenerationCache (glm53/model/cache.py: the buffers; model/kda.py, mla.py, indexer.py: the cache paths).

    step.py         the one step: prefill, decode (T = 1), verify (T = k + 1), the MTP draft; eager or compiled
    sampling.py     temperature / top-k / top-p filters and the next-token choice
    emit.py         options, EOS / padding per row and the streamer, GenerationStats
    checks.py       type, device and value checks of generate's arguments
    loop.py         generate(model, input_ids, ...): prefill then one token per step
    speculative.py  MTP drafts verified k + 1 tokens per forward (greedy)
    cli.py          `python -m glm53 generate`

Use `Glm53ForCausalLM.generate(...)` or `glm53.generation.generate(model, ...)`.
"""

from ..model.cache import CacheError, GenerationCache
from .emit import GenerationStats
from .loop import generate
from .sampling import allowed_logits, next_tokens
from .step import GenerationError, Stepper, step

__all__ = [
    "CacheError",
    "GenerationCache",
    "GenerationError",
    "GenerationStats",
    "Stepper",
    "allowed_logits",
    "generate",
    "next_tokens",
    "step",
]
