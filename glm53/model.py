"""Glm53Model and Glm53ForCausalLM: embedding -> N mHC streams -> decoder blocks -> stream mean -> norm -> head.

Legend: B batch, T time, N streams (hc_mult), D model width, V vocab.
`attention_mask` is a 2-D padding mask [B, T] (1 = token, 0 = padding; left or right padding). KDA layers zero
padded inputs and the indexer never selects padded keys, so valid positions do not depend on padding.

Top-k sharing: a layer whose indexer type is "shared" reuses the most recent "full" layer's selection, also
across KDA layers in between. (transformers only hands top-k to the directly following attention layer and
raises otherwise; where both run, they agree.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .block import DecoderBlock
from .config import Glm53Config
from .hyper_connection import collapse_streams, expand_streams
from .norm import RMSNorm

IGNORE_INDEX = -100  # label value that contributes no loss (transformers' convention)

# Parameters and buffers kept in fp32 whatever the model dtype (transformers' _keep_in_fp32_modules_strict).
FP32_SUFFIXES = (
    "e_score_correction_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias", "A_log",
    "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale",
)  # fmt: skip


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None = None  # total training loss
    lm_loss: torch.Tensor | None = None  # next-token cross-entropy alone
    last_hidden_state: torch.Tensor | None = None  # [B, T, D] after the final norm


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to `dtype`, keeping the FP32_SUFFIXES ones in fp32."""
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point():
                target = torch.float32 if keeps_fp32(name) else dtype
                if tensor.dtype != target:
                    tensor.data = tensor.data.to(target)
    return model


class Glm53Model(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """-> last hidden state [B, T, D]."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
            inputs_embeds = self.embed_tokens(input_ids)
        valid = padding_mask(attention_mask, inputs_embeds.shape[:2], inputs_embeds.device)
        streams = expand_streams(inputs_embeds, self.config.hc_mult)  # [B, T, N, D]
        shared_topk = None
        for layer in self.layers:
            streams, topk = layer(streams, valid, shared_topk)
            if topk is not None:
                shared_topk = topk
        return self.norm(collapse_streams(streams))

    def init_weights(self) -> None:
        nn.init.normal_(self.embed_tokens.weight, std=self.config.initializer_range)
        if self.config.pad_token_id is not None:
            with torch.no_grad():
                self.embed_tokens.weight[self.config.pad_token_id].zero_()
        for layer in self.layers:
            layer.init_weights()
        self.norm.init_weights()


def padding_mask(attention_mask: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Validate a 2-D padding mask and return it as bool [B, T] (all True when absent)."""
    if attention_mask is None:
        return torch.ones(*shape, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask must be a 2-D padding mask of shape {tuple(shape)} (1 = token, 0 = padding), "
            f"got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype != torch.bool:
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):  # NOTE: syncs
            raise ValueError("attention_mask must hold only 0 and 1 (1 = token, 0 = padding)")
        attention_mask = attention_mask != 0
    return attention_mask.to(device)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; labels are aligned with input_ids and shifted here."""
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(logits.shape[:2])} like input_ids, got {tuple(labels.shape)}")
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(logits.float().flatten(0, 1), shifted.flatten().long(), ignore_index=IGNORE_INDEX)


class Glm53ForCausalLM(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        self.config = config
        self.model = Glm53Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        if not self.lm_head.weight.is_meta:
            self.init_weights()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        hidden = self.model(input_ids, attention_mask, inputs_embeds)
        logits = self.lm_head(hidden)
        out = CausalLMOutput(logits=logits, last_hidden_state=hidden)
        if labels is not None:
            out.lm_loss = causal_lm_loss(logits, labels)
            out.loss = out.lm_loss
        return out

    def tie_weights(self) -> None:
        """With tie_word_embeddings, make lm_head use the embedding matrix (again: `to_empty` unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self) -> None:
        """Initialise every parameter as transformers' Glm5NextPreTrainedModel._init_weights does."""
        self.model.init_weights()
        if not self.config.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, std=self.config.initializer_range)

    def to_dtype(self, dtype: torch.dtype) -> "Glm53ForCausalLM":
        """Cast to `dtype`, keeping fp32 the parameters transformers keeps in fp32 (FP32_SUFFIXES)."""
        return cast_model(self, dtype)

    @classmethod
    def from_config(cls, config: Glm53Config, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> "Glm53ForCausalLM":  # fmt: skip
        """Build on the meta device, materialise on `device` and initialise (no fp32 copy of a bf16 model)."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        model.tie_weights()
        cast_model(model, dtype)
        with torch.no_grad():
            model.init_weights()
        return model

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> "Glm53ForCausalLM":  # fmt: skip
        """Load an official-layout checkpoint directory (see glm53.checkpoint.load_checkpoint)."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(cls, path, dtype=dtype, device=device)
