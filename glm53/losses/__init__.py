"""The losses: what turns the model's outputs (glm53.model.LMOutput) into `.loss` and its parts.

    parts.py       next-token cross-entropy (chunked head + loss), MoE balance and z-loss, DSA indexer KL rows
    indexer_kl.py  the indexer KL terms per full indexer layer, recomputed per query block from O(T) inputs
    counts.py      LossCounts: each part's denominator counted from the batch alone (accumulation, data parallel)
    cp_balance.py  the per-document balance loss under context parallelism
    causal_lm.py   Glm53ForCausalLM: the computing model plus these losses (transformers' `labels=` call)

glm53.model never imports this package; parallel and training build on it (tests/test_layout.py).
"""

from .causal_lm import CausalLMOutput, Glm53ForCausalLM, add_causal_lm_losses
from .counts import LossCounts, count_loss_terms, document_spans, indexer_query_rows, mtp_views
from .indexer_kl import indexer_kl_terms, recomputed_indexer_kl
from .parts import (
    IGNORE_INDEX,
    balance_loss,
    causal_lm_head_loss,
    causal_lm_loss,
    chunked_pool_kl,
    head_target_loss,
    next_token_targets,
    normalized_target,
    per_term,
    pool_kl,
    router_aux_loss,
    sharded_balance_loss,
    z_loss,
)

__all__ = [
    "IGNORE_INDEX",
    "CausalLMOutput",
    "Glm53ForCausalLM",
    "LossCounts",
    "add_causal_lm_losses",
    "balance_loss",
    "causal_lm_head_loss",
    "causal_lm_loss",
    "chunked_pool_kl",
    "count_loss_terms",
    "document_spans",
    "head_target_loss",
    "indexer_kl_terms",
    "indexer_query_rows",
    "mtp_views",
    "next_token_targets",
    "normalized_target",
    "per_term",
    "pool_kl",
    "recomputed_indexer_kl",
    "router_aux_loss",
    "sharded_balance_loss",
    "z_loss",
]
