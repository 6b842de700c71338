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
FP8 weights (float8_e4m3fn with a `<name>_scale_inv` companion, glm53.fp8) are dequantised as they are read,
with `quantization_config.weight_block_size` (default 128 x 128); the non-finite check sees the dequantised
values. `save_checkpoint` writes the same layout atomically (glm53.shards). transformers' in-memory names
differ once more (KDA `forget_gate.*`, one concatenated `conv1d`): `to_transformers_state_dict`,
`from_transformers_state_dict` and `from_transformers` convert in memory.
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

from . import fp8
from .config import Glm53Config
from .shards import INDEX_FILE, SINGLE_FILE

logger = logging.getLogger("glm53.checkpoint")

TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."

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

    def __init__(self, files: dict[str, str], block_size: tuple[int, int] = fp8.DEFAULT_BLOCK_SIZE) -> None:
        self.files = files
        self.block_size = block_size
        self._handles: dict[str, object] = {}

    def _handle(self, key: str):
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype string ("BF16", "F8_E4M3", ...)."""
        return self._handle(key).get_slice(key).get_dtype()

    def check_fp8(self, key: str) -> str | None:
        """None if `key` is not FP8 or its scale fits, else a message naming the key."""
        if not fp8.is_fp8(self.dtype(key)):
            return None
        scale = key + fp8.SCALE_SUFFIX
        try:
            fp8.check_scale(key, self.shape(key), self.shape(scale) if scale in self.files else None,
                            self.block_size)  # fmt: skip
        except ValueError as e:
            return str(e)
        return None

    def get(self, key: str) -> torch.Tensor:
        """The tensor (FP8 ones dequantised to fp32); NaN or inf (after dequantisation) raises."""
        tensor = self._handle(key).get_tensor(key)
        if tensor.dtype == fp8.FP8_DTYPE:
            scale = key + fp8.SCALE_SUFFIX
            if scale not in self.files:
                raise CheckpointError(f"FP8 tensor {key!r} has no {scale!r} companion")
            tensor = fp8.dequantize(tensor, self._handle(scale).get_tensor(scale), self.block_size)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # NOTE: syncs
            raise CheckpointError(f"tensor {key!r} holds NaN or infinite values")
        return tensor


def _plan(model: torch.nn.Module, files: dict[str, str], reader: _Reader, num_layers: int):
    """Match checkpoint keys to model tensors; raise one error listing every problem."""
    targets = dict(model.named_parameters(remove_duplicate=False))  # keep a tied lm_head.weight visible
    targets.update(dict(model.named_buffers()))
    direct: dict[str, str] = {}  # model name -> checkpoint key
    experts: dict[str, dict[tuple[int, str], str]] = defaultdict(dict)  # fused name -> (e, proj) -> key
    unexpected, mtp, vision = [], [], []
    n_mtp = model.config.num_nextn_predict_layers if getattr(model, "mtp", None) is not None else 0
    for key in files:
        weight = key[: -len(fp8.SCALE_SUFFIX)]
        if key.endswith(fp8.SCALE_SUFFIX) and weight in files and fp8.is_fp8(reader.dtype(weight)):
            continue  # an FP8 weight's companion, read with it (a scale beside a non-FP8 weight is unexpected)
        if key.endswith(fp8.SCALE_SUFFIX):
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
    used = list(direct.values()) + [k for parts in experts.values() for k in parts.values()]
    bad_fp8 = [msg for key in used if (msg := reader.check_fp8(key))]
    problems = []
    if bad_fp8:
        problems.append("FP8 scales:\n  " + "\n  ".join(sorted(bad_fp8)))
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


def quantization_config(config: Glm53Config) -> dict | None:
    """The source config.json's `quantization_config` (outer or text level), if any."""
    return config.extra.get("_outer", {}).get("quantization_config") or config.extra.get("quantization_config")


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
    reader = _Reader(files, fp8.weight_block_size(quantization_config(config)))
    with torch.device("meta"):
        model = cls(config)
    direct, experts, mtp, vision, mtp_found = _plan(model, files, reader, config.num_hidden_layers)
    if vision:
        logger.warning("skipping %d vision-tower tensors (model.visual.*): glm53 is the text model", len(vision))
    model.to_empty(device=device)
    model.tie_weights()
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


def _official_items(local: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
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


def _named_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(glm53 name, tensor) for every parameter and buffer; the MTP module (if any) as `model.layers.{N}.*`.

    The MTP layers `mtp.layers.{j}.*` come last, named `model.layers.{num_hidden_layers + j}.*`.
    """
    tied = model.config.tie_word_embeddings
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if (name == "lm_head.weight" and tied) or name.startswith("mtp."):
            continue
        yield name, tensor
    yield from _mtp_named_state(model)


def _mtp_named_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return
    n = model.config.num_hidden_layers
    for name, tensor in list(mtp.named_parameters()) + list(mtp.named_buffers()):
        m = _LAYER.match(name)
        yield f"model.layers.{n + int(m[1])}.{name[m.end():]}", tensor


def mtp_official_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk key, tensor) pairs of the MTP layers only: `model.mtp.layers.{j}.*` -> `layers.{N+j}.*`."""
    for name, tensor in _mtp_named_state(model):
        yield from _official_items(name[len("model."):], tensor)


def iter_official_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk key, tensor) pairs of a Glm53ForCausalLM in the official layout (experts split per expert)."""
    for name, tensor in _named_state(model):
        if name == "lm_head.weight":
            yield name, tensor
        else:
            yield from _official_items(name[len("model."):], tensor)


def save_checkpoint(model: torch.nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | None = None, overwrite: bool = False) -> str:  # fmt: skip
    """Write `model` to `path` in the official layout (what `Glm53ForCausalLM.save_pretrained` calls).

    config.json is `Glm53Config.to_official_dict()` (model_type glm5_next, nested text_config) with the dtype
    recorded and any `quantization_config` dropped (weights are written dequantised). `dtype` casts floating
    tensors except those transformers keeps in fp32 (FP32_SUFFIXES); None keeps each tensor's dtype. Shards
    are at most `max_shard_size` ("5GB", "200MB" or bytes), with an index when there is more than one. The
    write is atomic (glm53.shards.atomic_directory): an existing `path` raises unless `overwrite`, which
    replaces the checkpoint but keeps the directory's other files (tokenizer...) as transformers does.
    """
    from .model import keeps_fp32
    from .shards import ShardedWriter, atomic_directory, copy_side_files, write_json

    stored = dtype or model.model.embed_tokens.weight.dtype
    config = model.config.to_official_dict()
    config.pop("quantization_config", None)
    config["text_config"].pop("quantization_config", None)
    config["text_config"].pop("torch_dtype", None)
    config.pop("torch_dtype", None)
    config["text_config"]["dtype"] = config["dtype"] = str(stored).replace("torch.", "")
    with atomic_directory(path, overwrite=overwrite) as tmp:
        writer = ShardedWriter(tmp, max_shard_size)
        for name, tensor in _named_state(model):
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(torch.float32 if keeps_fp32(name) else dtype)
            if name == "lm_head.weight":
                writer.add(name, tensor)
            else:
                for key, part in _official_items(name[len("model."):], tensor):
                    writer.add(key, part)
        writer.finish()
        write_json(os.path.join(tmp, "config.json"), config)
        if os.path.isdir(path):
            copy_side_files(os.fspath(path), tmp)
    return os.path.abspath(os.fspath(path))


# transformers' in-memory names (conversion_mapping.py "glm5_next") differ from glm53's in two places.
_GATE_PARTS = r"(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)"
_HF_GATE = re.compile(r"^(layers\.\d+\.self_attn\.)" + _GATE_PARTS + "$")
_HF_GATE_BACK = re.compile(r"^(layers\.\d+\.self_attn\.)forget_gate\." + _GATE_PARTS + "$")
_CONV = re.compile(r"^(layers\.\d+\.self_attn\.)([qkv])_conv1d\.weight$")
_HF_CONV = re.compile(r"^(layers\.\d+\.self_attn\.)conv1d\.weight$")


def to_transformers_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """glm53 model -> the state dict of transformers' Glm5NextForConditionalGeneration (text part).

    Renames KDA's gate to `forget_gate.*` and concatenates q/k/v convs into `conv1d` [3*H*K, 1, kernel];
    experts stay fused. Tensors are shared with the model except the concatenated convs. `lm_head.weight`
    is included also when tied, as transformers' state_dict does.
    """
    out: dict[str, torch.Tensor] = {}
    convs: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            out[name] = tensor
            continue
        local = name[len("model."):]
        if m := _CONV.match(local):
            convs[m[1]][m[2]] = tensor
        elif m := _HF_GATE.match(local):
            out[f"{TEXT_PREFIX}{m[1]}forget_gate.{m[2]}"] = tensor
        else:
            out[TEXT_PREFIX + local] = tensor
    for prefix, parts in convs.items():
        out[f"{TEXT_PREFIX}{prefix}conv1d.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


def from_transformers_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' Glm5NextForConditionalGeneration state dict -> glm53 state dict (vision keys dropped).

    Splits `conv1d` into equal q/k/v thirds and moves `forget_gate.*` up to `self_attn`; other keys raise.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in state.items():
        if key == "lm_head.weight":
            out[key] = tensor
            continue
        if key.startswith(VISION_PREFIX):
            continue
        if not key.startswith(TEXT_PREFIX):
            unknown.append(key)
            continue
        local = key[len(TEXT_PREFIX):]
        if m := _HF_CONV.match(local):
            for part, chunk in zip("qkv", tensor.chunk(3, dim=0)):
                out[f"model.{m[1]}{part}_conv1d.weight"] = chunk
        elif m := _HF_GATE_BACK.match(local):
            out[f"model.{m[1]}{m[2]}"] = tensor
        else:
            out["model." + local] = tensor
    if unknown:
        raise CheckpointError("keys outside the text model and vision tower:\n  " + "\n  ".join(sorted(unknown)))
    return out


def from_transformers(hf_model: torch.nn.Module, cls=None):
    """A Glm53ForCausalLM with a copy of a transformers Glm5NextForConditionalGeneration's text weights."""
    from .model import cast_model

    if cls is None:
        from .model import Glm53ForCausalLM as cls
    config = Glm53Config.from_dict(hf_model.config.to_dict())
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device=hf_model.lm_head.weight.device)
    cast_model(model, hf_model.lm_head.weight.dtype)
    model.load_state_dict(from_transformers_state_dict(hf_model.state_dict()), strict=True)
    return model
