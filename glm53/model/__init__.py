"""The GLM-5.3-Flash text model as plain `nn.Module`s, one building block per file.

    norm.py              RMSNorm, gated RMSNorm, LayerNorm
    mlp.py               clamped SwiGLU MLP
    moe.py               sigmoid group-limited router, fused routed experts, shared expert
    hyper_connection.py  mHC: N residual streams mixed around each block (Sinkhorn-projected)
    kda.py               Kimi Delta Attention layer (three causal convs, forget gate, gated output norm)
    indexer.py           DSA k-pool indexer (top-k key pools per query)
    mla.py               NoPE multi-head latent attention with top-k sparse attention
    block.py             decoder block (attention + MLP inside two mHC sites), `run_block`
    mtp.py               multi-token prediction layers
    model.py             Glm53Model, Glm53ForCausalLM (wiring, losses, router-bias update)
    context.py           ForwardContext (per-forward state for every block) and LayerStats

Shape glossary (one meaning per letter, used by every file's legend in glm53/):
    B batch                T time (queries)              S keys (when they differ from queries)
    D model width          V vocabulary                  N mHC streams (hc_mult)
    H heads                K key / head width            (KDA: K key width, V value width per head)
    F value head width (MLA)                            C kv_lora_rank latent width; KDA chunk length in kernels
    R q_lora_rank          E experts                     k experts per token
    G expert groups        I expert (intermediate) width M tokens routed (flattened B*T or B*T*k)
    P k-pools              L tokens per pool (index_kpool)   J selected key slots per query
Suffixes on tensors that cross files name their layout (`topk_BTJ`).
"""

from .context import ForwardContext, LayerStats
from .model import CausalLMOutput, Glm53ForCausalLM, Glm53Model

__all__ = ["CausalLMOutput", "ForwardContext", "Glm53ForCausalLM", "Glm53Model", "LayerStats"]
