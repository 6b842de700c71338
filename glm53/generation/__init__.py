"""Generation: the cache (KDA states and conv histories, the MLA latent, the indexer's pooled keys), `generate`
with greedy or sampled decoding, and MTP speculative decoding.

    cache.py        GenerationCache (rides on ForwardContext.cache), per-layer caches, mark / rewind, nbytes
    layers.py       cached forwards of the KDA and MLA layers (prefill with the chunked kernels, decode steps)
    decode.py       decode_step: one token per row through the whole model (what generate runs after the prompt)
    decode_compiled.py  the same step through torch.compile'd graphs (generate(..., compile=True))
    verify.py       verify_step: T tokens per row the same way (speculative verification), the MTP layer's step
    verify_compiled.py, mtp_compiled.py  the verify and MTP draft steps through compiled graphs (compile=True)
    sampling.py     temperature / top-k / top-p filters and the next-token choice
    emit.py         options, EOS / padding per row and the streamer, GenerationStats
    loop.py         generate(model, input_ids, ...): prefill then one token per step
    speculative.py  MTP drafts verified k + 1 tokens per forward (greedy)
    cli.py          `python -m glm53 generate`

Use `Glm53ForCausalLM.generate(...)` or `glm53.generation.generate(model, ...)`.
"""

from .cache import CacheError, GenerationCache, GenerationError
from .decode import decode_step
from .emit import GenerationStats
from .loop import generate
from .sampling import allowed_logits, next_tokens
from .verify import verify_step

__all__ = ["CacheError", "GenerationCache", "GenerationError", "GenerationStats", "allowed_logits", "decode_step",
           "generate", "next_tokens", "verify_step"]  # fmt: skip
