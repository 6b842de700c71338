"""Checkpoints in the official layout (what the release ships and transformers' save_pretrained writes).

On disk (MODEL_NOTES.md): text weights under `model.language_model.`, `lm_head.weight` at the top (absent when
tied), vision under `model.visual.`, the MTP layer as `layers.{num_hidden_layers}.*`. glm53's module names are
the on-disk names except:
    hc_{attn,ffn}_{fn,base,scale}                         <-> layers.N.{attn,ffn}_hc.{fn,base,scale}
    layers.{num_hidden_layers + j}.* (MTP)                   <-> mtp.layers.{j}.* (outside `model.`)
    mlp.experts.{e}.{gate,up,down}_proj.weight (per expert) <-> mlp.experts.gate_up_proj [E, 2I, D] /
                                                              mlp.experts.down_proj [E, D, I]
Loading reads tensors lazily with safetensors' safe_open (never pickle), checks every key and shape before
reading any data, and rejects non-finite tensors, so a bad checkpoint raises before a model is returned.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterator

import torch
from safetensors import safe_open

from .config import Glm53Config

logger = logging.getLogger("glm53.checkpoint")

TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_HC = re.compile(r"^(layers\.\d+\.)hc_(attn|ffn)_(fn|base|scale)$")
_HC_BACK = re.compile(r"^(layers\.\d+\.)(attn|ffn)_hc\.(fn|base|scale)$")
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message lists every offending key."""


def checkpoint_files(path: str) -> dict[str, str]:
    """Map every tensor key to the safetensors file holding it (single file or sharded with an index)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(path, v))})
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def official_to_internal(key: str) -> str | None:
    """An on-disk text key (without TEXT_PREFIX) -> glm53 name; experts map to their fused parameter."""
    if m := _HC.match(key):
        return f"{m[1]}{m[2]}_hc.{m[3]}"
    if m := _EXPERT.match(key):
        return f"{m[1]}.{'down_proj' if m[3] == 'down' else 'gate_up_proj'}"
    return key


def internal_to_official(name: str) -> str:
    """A glm53 (non-expert) name under `model.` -> its on-disk text key (without TEXT_PREFIX)."""
    if m := _HC_BACK.match(name):
        return f"{m[1]}hc_{m[2]}_{m[3]}"
    return name


class _Reader:
    """Lazy tensor access over (possibly sharded) safetensors files, one open handle per file."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self._handles: dict[str, object] = {}

    def _handle(self, key: str):
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        tensor = self._handle(key).get_tensor(key)
        if tensor.is_floating_point() and tensor.element_size() > 1 and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"tensor {key!r} holds NaN or infinite values")
        return tensor


def _plan(model: torch.nn.Module, files: dict[str, str], reader: _Reader, num_layers: int):
    """Match checkpoint keys to model tensors; raise one error listing every problem."""
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    direct: dict[str, str] = {}  # model name -> checkpoint key
    experts: dict[str, dict[tuple[int, str], str]] = defaultdict(dict)  # fused name -> (e, proj) -> key
    unexpected, mtp, vision = [], [], []
    n_mtp = model.config.num_nextn_predict_layers if getattr(model, "mtp", None) is not None else 0
    for key in files:
        if key.endswith("_scale_inv"):
            unexpected.append(key)
            continue
        if key.startswith(VISION_PREFIX):
            vision.append(key)
            continue
        if key == "lm_head.weight":
            name = key
        elif key.startswith(TEXT_PREFIX):
            local = key[len(TEXT_PREFIX):]
            m = _LAYER.match(local)
            if m and int(m[1]) >= num_layers:
                name = _mtp_internal(local, num_layers, n_mtp)
                if name is None:
                    mtp.append(key)
                    continue
            else:
                name = "model." + official_to_internal(local)
        else:
            unexpected.append(key)
            continue
        if (m := _EXPERT.match(key[len(TEXT_PREFIX):])) and name in targets:
            experts[name][(int(m[2]), m[3])] = key
        elif name in targets and name not in direct:
            direct[name] = key
        else:
            unexpected.append(key)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and "lm_head.weight" in direct:
        del direct["lm_head.weight"]  # the embedding provides it; a stored copy is ignored
    # A checkpoint without any MTP tensor (e.g. written by transformers, which drops them) leaves the MTP
    # module to be initialised; a partial MTP layer is an error like any other missing key.
    mtp_found = any(n.startswith("mtp.") for n in [*direct, *experts])
    missing, bad_shape = [], []
    for name, tensor in targets.items():
        if tied and name == "lm_head.weight":
            continue
        if name.startswith("mtp.") and not mtp_found:
            continue
        if name in direct:
            if reader.shape(direct[name]) != tuple(tensor.shape):
                bad_shape.append(f"{direct[name]}: {reader.shape(direct[name])}, expected {tuple(tensor.shape)}")
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            E, rows, cols = tensor.shape
            parts = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
            expected = (rows // len(parts), cols)
            prefix = _official_key(name.rsplit(".", 1)[0], num_layers)
            for e in range(E):
                for part in parts:
                    key = experts[name].get((e, part))
                    if key is None:
                        missing.append(f"{prefix}.{e}.{part}_proj.weight {expected}")
                    elif reader.shape(key) != expected:
                        bad_shape.append(f"{key}: {reader.shape(key)}, expected {expected}")
            extra = [k for (e, _), k in experts[name].items() if e >= E]
            unexpected.extend(extra)
        else:
            missing.append(f"{_official_key(name, num_layers)} {tuple(tensor.shape)}")
    problems = []
    if missing:
        problems.append("missing keys (expected shape):\n  " + "\n  ".join(sorted(missing)))
    if unexpected:
        problems.append("unexpected keys:\n  " + "\n  ".join(sorted(unexpected)))
    if bad_shape:
        problems.append("mis-shaped keys:\n  " + "\n  ".join(sorted(bad_shape)))
    if problems:
        raise CheckpointError("checkpoint does not match the model config:\n" + "\n".join(problems))
    return direct, experts, mtp, vision, mtp_found


# Copies of the shared embedding / head that some MTP releases store inside the MTP layer (DeepSeek-V3 does);
# glm53 shares the main model's, so these are set aside, not loaded.
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _mtp_internal(local: str, num_layers: int, n_mtp: int) -> str | None:
    """`layers.{N+j}.rest` -> `mtp.layers.{j}.rest` (glm53 name), or None for a key set aside."""
    m = _LAYER.match(local)
    j, rest = int(m[1]) - num_layers, local[m.end():]
    if j >= n_mtp or rest in _MTP_SHARED_COPIES:
        return None
    return "mtp." + official_to_internal(f"layers.{j}.{rest}")


def _official_key(name: str, num_layers: int) -> str:
    if name.startswith("model."):
        return TEXT_PREFIX + internal_to_official(name[len("model."):])
    if name.startswith("mtp."):
        m = _LAYER.match(name[len("mtp."):])
        return TEXT_PREFIX + f"layers.{num_layers + int(m[1])}." + name[len("mtp.") + m.end():]
    return name


def load_checkpoint(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu"):  # fmt: skip
    """Build `cls` (Glm53ForCausalLM) from an official-layout directory; see the module docstring.

    dtype None keeps the config's stored `dtype`/`torch_dtype` when it names one, else fp32. Parameters that
    transformers keeps in fp32 stay fp32. With `num_nextn_predict_layers > 0` the MTP layers' keys
    (`layers.{N+j}.*`) load into `model.mtp.layers[j]` (a checkpoint with none of them leaves the MTP module
    freshly initialised, with a warning); MTP keys the model has no place for are set aside and listed in
    `model.mtp_checkpoint_keys`.
    """
    from .model import cast_model

    path = os.fspath(path)
    config = Glm53Config.from_pretrained(path)
    if dtype is None:
        stored = config.extra.get("_outer", {}).get("dtype") or config.extra.get("dtype") or "float32"
        dtype = getattr(torch, str(stored).replace("torch.", ""), torch.float32)
    files = checkpoint_files(path)
    reader = _Reader(files)
    with torch.device("meta"):
        model = cls(config)
    direct, experts, mtp, vision, mtp_found = _plan(model, files, reader, config.num_hidden_layers)
    if vision:
        logger.warning("skipping %d vision-tower tensors (model.visual.*): glm53 is the text model", len(vision))
    model.to_empty(device=device)
    cast_model(model, dtype)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name, key in direct.items():
            tensors[name].copy_(reader.get(key))
        for name, parts in experts.items():
            target = tensors[name]
            for (e, part), key in parts.items():
                rows = target.shape[1] // 2 if name.endswith("gate_up_proj") else target.shape[1]
                offset = rows if part == "up" else 0
                target[e, offset : offset + rows].copy_(reader.get(key))
        if model.mtp is not None and not mtp_found:
            logger.warning("%s has no MTP tensors (layers.%d.*): the MTP module is freshly initialised",
                           path, config.num_hidden_layers)  # fmt: skip
            model.mtp.init_weights()
    model.mtp_checkpoint_keys = sorted(mtp)
    return model


def iter_official_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk key, tensor) pairs of a Glm53ForCausalLM in the official layout (experts split per expert).

    Includes the MTP layers (`mtp_official_state`); the tensors are views, clone them before saving.
    """
    tied = model.config.tie_word_embeddings
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name == "lm_head.weight":
            if not tied:
                yield name, tensor
            continue
        if name.startswith("mtp."):
            continue
        yield from _official_items(name[len("model."):], tensor)
    yield from mtp_official_state(model)


def mtp_official_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk key, tensor) pairs of the MTP layers only: `model.mtp.layers.{j}.*` -> `layers.{N+j}.*`."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return
    n = model.config.num_hidden_layers
    for name, tensor in list(mtp.named_parameters()) + list(mtp.named_buffers()):
        m = _LAYER.match(name)
        yield from _official_items(f"layers.{n + int(m[1])}.{name[m.end():]}", tensor)


def _official_items(local: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One glm53 text tensor (name without `model.`) -> its on-disk (key, tensor) pairs."""
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
