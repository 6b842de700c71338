"""Checkpoints in the official layout (what the release ships and transformers' save_pretrained writes).

layout.py   key names and the mapping to glm53's module names (per-expert keys <-> fused experts, MTP)
reader.py   which file holds each key; lazy, validated safetensors reads with FP8 dequantisation
fp8.py      block-scaled e4m3 dequantisation (and its per-block loop reference)
load.py     `load_checkpoint`: check every key and shape, then fill the model
save.py     `save_checkpoint`: the official layout, sharded, atomic
shards.py   the sharded safetensors writer and the atomic directory
convert.py  transformers' in-memory state dict <-> glm53's
crop.py     `python -m glm53.checkpoint.crop` (also `python -m glm53.tools.crop`): file-level crop
"""

from ..errors import CheckpointError
from .convert import from_transformers, from_transformers_state_dict, to_transformers_state_dict
from .layout import iter_official_state, mtp_official_state
from .load import load_checkpoint
from .reader import checkpoint_files
from .save import save_checkpoint

__all__ = [
    "CheckpointError",
    "checkpoint_files",
    "from_transformers",
    "from_transformers_state_dict",
    "iter_official_state",
    "load_checkpoint",
    "mtp_official_state",
    "save_checkpoint",
    "to_transformers_state_dict",
]
