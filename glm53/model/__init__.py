"""The GLM-5.3-Flash text model as plain `nn.Module`s, one building block per file. It computes; the losses
(glm53/losses/, including the `labels=` model Glm53ForCausalLM) score. Nothing here imports glm53.losses.

    norm.py              RMSNorm, gated RMSNorm, LayerNorm
    mlp.py               clamped SwiGLU MLP
    moe.py               sigmoid group-limited router, fused routed experts, shared expert
    hyper_connection.py  mHC: N residual streams mixed around each block (Sinkhorn-projected)
    kda.py               Kimi Delta Attention layer (three causal convs, forget gate, gated output norm)
    indexer.py           DSA k-pool indexer (top-k key pools per query)
    mla.py               NoPE multi-head latent attention with top-k sparse attention
    block.py             decoder block (attention + MLP inside two mHC sites), `run_block`
    mtp.py               multi-token prediction layers
    model.py             Glm53Model, Glm53LMHeadModel (wiring: ids -> logits and per-layer statistics)
    inputs.py            input checks and the forward's one ForwardContext (`build_context`)
    attention_mass.py    the dense attention mass per indexer pool (the indexer KL's target statistic)
    balancing.py         expert-load counts and the aux-loss-free router-bias update
    context.py           ForwardContext (per-forward state for every block) and LayerStats
    compile.py           per-block torch.compile in place (`compile_blocks`, `compile_vision_blocks`)

Shape glossary (one meaning per letter; every file's legend in glm53/ uses these letters and no others):
    B batch                      T time (queries)                 S keys (where they differ from queries)
    D model width (hidden_size)  N mHC streams (hc_mult)          H heads (of MLA, KDA or the indexer)
    K query/key head width       V value head width (KDA; MLA v_head_dim)
    R q_lora_rank                Z kv_lora_rank (MLA's latent)    C KDA chunk length
    W causal-conv kernel width   E routed experts                 k experts per token
    G expert groups              I MLP inner width (intermediate_size; moe_intermediate_size in experts)
    M tokens flattened (B*T; token-expert pairs are M*k)
    P k-pools                    L tokens per pool (index_kpool)  J selected key slots per query
Derived sizes are written as expressions (T/C chunks, rounded up; N*D; (2+N)*N; 2I); `Tq` is a block of
queries processed at once; the vocabulary is written `vocab`. A file may define extra lowercase letters in its
own legend. Where a function's local variable names a dimension with another letter (`B, T, H, C = q.shape`), the
file's legend maps it to the glossary.
Suffixes on tensors that cross files name their layout (`topk_BTJ`).
"""

from .context import ForwardContext, LayerStats
from .model import Glm53LMHeadModel, Glm53Model, LMOutput

__all__ = ["ForwardContext", "Glm53LMHeadModel", "Glm53Model", "LayerStats", "LMOutput"]
