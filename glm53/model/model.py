"""Glm53Model and Glm53ForCausalLM: embedding -> N mHC streams -> decoder blocks -> stream mean -> norm -> head.

Legend: B batch, T time, N streams (hc_mult), D model width, vocab the vocabulary size.
`attention_mask` is a 2-D padding mask [B, T] (1 = token, 0 = padding; left or right padding). KDA layers zero
padded inputs and the indexer never selects padded keys, so valid positions do not depend on padding.

Top-k sharing: a layer whose indexer type is "shared" reuses the most recent "full" layer's selection, also
across KDA layers in between. (transformers only hands top-k to the directly following attention layer and
raises otherwise; where both run, they agree.)

Training (docs/training.md): with labels, Glm53ForCausalLM also returns the MTP loss (mtp.py), the router
balance / z-loss and the indexer KL loss (glm53/training/losses.py), each on its own and weighted into `.loss`;
training forwards count expert loads for `update_router_bias`. Per-forward state reaches the blocks in one
`ForwardContext` (context.py).
Head and loss: with labels the next-token and MTP losses run the head and the cross-entropy as one chunked op
(`causal_lm_head_loss`, glm53/kernels/linear_cross_entropy.py) and never hold [B, T, vocab] logits;
`return_logits=False` (what training loops pass) skips the logits too, `out.logits` is then None.
`gradient_checkpointing_enable()` recomputes every decoder block (mHC coefficients included) in backward.
Packed documents: `cu_seqlens` (input_ids [1, total], or [B, T] with boundaries over the flattened tokens) or
`position_ids` restarting at 0 per document; each document is computed as if alone (model/packing.py), and
with labels a document's last token predicts nothing.
Context parallelism: `cp=` (a SequenceShards) runs this rank's slice of every sequence (model/cp.py); the
inputs come from glm53.parallel.context_parallel_inputs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..checkpoint.convert import from_transformers
from ..checkpoint.load import load_checkpoint
from ..checkpoint.save import save_checkpoint
from ..config import Glm53Config
from ..precision import cast_model, resolve_device, resolve_dtype
from ..training.loss_counts import LossCounts, count_loss_terms
from ..training.losses import IGNORE_INDEX, causal_lm_head_loss, expert_load, head_target_loss, indexer_kl_terms
from ..training.losses import router_aux_loss
from .block import DecoderBlock, run_block
from .context import ForwardContext, LayerStats, SequenceShards
from .cp import across_ranks, sharded_packing_fields, sharded_targets
from .hyper_connection import HyperConnection, collapse_streams, expand_streams
from .inputs import check_device, check_inputs_embeds, check_optional_tensor, check_token_ids
from .mla import MultiHeadLatentAttention
from .moe import MoE, Router
from .mtp import MultiTokenPrediction, mtp_labels
from .norm import RMSNorm
from .packing import document_boundaries, document_labels, segment_ids


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # [B, T, vocab] in the head's dtype; None with return_logits=False
    loss: torch.Tensor | None = None  # lm + mtp_loss_weight * mtp + aux + indexer_loss_weight * indexer
    lm_loss: torch.Tensor | None = None  # next-token cross-entropy alone
    mtp_loss: torch.Tensor | None = None  # MTP cross-entropy, mean over depths (None without an MTP module)
    aux_loss: torch.Tensor | None = None  # coef-weighted balance + z-loss, mean over MoE layers (None if both off)
    indexer_loss: torch.Tensor | None = None  # indexer KL, mean over full indexers (None when its weight is 0)
    last_hidden_state: torch.Tensor | None = None  # [B, T, D] after the final norm


class Glm53Model(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        if not isinstance(config, Glm53Config):
            raise TypeError(f"config must be a Glm53Config (Glm53Config.from_dict for a dict), got "
                            f"{type(config).__name__}")  # fmt: skip
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
            check_inputs_embeds(inputs_embeds, weight, self.config.hidden_size)
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
        glm53.generation.GenerationCache, when ctx is absent): the first forward fills it, later ones continue it.
        """
        if ctx is not None and not isinstance(ctx, ForwardContext):
            raise TypeError(f"ctx must be a ForwardContext or None, got {type(ctx).__name__}")
        inputs_embeds = self.embed(input_ids, inputs_embeds)
        if ctx is None:
            valid = padding_mask(attention_mask, inputs_embeds.shape[:2], inputs_embeds.device)
            fields = packing_fields(valid, cu_seqlens, position_ids, cp)
            if cache is not None and (fields["cu_seqlens"] is not None or cp is not None):
                raise ValueError("a generation cache does not take packed documents (cu_seqlens / position_ids) "
                                 "or context parallelism (cp)")  # fmt: skip
            ctx = ForwardContext(valid=valid, cache=cache, cp=cp, **fields)
        streams = expand_streams(inputs_embeds, self.config.hc_mult)  # [B, T, N, D]
        for layer in self.layers:
            (streams, topk), layer_stats = run_block(self.gradient_checkpointing, layer, (streams,), ctx)
            if stats is not None and layer_stats is not None:
                stats.append(layer_stats)
            if topk is not None:
                ctx = dataclasses.replace(ctx, shared_topk=topk)  # rebind: recomputed layers keep their own ctx
        return self.norm(collapse_streams(streams))

    def init_weights(self) -> None:
        nn.init.normal_(self.embed_tokens.weight, std=self.config.initializer_range)
        if self.config.pad_token_id is not None:
            with torch.no_grad():
                self.embed_tokens.weight[self.config.pad_token_id].zero_()
        for layer in self.layers:
            layer.init_weights()
        self.norm.init_weights()


def packing_fields(valid: torch.Tensor, cu_seqlens: torch.Tensor | None, position_ids: torch.Tensor | None,
                   cp: SequenceShards | None = None) -> dict[str, torch.Tensor | None]:  # fmt: skip
    """ForwardContext's packed-document fields (`cu_seqlens`, `segment_ids`; None when nothing is packed).

    Under context parallelism (`cp`) documents come as this slice's `position_ids` (model/cp.py): every rank
    then has both fields, its own slice holding a document start or not."""
    B, T = valid.shape
    check_optional_tensor("cu_seqlens", cu_seqlens, valid.device, "int [n_docs + 1] over the flattened tokens")
    check_optional_tensor("position_ids", position_ids, valid.device, "[batch, seq] restarting at 0 per document")
    if cp is not None:
        if cu_seqlens is not None:
            raise ValueError("under context parallelism pass packed documents as position_ids (this slice's, "
                             "restarting at 0 per document; glm53.parallel.context_parallel_inputs makes them), "
                             "not cu_seqlens")  # fmt: skip
        if position_ids is None:
            return dict(cu_seqlens=None, segment_ids=None)
        if tuple(position_ids.shape) != (B, T) or position_ids.dtype.is_floating_point:
            raise ValueError(f"position_ids must be an integer tensor of shape {(B, T)}, got {position_ids.dtype} "
                             f"{tuple(position_ids.shape)}")  # fmt: skip
        return sharded_packing_fields(position_ids.to(valid.device), cp)
    cu = document_boundaries(B, T, valid.device, cu_seqlens, position_ids)
    return dict(cu_seqlens=cu, segment_ids=None if cu is None else segment_ids(cu, B, T))


def padding_mask(attention_mask: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Validate a 2-D padding mask and return it as bool [B, T] (all True when absent)."""
    if attention_mask is None:
        return torch.ones(*shape, dtype=torch.bool, device=device)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor [batch, seq] of 0/1, got "
                        f"{type(attention_mask).__name__}")  # fmt: skip
    check_device("attention_mask", attention_mask, device)
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask must be a 2-D padding mask of shape {tuple(shape)} (1 = token, 0 = padding), "
            f"got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype != torch.bool:
        # the 0/1 value check is skipped under torch.compile (a host read splits the graph; model/inputs.py)
        if not torch.compiler.is_compiling() and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):  # NOTE: syncs
            raise ValueError("attention_mask must hold only 0 and 1 (1 = token, 0 = padding)")
        attention_mask = attention_mask != 0
    return attention_mask.to(device)


class Glm53ForCausalLM(nn.Module):
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
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        loss_denominators: LossCounts | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_logits: bool = True,
        cp: SequenceShards | None = None,
    ) -> CausalLMOutput:
        """`return_logits` (default True): `out.logits = lm_head(last hidden state)` [B, T, vocab], in the graph as
        always; with False, `out.logits` is None and no [B, T, vocab] tensor is made (training loops pass False).
        The losses never read `out.logits`: with labels and return_logits=True the logits are computed beside the
        chunked loss, so a caller can still use them (with gradient), at the cost of their memory.
        With labels, the losses; each part is this forward's mean unless `loss_denominators` (the counts of a
        whole global batch, `loss_counts` summed over micro-batches and ranks) says what to divide its sum by.
        Packed documents: `cu_seqlens` [n_docs + 1] over the flattened tokens or `position_ids` [B, T] restarting
        at 0 per document (model/packing.py); `loss_counts(..., position_ids)` gives their denominators.
        Context parallelism (`cp`, model/cp.py): the inputs are this rank's slice of every sequence, `labels` its
        slice of the next-token targets (shifted over the whole sequence) and `loss_denominators` are required;
        glm53.parallel.context_parallel_inputs makes all of them. Every loss part is then the whole batch's."""
        if labels is not None:  # before the forward: a bad label would otherwise fail only in the loss
            check_token_ids("labels", labels, self.config.vocab_size, self.lm_head.weight.device, ignore=IGNORE_INDEX)
        if loss_denominators is not None and not isinstance(loss_denominators, LossCounts):
            raise TypeError(f"loss_denominators must be a LossCounts (model.loss_counts, summed over micro-batches "
                            f"and ranks) or None, got {type(loss_denominators).__name__}")  # fmt: skip
        collect = labels is not None or self.training
        if cp is not None and labels is not None and loss_denominators is None:
            raise ValueError("under context parallelism (cp) pass loss_denominators: the counts of the whole "
                             "sequences (glm53.parallel.context_parallel_inputs computes them)")  # fmt: skip
        if not collect:
            hidden = self.model(input_ids, attention_mask, inputs_embeds, cu_seqlens=cu_seqlens,
                                position_ids=position_ids, cp=cp)  # fmt: skip
            return CausalLMOutput(logits=self._logits(hidden, return_logits), last_hidden_state=hidden)
        inputs_embeds = self.model.embed(input_ids, inputs_embeds)
        valid = padding_mask(attention_mask, inputs_embeds.shape[:2], inputs_embeds.device)
        record_indexer = labels is not None and self.config.indexer_loss_weight > 0
        ctx = ForwardContext(valid=valid, collect_stats=True, record_indexer=record_indexer, cp=cp,
                             **packing_fields(valid, cu_seqlens, position_ids, cp))  # fmt: skip
        stats: list[LayerStats] = []
        hidden = self.model(inputs_embeds=inputs_embeds, ctx=ctx, stats=stats)
        out = CausalLMOutput(logits=self._logits(hidden, return_logits), last_hidden_state=hidden)
        mtp_runs = []  # per depth: (normed hidden the head reads, valid, stats)
        if self.mtp is not None and labels is not None:
            mtp_runs = self.mtp(hidden, inputs_embeds, ctx)
        if self.training:  # evaluation forwards (labels, eval mode) leave the balancing counts alone
            self._count_expert_loads(stats, valid, mtp_runs)
        if labels is not None:
            n_docs = None if ctx.cu_seqlens is None else ctx.cu_seqlens.shape[0] - 1  # a size from the shape
            self._add_losses(out, labels, valid, stats, mtp_runs, loss_denominators, ctx.segment_ids, cp, n_docs)
        return out

    def _logits(self, hidden: torch.Tensor, return_logits: bool) -> torch.Tensor | None:
        if not isinstance(return_logits, bool):
            raise TypeError(f"return_logits must be True or False, got {return_logits!r}")
        return self.lm_head(hidden) if return_logits else None

    def loss_counts(self, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None) -> LossCounts:  # fmt: skip
        """How many terms each loss part of a forward on the same inputs averages over (no forward needed);
        with position_ids, each packed document counts as if it were alone."""
        device = labels.device if isinstance(labels, torch.Tensor) else torch.device("cpu")  # counts need no model
        check_token_ids("labels", labels, self.config.vocab_size, device, ignore=IGNORE_INDEX)
        valid = padding_mask(attention_mask, labels.shape, labels.device)
        return count_loss_terms(self.config, labels, valid, position_ids)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Greedy or sampled continuation [B, T + new] of a left-padded batch (see glm53.generation.generate)."""
        from ..generation.loop import generate  # the loop imports nothing from this module

        return generate(self, input_ids, attention_mask, **kwargs)

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when configured (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _add_losses(self, out: CausalLMOutput, labels: torch.Tensor, valid: torch.Tensor, stats: list[LayerStats],
                    mtp_runs: list, den: LossCounts | None, segments: torch.Tensor | None = None,
                    cp: SequenceShards | None = None, num_documents: int | None = None) -> None:  # fmt: skip
        """Fill out.lm_loss, .mtp_loss, .aux_loss, .indexer_loss and their weighted sum out.loss.

        `segments` [B, T] (packed documents): no label crosses a document boundary, balance loss per document
        (`num_documents` bounds the ids: the document count from cu_seqlens' shape).
        `cp`: `labels` are next-token targets of this slice; each part is this rank's share, then `across_ranks`.
        """
        cfg = self.config

        def per_view(field: str, view: int) -> torch.Tensor | None:
            return None if den is None else getattr(den, field)[view]

        head = self.lm_head

        def ce(hidden: torch.Tensor, d: int) -> torch.Tensor:
            """The cross-entropy of view d (0: next token, d: MTP depth d) from the hidden state the head reads."""
            if cp is not None:
                targets = sharded_targets(labels, segments, d, cp, IGNORE_INDEX)
                return head_target_loss(hidden, head, targets, per_view("targets", d), check=False)
            if segments is not None:
                aligned = document_labels(labels, segments, d, IGNORE_INDEX)
            else:
                aligned = labels if d == 0 else mtp_labels(labels, d, IGNORE_INDEX)
            return causal_lm_head_loss(hidden, head, aligned, per_view("targets", d), check=False)

        out.lm_loss = loss = ce(out.last_hidden_state, 0)
        if mtp_runs:
            per_depth = [ce(h, d) for d, (h, _, _) in enumerate(mtp_runs, start=1)]
            out.mtp_loss = torch.stack(per_depth).mean()
            loss = loss + cfg.mtp_loss_weight * out.mtp_loss
        records = [(s, valid, 0) for s in stats] + [(s, v, d) for d, (_, v, s) in enumerate(mtp_runs, start=1)]
        out.aux_loss = router_aux_loss(records, cfg.router_aux_loss_coef, cfg.router_z_loss_coef, den, segments, cp,
                                       num_documents)
        if out.aux_loss is not None:
            loss = loss + out.aux_loss
        if cfg.indexer_loss_weight > 0:
            terms = indexer_kl_terms(stats, valid, cfg.indexer_loss_mode, per_view("indexer_rows", 0))
            for d, (_, v, s) in enumerate(mtp_runs, start=1):
                terms += indexer_kl_terms([s], v, cfg.indexer_loss_mode, per_view("indexer_rows", d))
            out.indexer_loss = torch.stack(terms).mean() if terms else out.lm_loss.new_zeros(())
            loss = loss + cfg.indexer_loss_weight * out.indexer_loss
        out.loss = loss
        if cp is not None:
            for name in ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss"):
                setattr(out, name, across_ranks(getattr(out, name), cp))

    @torch.no_grad()
    def _count_expert_loads(self, stats: list[LayerStats], valid: torch.Tensor, mtp_runs: list) -> None:
        """Add each router's tokens-per-expert of this forward to `router.counted_load`."""
        pairs = [(layer.mlp.gate, s, valid) for layer, s in zip(self.model.layers, stats) if isinstance(layer.mlp, MoE)]
        pairs += [(self.mtp.layer_for(d).mlp.gate, s, v) for d, (_, v, s) in enumerate(mtp_runs, start=1)]
        for router, s, v in pairs:
            load = expert_load(s.router_indices, v, router.num_experts)
            router.counted_load = load if router.counted_load is None else router.counted_load + load

    def routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    @torch.no_grad()
    def update_router_bias(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing (DeepSeek-V3 section 2.1.2): bias_i += rate * sign(mean load - load_i).

        Uses the expert loads counted by the training-mode forwards (model.train()) since the previous
        update (with one forward per step: the last forward's; with gradient accumulation: all micro-batches'),
        summed over data-parallel ranks by `expert_load_reduce` when the parallel layer set it, then clears them.
        Call after optimizer.step().
        """
        routers = self.routers()
        if not routers:
            return
        if any(r.counted_load is None for r in self._main_routers()):
            raise RuntimeError("update_router_bias needs the expert loads of a training forward "
                               "(model.train()) since the last update; none were counted")  # fmt: skip
        counted = [r for r in routers if r.counted_load is not None]
        loads = torch.stack([r.counted_load for r in counted])  # [layers, E]
        if self.expert_load_reduce is not None:
            loads = self.expert_load_reduce(loads)
        for router, load in zip(counted, loads):
            router.e_score_correction_bias += rate * torch.sign(load.mean() - load)
            router.counted_load = None

    def _main_routers(self) -> list[Router]:
        return [layer.mlp.gate for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def set_numerics(self, *, mla_absorb: bool | None = None, hc_recompute: bool | None = None) -> None:
        """Set the numerics choices explicitly (None leaves a setting as it is).

        mla_absorb: attend in the kv latent (the absorbed form) or per head, in every MLA layer (MTP included).
        hc_recompute: recompute the mHC coefficients in backward instead of storing them (None in a module means
        "only for non-fp32 streams", its default).
        """
        for module in self.modules():
            if isinstance(module, MultiHeadLatentAttention) and mla_absorb is not None:
                module.absorb = mla_absorb
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

    def to_dtype(self, dtype: torch.dtype) -> "Glm53ForCausalLM":
        """Cast to `dtype`, keeping the fp32 keep-list (glm53.precision.FP32_KEEP) in fp32."""
        return cast_model(self, dtype)

    @classmethod
    def from_config(cls, config: Glm53Config, *, dtype: torch.dtype | str = torch.float32,
                    device: str | torch.device = "cpu") -> "Glm53ForCausalLM":  # fmt: skip
        """Build on the meta device, materialise on `device` and initialise (no fp32 copy of a bf16 model)."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        model.tie_weights()
        cast_model(model, resolve_dtype(dtype, "dtype"), check_range=False)  # to_empty memory: no values yet
        with torch.no_grad():
            model.init_weights()
        return model

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                        device: str | torch.device = "cpu") -> "Glm53ForCausalLM":  # fmt: skip
        """Load an official-layout checkpoint directory (see glm53.checkpoint.load_checkpoint)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a checkpoint directory, got {type(path).__name__}")
        return load_checkpoint(cls, path, dtype=dtype, device=resolve_device(device))

    @classmethod
    def from_transformers(cls, hf_model: nn.Module) -> "Glm53ForCausalLM":
        """A copy of a transformers Glm5NextForConditionalGeneration's text weights (glm53.checkpoint.convert)."""
        return from_transformers(hf_model, cls)

    def save_pretrained(self, path: str | os.PathLike, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | str | None = None, overwrite: bool = False,
                        allow_non_finite: bool = False) -> str:  # fmt: skip
        """Write the official layout atomically (see glm53.checkpoint.save_checkpoint) -> the directory."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a directory to write, got {type(path).__name__}")
        return save_checkpoint(self, path, max_shard_size=max_shard_size, dtype=dtype, overwrite=overwrite,
                               allow_non_finite=allow_non_finite)  # fmt: skip
