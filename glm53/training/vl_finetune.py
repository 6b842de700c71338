"""Fine-tuning the VL model on image/video records: `glm53 train --init VL_DIR --data vl.jsonl --media-root DIR`.

Legend: B batch (rows per micro-batch), T time (--seq-len), N patch rows.
A run is a VL run when its --data file holds image/video records (data/vl_records.py). Then --init (or
--resume) loads Glm53ForConditionalGeneration (a text-only checkpoint is an error naming it), the groups of
--freeze get requires_grad False before the optimizer is built (so they get neither gradients nor optimizer
state; default: the vision tower frozen, the projector and the language model trained), and `VLFileData` is
the trainer's data source: records read, expanded and packed whole (data/vl_tokenize.py, data/vl_pack.py), the
processors configured from the checkpoint's vision_config, each rank decoding only the pixels of its own rows.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ..config import Glm53Config
from ..vision.image_processing import MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS, ImageProcessor
from ..vision.video_processing import MAX_VIDEO_TOKENS, VideoProcessor
from .args import positive_int
from .data.documents import DataError
from .data.pack import Batch
from .data.tokenize import TextTokenizer
from .data.vl_pack import VLBatch, VLPacker, fit_records, make_batch
from .data.vl_records import _is_vl, read_vl_records
from .data.vl_tokenize import (
    IMAGE,
    IMAGE_END,
    IMAGE_START,
    VIDEO,
    VIDEO_END,
    VIDEO_START,
    VLEncoder,
)
from .finetune import file_digest

DEFAULT_FREEZE = "vision_tower"  # what users expect of VL fine-tuning (xtuner's default) when --freeze is not given
TOKEN_FIELDS = {
    IMAGE: "image_token_id",
    VIDEO: "video_token_id",
    IMAGE_START: "image_start_token_id",
    IMAGE_END: "image_end_token_id",
    VIDEO_START: "video_start_token_id",
    VIDEO_END: "video_end_token_id",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--media-root",
        metavar="DIR",
        help="image/video paths of --data are resolved under DIR and must "
        "stay inside it (default: the --data file's directory)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="VL runs: an image/video record longer than --seq-len is an error (default: skipped, counted)",
    )
    p.add_argument("--image-min-tokens", type=positive_int, default=MIN_IMAGE_TOKENS, metavar="N")
    p.add_argument(
        "--image-max-tokens",
        type=positive_int,
        default=MAX_IMAGE_TOKENS,
        metavar="N",
        help="language-model tokens per image at most (larger images are scaled down)",
    )
    p.add_argument(
        "--video-max-tokens",
        type=positive_int,
        default=MAX_VIDEO_TOKENS,
        metavar="N",
        help="language-model tokens per video at most (all sampled frames together)",
    )


def first_vl_record(path: str | None) -> str | None:
    """FILE:LINE of the first image/video record of a .jsonl data file (None: a text-only file or no file)."""
    if not path or not path.lower().endswith(".jsonl") or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            try:
                if line.strip() and _is_vl(json.loads(line)):
                    return f"{path}:{number}"
            except json.JSONDecodeError:
                continue  # reported with its line by the reader
    return None


def check_args(args: argparse.Namespace, vl_record: str | None, distributed: bool = False) -> None:
    """VL flags without VL data are a usage error (before any work); LoRA flags with VL data under torchrun are
    not supported yet (one process trains LoRA on the VL model: `build_model`)."""
    if vl_record is None:
        if args.media_root is not None:
            raise SystemExit(f"--media-root is for image/video data, but --data {args.data} has no image/video records")
        return
    if distributed:
        check_no_lora(args)


def vl_model_class() -> type:
    from ..vision.model import Glm53ForConditionalGeneration

    return Glm53ForConditionalGeneration


def check_vl_checkpoint(path: str | None, vl_record: str) -> None:
    """VL data needs a checkpoint with a vision tower: a SystemExit naming both otherwise."""
    from ..vision.config import has_vision

    if path is None:
        raise SystemExit(
            f"glm53 train: error: --data has image/video records (the first at {vl_record}): start from "
            f"a vision-language checkpoint with --init DIR"
        )
    if not has_vision(Glm53Config.from_pretrained(path)):
        raise SystemExit(
            f"glm53 train: error: --data has image/video records (the first at {vl_record}) but {path} "
            f"is a text-only checkpoint (its config.json has no vision_config); start from a "
            f"vision-language checkpoint"
        )


def init_model(path: str, vl_record: str):
    """The VL model of checkpoint `path` (one process); a text-only checkpoint is a SystemExit naming both."""
    check_vl_checkpoint(path, vl_record)
    return vl_model_class().from_pretrained(path)


def apply_freeze(model: torch.nn.Module, groups: list[str] | None) -> list[str]:
    """requires_grad False on every parameter of `groups` (glm53.peft's --freeze groups, vision_tower and projector
    among them, or module-name patterns; None: the VL default, the vision tower) -> the frozen names."""
    from ..peft import freeze

    return freeze(model, [DEFAULT_FREEZE] if groups is None else groups)


LORA_FLAGS = ("lora_rank", "base_dtype", "export_merged")  # the flags that build the model through glm53.peft


def check_no_lora(args: argparse.Namespace) -> None:
    """LoRA and frozen-base options on the VL model under torchrun are not wired yet: an error, never a text-only
    run."""
    for flag in LORA_FLAGS:
        if getattr(args, flag, None) is not None:
            raise SystemExit(
                f"glm53 train: error: --{flag.replace('_', '-')} with image/video --data under torchrun is not "
                f"supported yet; run LoRA on the VL model in one process, or fine-tune with --freeze groups"
            )


def _lora_base(args: argparse.Namespace) -> str | None:
    """The checkpoint a VL LoRA run's base is read from: --init, or the base a LoRA --resume directory records."""
    if args.init or not args.resume:
        return args.init
    from ..peft.files import CONFIG_FILE

    file = os.path.join(args.resume, CONFIG_FILE)
    if not os.path.isfile(file):
        return args.resume
    with open(file, encoding="utf-8") as f:
        return json.load(f).get("base_model_name_or_path") or args.resume


def build_model(args: argparse.Namespace, vl_record: str) -> tuple[torch.nn.Module, bool]:
    """The VL model of one process -> (model, whether glm53.peft built it). With --lora-rank / --base-dtype /
    --export-merged it is glm53.peft's build (adapters on the default targets, the projector among them, over a
    frozen base: the tower gets no adapter and stays frozen; --resume reads a LoRA run's adapter); without
    --lora-rank and --freeze the tower is frozen as in a full fine-tune. Otherwise `init_model` + `apply_freeze`."""
    from ..peft import cli as peft_cli

    if any(getattr(args, f, None) is not None for f in LORA_FLAGS):
        check_vl_checkpoint(_lora_base(args), vl_record)
        model = peft_cli.build_model(args, cls=vl_model_class())
        if args.lora_rank is None and args.freeze is None:
            apply_freeze(model, None)
        return model, True
    model = init_model(args.init or args.resume, vl_record)
    apply_freeze(model, args.freeze)
    peft_cli.hold_frozen_router_bias(model, args)
    return model, False


def model_inputs(model, batch: Batch) -> dict[str, torch.Tensor]:
    """The VL forward's keyword arguments: ids, labels, mask, the documents' position_ids, the vision inputs."""
    inputs = dict(
        input_ids=batch.input_ids,
        labels=batch.labels,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
    )
    if isinstance(batch, VLBatch):
        inputs.update(batch.vision_inputs())
    return inputs


def media_count(micro: list[dict[str, torch.Tensor]], device) -> torch.Tensor:
    """The micro-batches of this rank's step that hold an image or a video (a tensor, to be summed over ranks)."""
    return torch.tensor(
        float(sum(1 for m in micro if "pixel_values" in m or "pixel_values_videos" in m)), device=device
    )


def drop_dummy_tower_grads(model, media: torch.Tensor) -> None:
    """`media`: the step's micro-batches with an image or video over every rank. None at all: the tower's gradients
    are the zeros of its dummy forward (FSDP's collectives need it), where one process has none; dropped, so the
    optimizer skips the tower as one process's does (no weight decay, moment or step-count update) and every layout
    trains alike."""
    if media.item() == 0:  # NOTE: syncs
        for p in model.visual.parameters():
            p.grad = None


def processors(model, args: argparse.Namespace) -> tuple[ImageProcessor, VideoProcessor]:
    """The image and video processors of the model's vision_config, with the budgets of `args`."""
    vc = model.vision_config
    shape = dict(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size, temporal_patch_size=vc.temporal_patch_size)
    images = ImageProcessor(min_tokens=args.image_min_tokens, max_tokens=args.image_max_tokens, **shape)
    videos = VideoProcessor(min_tokens=args.image_min_tokens, max_tokens=args.video_max_tokens, **shape)
    return images, videos


def check_media_token_ids(encoder: VLEncoder, model, tokenizer_dir: str) -> None:
    """The tokenizer's media tokens must be the model's (config token ids), or every splice would misfire."""
    for text, name in TOKEN_FIELDS.items():
        if encoder.ids[text] != getattr(model.token_ids, name):
            raise DataError(
                f"--tokenizer {tokenizer_dir}: {text} is id {encoder.ids[text]} but the model's config "
                f"has {name} {getattr(model.token_ids, name)}; use the checkpoint's own tokenizer"
            )


class VLFileData:
    """Packed VL rows from --data; `next_step` -> this rank's micro-batches (VLBatch) of one optimizer step."""

    def __init__(self, args: argparse.Namespace, tokenizer_dir: str, model, dp: int, dp_rank: int) -> None:
        self.path, self.dp, self.dp_rank = args.data, dp, dp_rank
        self.batch_size, self.grad_accum, self.seq_len = args.batch_size, args.grad_accum, args.seq_len
        self.tokenizer = TextTokenizer(tokenizer_dir)
        self.encoder = VLEncoder(self.tokenizer, *processors(model, args))
        check_media_token_ids(self.encoder, model, tokenizer_dir)
        records, empty = read_vl_records(args.data, args.media_root)
        docs = [self.encoder.encode(r) for r in records]
        self.skipped = {"without text": empty, "without target tokens": 0, "longer than --seq-len": 0}
        docs = [d for d in docs if any(d.targets[1:]) or self._skip("without target tokens")]
        vocab = model.config.vocab_size
        for doc in docs:
            if max(doc.ids) >= vocab:
                raise DataError(
                    f"{doc.where}: token id {max(doc.ids)} from --tokenizer {tokenizer_dir} is outside "
                    f"the model's vocabulary (vocab_size {vocab})"
                )
        kept, long = fit_records(docs, args.seq_len, args.strict)
        self.skipped["longer than --seq-len"] = len(long)
        if not kept:
            raise DataError(f"--data {args.data}: no record has a token to train on ({self._skip_text()})")
        self.docs, self.digest, self.media_root = kept, file_digest(args.data), args.media_root
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else (model.config.pad_token_id or 0)
        self.packer, self.pad = VLPacker(kept, args.seq_len, args.seed, pad), pad
        self.step_media_tokens = 0  # placeholder tokens in this rank's last step (logged beside the loss)

    def _skip(self, why: str) -> bool:
        self.skipped[why] += 1
        return False

    def _skip_text(self) -> str:
        return ", ".join(f"{n} {why}" for why, n in self.skipped.items() if n) or "nothing"

    def describe(self) -> str:
        images = sum(1 for d in self.docs for s in d.media if s.kind == "image")
        videos = sum(1 for d in self.docs for s in d.media if s.kind == "video")
        media = sum(s.grid[0] * s.grid[1] * s.grid[2] for d in self.docs for s in d.media) // (
            self.encoder.images.merge_size**2
        )
        tokens = sum(len(d.ids) for d in self.docs)
        targets = sum(sum(d.targets[1:]) for d in self.docs)
        return (
            f"data {self.path}: {len(self.docs)} records ({sum(1 for d in self.docs if d.media)} with media: "
            f"{images} images, {videos} videos), {tokens:,} tokens ({media:,} image/video tokens, {targets:,} "
            f"loss targets); skipped: {self._skip_text()}"
        )

    def summary(self) -> str:
        s = self.packer.stats
        pos = self.packer.state_dict()
        return (
            f"data: packed {s.rows} rows ({s.padding / max(1, s.rows * self.seq_len):.1%} padding); next: epoch "
            f"{pos['epoch']}, record {pos['index']} of {len(self.docs)}; skipped: {self._skip_text()}"
        )

    def next_step(self) -> list[VLBatch]:
        """All dp ranks pack the step's rows alike (token lists only); this rank decodes its own rows' pixels."""
        per_rank = self.batch_size * self.grad_accum
        mine = self.packer.rows(per_rank * self.dp, slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank))
        batches = [
            make_batch(mine[m * self.batch_size : (m + 1) * self.batch_size], self.encoder)
            for m in range(self.grad_accum)
        ]
        self.step_media_tokens = sum(b.media_tokens() for b in batches)
        return batches

    def eval_batches(self, path: str, batch_size: int) -> list[VLBatch]:
        """--eval-data FILE (image/video records under --media-root, or text): this rank's held-out batches,
        encoded with the run's tokenizer and image/video budgets."""
        return eval_batches(
            self.encoder, path, self.seq_len, batch_size, self.dp, self.dp_rank, self.media_root, self.pad
        )

    def state_dict(self) -> dict:
        return {"file_sha256": self.digest, "documents": len(self.docs), **self.packer.state_dict()}

    def load_state_dict(self, state: dict, where: str) -> None:
        if state.get("file_sha256") != self.digest or state.get("documents") != len(self.docs):
            raise SystemExit(
                f"--resume {where} was trained on a different --data file than {self.path} (its "
                f"sha256 or record count differs); resume with the same file"
            )
        try:
            self.packer.load_state_dict(state)
        except ValueError as e:
            raise SystemExit(f"glm53 train: error: --resume {where}: {e}") from None


def _eval_rows(encoder: VLEncoder, path: str, seq_len: int, media_root: str | None, pad: int) -> list:
    """Every record of held-out file `path` with a target token, packed once in file order (seed 0) into rows
    (VLPacker.vl_row's); records longer than `seq_len` are skipped, as in training."""
    docs = [encoder.encode(r) for r in read_vl_records(path, media_root)[0]]
    docs, _ = fit_records([d for d in docs if any(d.targets[1:])], seq_len, strict=False)
    if not docs:
        raise DataError(f"--eval-data {path}: no record has a token to evaluate (within --seq-len {seq_len})")
    packer, rows = VLPacker(docs, seq_len, 0, pad), []
    while packer.epoch == 0:
        rows.append(packer.vl_row())
    return rows


def eval_batches(
    encoder: VLEncoder,
    path: str,
    seq_len: int,
    batch_size: int,
    dp: int,
    dp_rank: int,
    media_root: str | None,
    pad: int,
) -> list[VLBatch]:
    """This data rank's share of the held-out VL rows (rows dp_rank, dp_rank + dp, ... as finetune.eval_batches
    deals them; a rank left without rows gets one row of padding, so every rank runs the same forwards), with the
    pixels of its own rows only."""
    rows = _eval_rows(encoder, path, seq_len, media_root, pad)
    mine = rows[dp_rank::dp] or [(([pad] * seq_len, [-100] * seq_len, [0] * seq_len, list(range(seq_len))), [])]
    return [make_batch(mine[i : i + batch_size], encoder) for i in range(0, len(mine), batch_size)]


@torch.no_grad()
def heldout_loss(
    model, path: str, tokenizer_dir: str, seq_len: int, media_root: str | None = None, batch_size: int = 8
) -> tuple[float, int]:
    """(next-token loss over every target token of every record of `path`, image/video tokens seen), packed as
    for training in file order (eval mode). Records longer than `seq_len` are skipped, as in training; `glm53 train
    --eval-data` computes the same numbers (Trainer.evaluate over `eval_batches`)."""
    args = argparse.Namespace(
        image_min_tokens=MIN_IMAGE_TOKENS, image_max_tokens=MAX_IMAGE_TOKENS, video_max_tokens=MAX_VIDEO_TOKENS
    )
    encoder = VLEncoder(TextTokenizer(tokenizer_dir), *processors(model, args))
    batches = eval_batches(encoder, path, seq_len, batch_size, 1, 0, media_root, encoder.tok.pad_id or 0)
    inputs = [model_inputs(model, b) for b in batches]
    counts = [model.loss_counts(i["labels"], i["attention_mask"], i["position_ids"]) for i in inputs]
    den = sum(counts[1:], counts[0])
    was_training = model.training
    model.eval()
    total = sum(model(**i, loss_denominators=den, return_logits=False).lm_loss for i in inputs)
    model.train(was_training)
    return float(total), sum(b.media_tokens() for b in batches)


__all__ = [
    "DEFAULT_FREEZE",
    "VLFileData",
    "add_arguments",
    "apply_freeze",
    "build_model",
    "check_args",
    "eval_batches",
    "first_vl_record",
    "heldout_loss",
    "init_model",
    "model_inputs",
]
