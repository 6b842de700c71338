"""Synthetic checkpoints for the checkpoint, FP8 and crop tests: tiny configs, official layout on disk.

`fp8_source()` builds (once per process) a sharded FP8 checkpoint the way the release is laid out: a random
tiny glm53 model with a vision tower (from transformers) and an MTP layer, every 2-D text projection quantised
per block (block 4 x 8 with hidden 36, so most weights have partial edge blocks), one shard per layer group.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.checkpoint import fp8  # noqa: F401
from glm53.checkpoint.shards import INDEX_FILE
from tests.helpers.oracle import TINY_VISION, hf_model, randomize

TEXT = "model.language_model."
BLOCK = (4, 8)
# Release-style: norms, embeddings, hc_* and the head stay BF16 (here: the source dtype).
NOT_CONVERTED = ("embed_tokens", "layernorm", "norm", "lm_head", "hc_", "model.visual", "gate.weight")

_TMP = tempfile.mkdtemp(prefix="glm53-ckpt-tests-")
atexit.register(shutil.rmtree, _TMP, True)


def tiny_config(**overrides) -> Glm53Config:
    """4 layers [KDA, MLA full, MLA shared, KDA] (a pattern transformers runs), nested with a tiny vision tower."""
    base = dict(
        hidden_size=36,
        q_lora_rank=20,
        kv_lora_rank=12,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
    )
    base.update(overrides)
    text = Glm53Config.tiny(**base).to_dict()
    return Glm53Config.from_dict({"text_config": text, "vision_config": dict(TINY_VISION)})


def random_model(config: Glm53Config, seed: int = 0) -> Glm53ForCausalLM:
    model = Glm53ForCausalLM.from_config(config)
    randomize(model, seed)
    return model.eval()


def read_all(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, exactly as stored."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def mtp_tensors(
    state: dict[str, torch.Tensor], config: Glm53Config, with_indexer: bool = True, seed: int = 1
) -> dict[str, torch.Tensor]:
    """A release-style MTP layer at layers.{N}: eh_proj, enorm, hnorm, shared_head.norm and an MLA+MoE block."""
    n, h = config.num_hidden_layers, config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    out = {
        f"{TEXT}layers.{n}.eh_proj.weight": torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5,
        f"{TEXT}layers.{n}.enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        f"{TEXT}layers.{n}.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        f"{TEXT}layers.{n}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
    }
    src = f"{TEXT}layers.{config.attention_layers[0]}."
    for key, tensor in state.items():
        if key.startswith(src) and ".hc_" not in key and (with_indexer or ".indexer." not in key):
            out[f"{TEXT}layers.{n}." + key[len(src) :]] = tensor + 0.01 * torch.randn(tensor.shape, generator=gen)
    return out


def quantizable(key: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and key.endswith(".weight") and not any(s in key for s in NOT_CONVERTED)


def quantize_state(state: dict[str, torch.Tensor], block=BLOCK) -> dict[str, torch.Tensor]:
    """Each quantizable 2-D weight -> e4m3 plus `<key>_scale_inv`; everything else unchanged."""
    out = {}
    for key, tensor in state.items():
        if quantizable(key, tensor):
            out[key], out[key + fp8.SCALE_SUFFIX] = fp8.quantize(tensor, block)
        else:
            out[key] = tensor
    return out


def _group(key: str) -> str:
    m = re.match(r"^model\.language_model\.layers\.(\d+)\.", key)
    return f"layer{m[1]}" if m else "other"


def write_checkpoint(path: str, state: dict[str, torch.Tensor], config: dict, sharded: bool = True) -> None:
    """Write `state` + config.json; sharded = one file per layer (as the release groups them) plus an index."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if not sharded:
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            os.path.join(path, "model.safetensors"),
            metadata={"format": "pt"},
        )
        return
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        groups.setdefault(_group(key), {})[key] = tensor.contiguous()
    names = sorted(groups)
    weight_map = {}
    for i, g in enumerate(names):
        file = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        save_file(groups[g], os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(groups[g], file))
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def fp8_config_dict(config: Glm53Config, block=BLOCK) -> dict:
    d = config.to_official_dict()
    d["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": list(NOT_CONVERTED),
    }
    d["dtype"] = "bfloat16"
    return d


@functools.cache
def _official_state() -> dict[str, torch.Tensor]:
    """A random tiny model's official state (written and read back) plus a real transformers vision tower."""
    config = tiny_config()
    hf = hf_model(config, seed=3)  # only for real vision-tower tensors
    vision = {k: v.detach().clone() for k, v in hf.state_dict().items() if k.startswith("model.visual.")}
    base = os.path.join(_TMP, "fp32")
    random_model(config).save_pretrained(base)
    return {**read_all(base), **vision}


@functools.cache
def fp8_source(mtp_indexer: bool = True) -> tuple[str, dict[str, torch.Tensor]]:
    """(directory of the sharded FP8 checkpoint, the unquantised official state it was made from)."""
    config = tiny_config()
    state = dict(_official_state())
    state.update(mtp_tensors(state, config, with_indexer=mtp_indexer))
    path = os.path.join(_TMP, f"fp8-mtp-indexer-{mtp_indexer}")
    write_checkpoint(path, quantize_state(state), fp8_config_dict(config))
    return path, state


def fp8_error_bound(original: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """Largest e4m3 round-off per element: 2^-4 relative (3 mantissa bits) or half the subnormal step 2^-9."""
    s = scale_inv.repeat_interleave(block[0], 0)[: original.shape[0]].repeat_interleave(block[1], 1)
    return original.abs() * 2.0**-4 + s[:, : original.shape[1]] * 2.0**-10
