"""The official on-disk layout: key names, and the mapping between them and glm53's module names.

On disk (docs/checkpoints.md): text weights under `model.language_model.`, `lm_head.weight` at the top (absent
when tied), vision under `model.visual.`, the MTP layer as `layers.{num_hidden_layers}.*`. glm53's module names
are the on-disk names except:
    layers.{i}.hc_{attn,ffn}_{fn,base,scale}              <-> layers.{i}.{attn,ffn}_hc.{fn,base,scale}
    layers.{num_hidden_layers + j}.* (MTP)                   <-> mtp.layers.{j}.* (outside `model.`)
    mlp.experts.{e}.{gate,up,down}_proj.weight (per expert) <-> mlp.experts.gate_up_proj [E, 2I, D] /
                                                              mlp.experts.down_proj [E, D, I]
Legend: E experts, I expert width, D model width (glm53/model/__init__.py); i a layer index, j an MTP layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
VISION_MODULE = "visual."  # Glm53ForConditionalGeneration's tower: its names are the on-disk ones after VISION_PREFIX

HC_KEY = re.compile(r"^(layers\.\d+\.)hc_(attn|ffn)_(fn|base|scale)$")
_HC_BACK = re.compile(r"^(layers\.\d+\.)(attn|ffn)_hc\.(fn|base|scale)$")
EXPERT_KEY = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def official_to_internal(key: str) -> str | None:
    """An on-disk text key (without TEXT_PREFIX) -> glm53 name; experts map to their fused parameter."""
    if m := HC_KEY.match(key):
        return f"{m[1]}{m[2]}_hc.{m[3]}"
    if m := EXPERT_KEY.match(key):
        return f"{m[1]}.{'down_proj' if m[3] == 'down' else 'gate_up_proj'}"
    return key


def internal_to_official(name: str) -> str:
    """A glm53 (non-expert) name under `model.` -> its on-disk text key (without TEXT_PREFIX)."""
    if m := _HC_BACK.match(name):
        return f"{m[1]}hc_{m[2]}_{m[3]}"
    return name


# Copies of the shared embedding / head that some MTP releases store inside the MTP layer (DeepSeek-V3 does);
# glm53 shares the main model's, so these are set aside, not loaded.
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_internal(local: str, num_layers: int, n_mtp: int) -> str | None:
    """`layers.{N+j}.rest` -> `mtp.layers.{j}.rest` (glm53 name), or None for a key set aside."""
    m = LAYER_KEY.match(local)
    j, rest = int(m[1]) - num_layers, local[m.end() :]
    if j >= n_mtp or rest in MTP_SHARED_COPIES:
        return None
    return "mtp." + official_to_internal(f"layers.{j}.{rest}")


def official_key(name: str, num_layers: int) -> str:
    if name.startswith(VISION_MODULE):
        return "model." + name
    if name.startswith("model."):
        return TEXT_PREFIX + internal_to_official(name[len("model.") :])
    if name.startswith("mtp."):
        m = LAYER_KEY.match(name[len("mtp.") :])
        return TEXT_PREFIX + f"layers.{num_layers + int(m[1])}." + name[len("mtp.") + m.end() :]
    return name


def official_items(local: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One glm53 name under `model.` -> its on-disk (key, tensor) pairs; fused experts split per expert."""
    if local.endswith("experts.gate_up_proj"):
        base = TEXT_PREFIX + local.rsplit(".", 1)[0]
        rows = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{base}.{e}.gate_proj.weight", tensor[e, :rows]
            yield f"{base}.{e}.up_proj.weight", tensor[e, rows:]
    elif local.endswith("experts.down_proj"):
        base = TEXT_PREFIX + local.rsplit(".", 1)[0]
        for e in range(tensor.shape[0]):
            yield f"{base}.{e}.down_proj.weight", tensor[e]
    else:
        yield TEXT_PREFIX + internal_to_official(local), tensor


def named_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(glm53 name, tensor) for every parameter and buffer; the MTP module (if any) as `model.layers.{N}.*`.

    The MTP layers `mtp.layers.{j}.*` come last, named `model.layers.{num_hidden_layers + j}.*`.
    """
    tied = model.config.tie_word_embeddings
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if (name == "lm_head.weight" and tied) or name.startswith("mtp."):
            continue
        yield name, tensor
    yield from _mtpnamed_state(model)


def _mtpnamed_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return
    n = model.config.num_hidden_layers
    for name, tensor in list(mtp.named_parameters()) + list(mtp.named_buffers()):
        m = LAYER_KEY.match(name)
        yield f"model.layers.{n + int(m[1])}.{name[m.end() :]}", tensor


def mtp_official_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk key, tensor) pairs of the MTP layers only: `model.mtp.layers.{j}.*` -> `layers.{N+j}.*`."""
    for name, tensor in _mtpnamed_state(model):
        yield from official_items(name[len("model.") :], tensor)


def official_pairs(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One name of `named_state` -> its on-disk (key, tensor) pairs: lm_head at the top, the tower
    (`visual.*`) under VISION_PREFIX with its names unchanged, the text model through `official_items`."""
    if name == "lm_head.weight":
        yield name, tensor
    elif name.startswith(VISION_MODULE):
        yield "model." + name, tensor
    else:
        yield from official_items(name[len("model.") :], tensor)


def iter_official_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk key, tensor) pairs of a Glm53ForCausalLM in the official layout (experts split per expert)."""
    for name, tensor in named_state(model):
        yield from official_pairs(name, tensor)


# Outer config.json keys that declare a vision tower: a model without one (Glm53ForCausalLM, also when loaded
# from a VL checkpoint) writes none of them, so transformers does not build a randomly initialised tower.
VISION_CONFIG_KEYS = (
    "vision_config",
    "image_token_id",
    "video_token_id",
    "image_start_token_id",
    "image_end_token_id",
    "video_start_token_id",
    "video_end_token_id",
)


def official_config(model: torch.nn.Module) -> dict:
    """config.json of `model` (`to_official_dict`), without the vision keys when it has no tower."""
    config = model.config.to_official_dict()
    if not hasattr(model, "visual"):
        for key in VISION_CONFIG_KEYS:
            config.pop(key, None)
    return config
