"""Crop an official-layout checkpoint to its first N layers: `python -m glm53.tools.crop SRC DST --num-layers N`.

Works on files only (the 313B release never becomes a model): keeps the embedding, main layers 0..N-1, the
final norm, lm_head, the vision tower and every other non-layer tensor, and renames the MTP layer(s) stored
after the main layers (`layers.{L}` with L = the source's num_hidden_layers) to `layers.{N}`. FP8 tensors
(float8_e4m3fn with a `<name>_scale_inv` companion) are dequantised to `--dtype` (bfloat16 by default) and
their scales dropped; every other tensor is copied bit for bit. config.json is rewritten (`rewrite_config`),
other files of SRC (tokenizer, generation config) are copied. Source shards are read one at a time, a tensor at
a time; the output is sharded with an index and written atomically (glm53.checkpoint.shards.atomic_directory).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from ..config import INDEXED_ATTENTION, LINEAR_ATTENTION, Glm53Config
from ..errors import CheckpointError
from . import fp8
from .paths import confined, is_inside
from .reader import READ_ERRORS, check_readable, checkpoint_files, reason
from .shards import ShardedWriter, atomic_directory, checkpoint_owns, copy_side_files, write_json

# A decoder-layer key of the text model (nested `model.language_model.` or flat `model.` prefix).
_TEXT_LAYER = re.compile(r"^(model\.language_model\.|model\.)layers\.(\d+)\.(.*)$")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Bytes per element of each safetensors dtype string (for sizes computed from headers alone).
_ITEM_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class CropError(ValueError):
    """A crop that cannot be done; the message says why and what to change."""


@dataclass
class Entry:
    src: str  # key in the source
    dst: str  # key in the output
    file: str  # source shard holding it
    shape: tuple[int, ...]
    src_dtype: str  # safetensors dtype string
    dequantize: bool  # FP8 with a scale: dequantised to the output dtype
    scale_file: str | None = None  # shard holding `<src>_scale_inv` when dequantize

    def out_bytes(self, dtype: torch.dtype) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        if self.dequantize:
            return numel * torch.empty((), dtype=dtype).element_size()
        if self.src_dtype not in _ITEM_BYTES:
            raise CropError(f"tensor {self.src!r} has a dtype this tool does not know: {self.src_dtype}")
        return numel * _ITEM_BYTES[self.src_dtype]


@dataclass
class Plan:
    config: dict[str, Any]  # the rewritten config.json
    entries: list[Entry] = field(default_factory=list)  # in reading order (by source shard)
    shards: list[str] = field(default_factory=list)  # source shard files read, in order
    block_size: tuple[int, int] = fp8.DEFAULT_BLOCK_SIZE
    out_bytes: int = 0


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def rewrite_config(config: dict[str, Any], n: int) -> dict[str, Any]:
    """config.json of the first `n` layers; every field not listed here is kept as it was.

    num_hidden_layers = n; `layer_types`, `mlp_layer_types`, `indexer_types` and `index_topk_pattern`
    truncated; `linear_attn_config.kda_layers` / `full_attn_layers` (1-based) recomputed when present;
    `first_k_dense_replace` clamped to n; `quantization_config` removed (the output holds no FP8).
    """
    source = Glm53Config.from_dict(config)  # derives the schedules, validates the source
    _check_layers(n, source.num_hidden_layers)
    out = copy.deepcopy(config)
    text = _text(out)
    text["num_hidden_layers"] = n
    for name in ("layer_types", "mlp_layer_types", "indexer_types", "index_topk_pattern"):
        if isinstance(text.get(name), (list, str)):
            text[name] = text[name][:n]
    linear = text.get("linear_attn_config")
    if isinstance(linear, dict):
        types = source.layer_types[:n]
        if "kda_layers" in linear:
            linear["kda_layers"] = [i + 1 for i, t in enumerate(types) if t == LINEAR_ATTENTION]
        if "full_attn_layers" in linear:
            linear["full_attn_layers"] = [i + 1 for i, t in enumerate(types) if t == INDEXED_ATTENTION]
    if isinstance(text.get("first_k_dense_replace"), int):
        text["first_k_dense_replace"] = min(text["first_k_dense_replace"], n)
    out.pop("quantization_config", None)
    text.pop("quantization_config", None)
    Glm53Config.from_dict(out)  # the cropped config must itself be valid
    return out


def _check_layers(n: int, total: int) -> None:
    if not isinstance(n, int) or n < 1 or n > total:
        raise CropError(f"--num-layers must be between 1 and the source's num_hidden_layers ({total}), got {n}")


def _check_shared_indexers(source: Glm53Config, n: int, mtp_keys: list[str]) -> None:
    """The MTP layer must keep the 'full' indexer layer whose top-k it reuses.

    Main layers cannot lose theirs: a kept 'shared' layer's full layer comes earlier (Glm53Config validates
    that), so a prefix keeps it. The MTP layer is an attention layer stored after the main layers; without
    indexer weights of its own it reuses the top-k of the main model's last 'full' layer, which may be cropped.
    """
    fulls = [i for i in source.attention_layers if source.indexer_types[i] == "full"]
    has_attention = any(".self_attn." in k for k in mtp_keys)
    has_indexer = any(".self_attn.indexer." in k for k in mtp_keys)
    if has_attention and not has_indexer and fulls and fulls[-1] >= n:
        raise CropError(
            f"the MTP layer (layers.{source.num_hidden_layers}) has a shared indexer: it reuses the top-k of "
            f"layer {fulls[-1]}, the last 'full' indexer layer, which --num-layers {n} crops away; keep at least "
            f"{fulls[-1] + 1} layers"
        )


def plan_crop(src: str, n: int, dtype: torch.dtype = torch.bfloat16) -> Plan:
    """Decide every output tensor from the source's config, index and safetensors headers (no tensor data)."""
    config_path = os.path.join(src, "config.json")
    if not os.path.isfile(config_path):
        raise CropError(f"no config.json in {src}")
    try:
        confined(src, "config.json", src)  # a config.json symlinked out of SRC is not SRC's
    except CheckpointError as e:
        raise CropError(str(e)) from e
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CropError(f"{config_path} cannot be read as JSON: {reason(e)}") from e
    source = Glm53Config.from_dict(config)
    total = source.num_hidden_layers
    _check_layers(n, total)
    try:
        files = checkpoint_files(src)
    except (FileNotFoundError, ValueError) as e:
        raise CropError(str(e)) from None
    quant = config.get("quantization_config") or _text(config).get("quantization_config")
    plan = Plan(config=rewrite_config(config, n), block_size=fp8.weight_block_size(quant))
    mtp_keys = []
    handles = {}
    for key, file in sorted(files.items(), key=lambda kv: (kv[1], kv[0])):
        if key.endswith(fp8.SCALE_SUFFIX) and key[: -len(fp8.SCALE_SUFFIX)] in files:
            continue  # read with its weight
        dst = key
        if m := _TEXT_LAYER.match(key):
            layer = int(m[2])
            if total <= layer:
                dst = f"{m[1]}layers.{n + layer - total}.{m[3]}"
                mtp_keys.append(key)
            elif layer >= n:
                continue
        info = _slice(handles, file, key)
        shape, src_dtype = tuple(info.get_shape()), info.get_dtype()
        dequantize = fp8.is_fp8(src_dtype)
        if not dequantize and key + fp8.SCALE_SUFFIX in files:
            # the loader refuses such a checkpoint (an unexpected key); dropping the scale would hide that
            raise CropError(f"{key + fp8.SCALE_SUFFIX} is the block scale of {key}, which is {src_dtype}, not FP8")
        if dequantize:
            scale = key + fp8.SCALE_SUFFIX
            scale_shape = None
            if scale in files:
                scale_shape = tuple(_slice(handles, files[scale], scale).get_shape())
            try:
                fp8.check_scale(key, shape, scale_shape, plan.block_size)
            except ValueError as e:
                raise CropError(str(e)) from None
        entry = Entry(
            key, dst, file, shape, src_dtype, dequantize, files[key + fp8.SCALE_SUFFIX] if dequantize else None
        )
        plan.entries.append(entry)
        plan.out_bytes += entry.out_bytes(dtype)
        for needed in (file, entry.scale_file):
            if needed is not None and needed not in plan.shards:
                plan.shards.append(needed)
    _check_shared_indexers(source, n, mtp_keys)
    return plan


def _human(nbytes: float) -> str:
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            break
        nbytes /= 1000
    return f"{nbytes} B" if unit == "B" else f"{nbytes:.1f} {unit}"


def print_plan(plan: Plan, dtype: torch.dtype, out=None) -> None:
    """--dry-run: the selected tensors, the source shards read and the output size."""
    out = out or sys.stdout
    for e in plan.entries:
        kind = f"{e.src_dtype} -> {str(dtype).replace('torch.', '')}" if e.dequantize else e.src_dtype
        rename = f" -> {e.dst}" if e.dst != e.src else ""
        print(f"{e.src}{rename}  {list(e.shape)}  {kind}  [{os.path.basename(e.file)}]", file=out)
    print(f"source shards read ({len(plan.shards)}):", file=out)
    for file in plan.shards:
        print(f"  {os.path.basename(file)}", file=out)
    print(f"output: {len(plan.entries)} tensors, {plan.out_bytes} bytes ({_human(plan.out_bytes)})", file=out)


def crop(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    num_layers: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    dry_run: bool = False,
    log=None,
) -> Plan:
    """Crop SRC to its first `num_layers` layers into DST (see the module docstring) -> the plan carried out.

    Progress goes to `log` (stderr by default); `dry_run` prints the plan to stdout and writes nothing.
    """
    log = log or sys.stderr
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    if not os.path.isdir(src):
        what = "is not a directory" if os.path.lexists(src) else "does not exist"
        raise CropError(f"source checkpoint directory {src} {what}")
    # Resolved paths: a symlink to (or inside) SRC must not slip past the check.
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if is_inside(real_dst, real_src) or is_inside(real_src, real_dst):
        raise CropError(
            f"DST ({dst}, resolved {real_dst}) must not be SRC or lie inside it (or contain it); "
            f"SRC resolves to {real_src}"
        )
    if os.path.lexists(dst) and not overwrite and not dry_run:
        raise CropError(f"{dst} already exists; pass --overwrite to replace it")
    plan = plan_crop(src, num_layers, dtype)
    if dry_run:
        print_plan(plan, dtype)
        return plan
    with atomic_directory(dst, overwrite=overwrite, own=checkpoint_owns) as tmp:
        writer = ShardedWriter(tmp, max_shard_size)
        handles, done = {}, 0
        for i, file in enumerate(plan.shards):
            entries = [e for e in plan.entries if e.file == file]  # (a shard may hold only scales)
            print(
                f"[{i + 1}/{len(plan.shards)}] {os.path.basename(file)}: {len(entries)} tensors "
                f"({_human(done)} of {_human(plan.out_bytes)} written)",
                file=log,
                flush=True,
            )
            for e in entries:
                writer.add(e.dst, _read(e, plan, handles, dtype))
                done += e.out_bytes(dtype)
            handles.pop(file, None)  # done with this shard
        writer.finish()
        write_json(os.path.join(tmp, "config.json"), plan.config)
        copy_side_files(src, tmp)
    print(f"wrote {dst}: {len(plan.entries)} tensors, {_human(plan.out_bytes)}", file=log, flush=True)
    return plan


def _open(handles: dict, file: str):
    if file not in handles:
        try:
            check_readable(file)
        except CheckpointError as e:
            raise CropError(str(e)) from None
        try:
            handles[file] = safe_open(file, framework="pt")
        except READ_ERRORS as e:
            raise CropError(f"{file} cannot be read as safetensors: {reason(e)}") from e
    return handles[file]


def _slice(handles: dict, file: str, key: str):
    handle = _open(handles, file)
    try:
        return handle.get_slice(key)
    except READ_ERRORS as e:
        raise CropError(f"{file}: cannot read tensor {key!r}: {reason(e)}") from e


def _get(handles: dict, file: str, key: str) -> torch.Tensor:
    handle = _open(handles, file)
    try:
        return handle.get_tensor(key)
    except READ_ERRORS as e:
        raise CropError(f"{file}: cannot read tensor {key!r}: {reason(e)}") from e


def _read(e: Entry, plan: Plan, handles: dict, dtype: torch.dtype) -> torch.Tensor:
    """One output tensor: FP8 dequantised to `dtype`, anything else exactly as stored."""
    tensor = _get(handles, e.file, e.src)
    if not e.dequantize:
        return tensor
    scale = _get(handles, e.scale_file, e.src + fp8.SCALE_SUFFIX)
    return fp8.dequantize(tensor, scale, plan.block_size, dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm53.tools.crop", description=__doc__.split("\n")[0])
    parser.add_argument("src", help="source checkpoint directory (official layout, BF16 or FP8)")
    parser.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--num-layers", type=int, required=True, help="main layers to keep (1..source's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of dequantised FP8")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output shard (e.g. 5GB, 500MB)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    args = parser.parse_args(argv)
    try:
        crop(
            args.src,
            args.dst,
            args.num_layers,
            dtype=DTYPES[args.dtype],
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            dry_run=args.dry_run,
        )
    except (CropError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the machine said no (permissions, a full disk, a read-only file system): nothing written
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: cannot write {args.dst}: {e.strerror or e}{where}; nothing was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
