"""Glm53Model and Glm53LMHeadModel: embedding -> N mHC streams -> decoder blocks -> stream mean -> norm -> head.

Legend: B batch, T time, N streams (hc_mult), D model width, vocab the vocabulary size.
The model computes; the losses score (docs/architecture.md). `Glm53LMHeadModel.forward` returns an `LMOutput`:
the logits, the last hidden state, and on request the per-layer statistics (router logits and choices, indexer
scores, candidate pools and attention mass; `LayerStats`) and the MTP depths' hidden states. It imports nothing
from glm53.losses or glm53.training: `glm53.losses.Glm53ForCausalLM` (the transformers-style `labels=` call) is
this model plus its losses.
`attention_mask` is a 2-D padding mask [B, T] (1 = token, 0 = padding; left or right padding). KDA layers zero
padded inputs and the indexer never selects padded keys, so valid positions do not depend on padding.

Top-k sharing: a layer whose indexer type is "shared" reuses the most recent "full" layer's selection, also
across KDA layers in between. (transformers only hands top-k to the directly following attention layer and
raises otherwise; where both run, they agree.)

Per-forward state reaches the blocks in one `ForwardContext` (context.py), built once per forward
(`build_context`, inputs.py). Training-mode forwards count expert loads for `update_router_bias` (balancing.py).
`return_logits=False` (what training loops pass) skips the logits, `out.logits` is then None.
`gradient_checkpointing_enable()` recomputes every decoder block (mHC coefficients included) in backward.
Packed documents: `cu_seqlens` (input_ids [1, total], or [B, T] with boundaries over the flattened tokens) or
`position_ids` restarting at 0 per document; each document is computed as if alone (model/packing.py).
Context parallelism: `cp=` (a SequenceShards) runs this rank's slice of every sequence (model/cp.py); the
inputs come from glm53.parallel.context_parallel_inputs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..checkpoint.convert import from_transformers
from ..checkpoint.load import load_checkpoint
from ..checkpoint.save import save_checkpoint
from ..config import Glm53Config
from ..hooks import compute_dtype
from ..precision import cast_model, resolve_device, resolve_dtype
from . import balancing
from .block import DecoderBlock, run_block
from .context import ForwardContext, LayerStats, SequenceShards
from .hyper_connection import HyperConnection, collapse_streams, expand_streams
from .inputs import build_context, check_inputs_embeds, check_token_ids
from .mla import MultiHeadLatentAttention
from .moe import MoE, Router
from .mtp import MultiTokenPrediction
from .norm import RMSNorm


@dataclass
class LMOutput:
    """What one forward of the model computed (no losses: glm53.losses scores it)."""

    logits: torch.Tensor | None  # [B, T, vocab] in the head's dtype; None with return_logits=False
    last_hidden_state: torch.Tensor  # [B, T, D] after the final norm
    ctx: ForwardContext  # the forward's context: padding mask, documents, cp (what the losses read)
    stats: list[LayerStats] = field(default_factory=list)  # per decoder layer, in order (when collected)
    # per MTP depth d = 1..mtp_depth (when run): (shared_head.norm(h^d) [B, T, D], valid_d [B, T], LayerStats)
    mtp: list[tuple[torch.Tensor, torch.Tensor, LayerStats]] = field(default_factory=list)


class Glm53Model(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        if not isinstance(config, Glm53Config):
            raise TypeError(
                f"config must be a Glm53Config (Glm53Config.from_dict for a dict), got {type(config).__name__}"
            )
        config.validate()  # a field changed after construction is checked here, before any module uses it
        self.config = config
        # padding_idx as transformers' Glm5NextTextModel: the pad row never receives a gradient (a left-padded
        # row's last pad position predicts the first real token, which would otherwise train it); forward unchanged
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False  # recompute each block in backward (Glm53ForCausalLM toggles it)

    def embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """Validate the inputs and return the embeddings [B, T, D]."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        weight = self.embed_tokens.weight
        if inputs_embeds is None:
            check_token_ids("input_ids", input_ids, self.config.vocab_size, weight.device)
            inputs_embeds = self.embed_tokens(input_ids)
        else:
            check_inputs_embeds(
                inputs_embeds, weight, self.config.hidden_size, compute_dtype(self.embed_tokens, "weight")
            )
        return inputs_embeds

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        ctx: ForwardContext | None = None,
        stats: list[LayerStats] | None = None,
        cache: object | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cp: SequenceShards | None = None,
    ) -> torch.Tensor:
        """-> last hidden state [B, T, D].

        `ctx` (built from `attention_mask`, `cu_seqlens` / `position_ids` when absent) carries the per-forward
        state to every block; with `ctx.collect_stats` each layer's LayerStats is appended to `stats`. `cache` (a
        glm53.model.cache.GenerationCache, when ctx is absent): the first forward fills it, later ones continue it.
        """
        if ctx is not None and not isinstance(ctx, ForwardContext):
            raise TypeError(f"ctx must be a ForwardContext or None, got {type(ctx).__name__}")
        inputs_embeds = self.embed(input_ids, inputs_embeds)
        if ctx is None:
            ctx = build_context(inputs_embeds, attention_mask, cu_seqlens, position_ids, cp, cache=cache)
            if cache is not None:  # a forward on a cache advances its positions once, after every layer
                cache.check_tokens(ctx.valid)
                cache.begin(ctx.valid)
        # (with a ctx, a generation step does that bookkeeping itself, outside what it compiles: generation/step.py)
        streams = expand_streams(inputs_embeds, self.config.hc_mult)  # [B, T, N, D]
        for layer in self.layers:
            (streams, topk), layer_stats = run_block(self.gradient_checkpointing, layer, (streams,), ctx)
            if stats is not None and layer_stats is not None:
                stats.append(layer_stats)
            if topk is not None:
                ctx = dataclasses.replace(ctx, shared_topk=topk)  # rebind: recomputed layers keep their own ctx
        if cache is not None and ctx.cache is cache:
            cache.end(inputs_embeds.shape[1])
        return self.norm(collapse_streams(streams))

    def init_weights(self) -> None:
        nn.init.normal_(self.embed_tokens.weight, std=self.config.initializer_range)
        if self.config.pad_token_id is not None:
            with torch.no_grad():
                self.embed_tokens.weight[self.config.pad_token_id].zero_()
        for layer in self.layers:
            layer.init_weights()
        self.norm.init_weights()


class Glm53LMHeadModel(nn.Module):
    """Glm53Model with its lm_head and MTP layers: computes logits, hidden states and per-layer statistics."""

    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        self.config = config
        self.model = Glm53Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # MTP layers (layers.{num_hidden_layers}.* on disk); they share embed_tokens and lm_head with the main model.
        self.mtp = MultiTokenPrediction(config) if config.num_nextn_predict_layers > 0 else None
        # Reduces the stacked expert loads [moe layers, E] before the bias update; the parallel layer sets it
        # to a sum over data-parallel ranks (model code holds no collectives).
        self.expert_load_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        if not self.lm_head.weight.is_meta:
            self.init_weights()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_logits: bool = True,
        cp: SequenceShards | None = None,
        collect_stats: bool = False,
        record_indexer: bool = False,
        run_mtp: bool = False,
    ) -> LMOutput:
        """-> LMOutput. `return_logits` (default True): `out.logits = lm_head(last hidden state)` [B, T, vocab];
        with False no [B, T, vocab] tensor is made. `collect_stats`: every layer's LayerStats in `out.stats`
        (always in training mode: the expert loads are counted from them); `record_indexer` adds the indexer KL
        loss's tensors; `run_mtp`: the MTP depths in `out.mtp`.
        Packed documents: `cu_seqlens` [n_docs + 1] over the flattened tokens or `position_ids` [B, T] restarting
        at 0 per document (model/packing.py). Context parallelism (`cp`, model/cp.py): the inputs are this rank's
        slice of every sequence (glm53.parallel.context_parallel_inputs makes them)."""
        inputs_embeds = self.model.embed(input_ids, inputs_embeds)
        ctx = build_context(
            inputs_embeds,
            attention_mask,
            cu_seqlens,
            position_ids,
            cp,
            collect_stats=collect_stats or self.training,
            record_indexer=record_indexer,
        )
        stats: list[LayerStats] = []
        hidden = self.model(inputs_embeds=inputs_embeds, ctx=ctx, stats=stats)
        out = LMOutput(logits=self._logits(hidden, return_logits), last_hidden_state=hidden, ctx=ctx, stats=stats)
        if self.mtp is not None and run_mtp:
            out.mtp = self.mtp(hidden, inputs_embeds, ctx)
        if self.training:  # evaluation forwards leave the balancing counts alone
            balancing.count_expert_loads(self._routed(out))
        return out

    def _logits(self, hidden: torch.Tensor, return_logits: bool) -> torch.Tensor | None:
        if not isinstance(return_logits, bool):
            raise TypeError(f"return_logits must be True or False, got {return_logits!r}")
        return self.lm_head(hidden) if return_logits else None

    def _routed(self, out: LMOutput) -> list[tuple[Router, LayerStats, torch.Tensor]]:
        """(router, its layer's stats, the layer's valid mask) of every MoE layer that ran in `out`."""
        valid = out.ctx.valid
        routed = [
            (layer.mlp.gate, s, valid) for layer, s in zip(self.model.layers, out.stats) if isinstance(layer.mlp, MoE)
        ]
        return routed + [(self.mtp.layer_for(d).mlp.gate, s, v) for d, (_, v, s) in enumerate(out.mtp, start=1)]

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when configured (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    def update_router_bias(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing (DeepSeek-V3 section 2.1.2): bias_i += rate * sign(mean load - load_i).

        Uses the expert loads counted by the training-mode forwards (model.train()) since the previous
        update (with one forward per step: the last forward's; with gradient accumulation: all micro-batches'),
        summed over data-parallel ranks by `expert_load_reduce` when the parallel layer set it, then clears them.
        Call after optimizer.step(). (balancing.py)
        """
        main = [layer.mlp.gate for layer in self.model.layers if isinstance(layer.mlp, MoE)]
        balancing.update_router_bias(self.routers(), main, rate, self.expert_load_reduce)

    def set_numerics(
        self,
        *,
        mla_absorb: bool | None = None,
        hc_recompute: bool | None = None,
        indexer_kl_recompute: bool | None = None,
    ) -> None:
        """Set the numerics choices explicitly (None leaves a setting as it is).

        mla_absorb: attend in the kv latent (the absorbed form) or per head, in every MLA layer (MTP included).
        hc_recompute: recompute the mHC coefficients in backward instead of storing them (None in a module means
        "only for non-fp32 streams", its default).
        indexer_kl_recompute: the indexer KL's scores and attention pool mass recomputed per query block inside one
        autograd op from O(T) inputs (default True) instead of recorded as [B, T, P] tensors (MLA.kl_recompute).
        """
        settings = (("mla_absorb", mla_absorb), ("hc_recompute", hc_recompute))
        for name, value in (*settings, ("indexer_kl_recompute", indexer_kl_recompute)):
            if value is not None and not isinstance(value, bool):  # "no" is truthy: it would switch the form on
                raise TypeError(f"set_numerics: {name} must be True, False or None, got {value!r}")
        for module in self.modules():
            if isinstance(module, MultiHeadLatentAttention) and mla_absorb is not None:
                module.absorb = mla_absorb
            if isinstance(module, MultiHeadLatentAttention) and indexer_kl_recompute is not None:
                module.kl_recompute = indexer_kl_recompute
            if isinstance(module, HyperConnection) and hc_recompute is not None:
                module.recompute = hc_recompute

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each decoder block (and MTP layer) in backward instead of storing its activations."""
        self.model.gradient_checkpointing = True
        if self.mtp is not None:
            self.mtp.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False
        if self.mtp is not None:
            self.mtp.gradient_checkpointing = False

    def init_weights(self) -> None:
        """Initialise every parameter as transformers' Glm5NextPreTrainedModel._init_weights does."""
        self.model.init_weights()
        if not self.config.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, std=self.config.initializer_range)
        if self.mtp is not None:
            self.mtp.init_weights()

    def to_dtype(self, dtype: torch.dtype) -> "Glm53LMHeadModel":
        """Cast to `dtype`, keeping the fp32 keep-list (glm53.precision.FP32_KEEP) in fp32."""
        return cast_model(self, dtype)

    @classmethod
    def from_config(
        cls, config: Glm53Config, *, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
    ) -> "Glm53LMHeadModel":
        """Build on the meta device, materialise on `device` and initialise (no fp32 copy of a bf16 model)."""
        with torch.device("meta"):
            model = cls(config)
        cast_model(model, resolve_dtype(dtype, "dtype"))  # on meta: to_empty then allocates each tensor in its dtype
        model.to_empty(device=device)
        model.tie_weights()
        with torch.no_grad():
            model.init_weights()
        return model

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"
    ) -> "Glm53LMHeadModel":
        """Load an official-layout checkpoint directory (see glm53.checkpoint.load_checkpoint)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a checkpoint directory, got {type(path).__name__}")
        return load_checkpoint(cls, path, dtype=dtype, device=resolve_device(device))

    @classmethod
    def from_transformers(cls, hf_model: nn.Module) -> "Glm53LMHeadModel":
        """A copy of a transformers Glm5NextForConditionalGeneration's text weights (glm53.checkpoint.convert)."""
        return from_transformers(hf_model, cls)

    def save_pretrained(
        self,
        path: str | os.PathLike,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | str | None = None,
        overwrite: bool = False,
        allow_non_finite: bool = False,
    ) -> str:
        """Write the official layout atomically (see glm53.checkpoint.save_checkpoint) -> the directory."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a directory to write, got {type(path).__name__}")
        return save_checkpoint(
            self,
            path,
            max_shard_size=max_shard_size,
            dtype=dtype,
            overwrite=overwrite,
            allow_non_finite=allow_non_finite,
        )
