"""Mixture of experts: sigmoid group-limited router, fused routed experts, one shared expert.

Legend: M tokens (B * T flattened), D model width, E routed experts, G expert groups, k experts per token,
I expert width. Routing follows transformers' Glm5NextTextTopkRouter (DeepSeek-V3 style): fp32 logits, sigmoid
scores; the choice adds `e_score_correction_bias` (the aux-loss-free balancing bias) and keeps the `topk_group`
groups whose two best biased scores sum highest; the weights are the chosen experts' unbiased scores,
renormalised if `norm_topk_prob`, times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Glm53Config
from ..hooks import as_local, expert_dispatcher, local_parts
from ..kernels import kernel_op
from ..kernels.moe import FEW_TOKEN_PAIRS
from .context import ForwardContext
from .mlp import MLP

# kernels resolved once; use_backend keeps them current (kernels/dispatch.py). A step on a generation cache with at
# most FEW_TOKEN_PAIRS (token, expert) pairs prefers the few-token form: no host read (kernels/moe.py).
moe_experts = kernel_op("moe_experts")
moe_experts_few_token = kernel_op("moe_experts", prefer="few_token")

NORM_EPS = 1e-20  # added to the sum of the chosen scores before renormalising (transformers)


class Router(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.initializer_range = config.initializer_range
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        # Tokens routed to each expert [E] by the training-mode forwards since the last bias update; consumed by
        # Glm53ForCausalLM.update_router_bias (aux-loss-free balancing). Not state: never saved.
        self.counted_load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, D] -> (logits [M, E] fp32, weights [M, k] fp32, indices [M, k])."""
        logits = F.linear(x.float(), as_local(self, "weight").float())
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = biased.view(-1, self.n_group, self.num_experts // self.n_group)  # [M, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [M, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False).indices, True)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, self.num_experts)
        indices = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + NORM_EPS)
        return logits, weights * self.routed_scaling_factor, indices

    def init_weights(self) -> None:
        nn.init.normal_(self.weight, std=self.initializer_range)
        self.e_score_correction_bias.zero_()


class Experts(nn.Module):
    """E clamped-SwiGLU experts stored as two 3-D parameters, run by the `moe_experts` kernel."""

    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))  # [E, 2I, D]: gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(E, D, I))  # [E, D, I]
        self.swiglu_limit = config.swiglu_limit
        self.initializer_range = config.initializer_range

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, few_token: bool = False
    ) -> torch.Tensor:
        """x [M, D], indices and weights [M, k] -> [M, D]; `few_token`: the few-token kernel (generation steps)."""
        # The base tensors and their LoRA terms, if any (glm53.peft): the kernel runs the low-rank terms through
        # the same grouped matmuls, never as a dense [E, out, in] delta.
        (gate_up, gate_up_lr), (down, down_lr) = local_parts(self, "gate_up_proj"), local_parts(self, "down_proj")
        lora = {} if gate_up_lr is None and down_lr is None else {"lora": (gate_up_lr, down_lr)}
        # Under expert parallelism gate_up/down are this rank's experts and the dispatcher moves tokens to them.
        run = expert_dispatcher(self) or (moe_experts_few_token if few_token else moe_experts)
        return run(x, indices, weights, gate_up, down, self.swiglu_limit, **lora)

    def init_weights(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=self.initializer_range)
        nn.init.normal_(self.down_proj, std=self.initializer_range)


class MoE(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = MLP(config, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. With `ctx.stats`, records the router logits and choices for the balance
        losses and expert loads."""
        stats = ctx.stats if ctx is not None else None
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, indices = self.gate(flat)
        if stats is not None:
            stats.router_logits, stats.router_indices = logits, indices
        few_token = ctx is not None and ctx.cache is not None and indices.numel() <= FEW_TOKEN_PAIRS
        routed = self.experts(flat, indices, weights, few_token).view_as(x)
        return routed + self.shared_experts(x)

    def init_weights(self) -> None:
        self.gate.init_weights()
        self.experts.init_weights()
        self.shared_experts.init_weights()
