"""A prompt with images and videos for `glm53 generate --image PATH --video PATH --prompt TEXT`.

Legend: T prompt tokens, D model width, N patch rows.
The prompt is the raw text (as for text generation: no chat template) with each image written
`<|begin_of_image|><|image|><|end_of_image|>` and each video `<|begin_of_video|><|video|><|end_of_video|>`, then
expanded exactly as for training (training/data/vl_tokenize.py): at an "<image>" / "<video>" placeholder of the
text (one per --image / --video, in order), or, without placeholders, all images then all videos before the text.
The processors follow the model's vision_config; the features are spliced once, before the prefill.
"""

from __future__ import annotations

import argparse
import os

import torch

from ..errors import InputError
from .data.documents import DataError
from .data.tokenize import TextTokenizer
from .data.vl_pack import make_batch
from .data.vl_records import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    Media,
    _split_placeholders,
)
from .data.vl_tokenize import VLEncoder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image file for a vision-language --model (repeatable; '<image>' in --prompt places it)",
    )
    p.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="PATH",
        help="a video file or a folder of frames (repeatable; '<video>' in --prompt places it)",
    )
    p.add_argument(
        "--video-fps",
        type=float,
        default=None,
        metavar="FPS",
        help="the frame rate of --video frame folders (default 24; video files give their own)",
    )


def vl_prompt(
    model, tokenizer_dir: str, text: str, images: list[str], videos: list[str], video_fps: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [1, T], inputs_embeds [1, T, D] with the media features spliced in) for `model`."""
    from .vl_finetune import check_media_token_ids, processors

    budgets = argparse.Namespace(image_min_tokens=16, image_max_tokens=8000, video_max_tokens=240000)
    encoder = VLEncoder(TextTokenizer(tokenizer_dir), *processors(model, budgets))
    check_media_token_ids(encoder, model, tokenizer_dir)
    media = {
        "image": [Media("image", os.path.abspath(p), "--image") for p in images],
        "video": [Media("video", os.path.abspath(p), "--video", video_fps) for p in videos],
    }
    placed = {"image": text.count(IMAGE_PLACEHOLDER), "video": text.count(VIDEO_PLACEHOLDER)}
    if any(placed.values()):
        for kind, flag in (("image", "--image"), ("video", "--video")):
            if placed[kind] != len(media[kind]):
                raise InputError(
                    f"--prompt has {placed[kind]} <{kind}> placeholders for {len(media[kind])} {flag} "
                    f"files (one per file, in order)"
                )
        parts = _split_placeholders(text, {k: iter(v) for k, v in media.items()})
    else:
        parts = [*media["image"], *media["video"], text]
    ids, spans = [], []
    for part in parts:
        if isinstance(part, str):
            ids += encoder.tok.encode(part)
            continue
        try:
            span = encoder.span(part, "glm53 generate")
        except DataError as e:  # a missing or unreadable file: the user's input, reported as such
            raise InputError(str(e).removeprefix("glm53 generate: ")) from None
        marker = (
            "<|begin_of_image|><|image|><|end_of_image|>"
            if span.kind == "image"
            else "<|begin_of_video|><|video|><|end_of_video|>"
        )
        ids += encoder._expand(marker, [span], "generate")
        spans.append(span)
    row = (ids, [-100] * len(ids), [1] * len(ids), list(range(len(ids))))
    batch = make_batch([(row, spans)], encoder)
    embeds = model.embed_multimodal(
        batch.input_ids, batch.pixel_values, batch.image_grid_thw, batch.pixel_values_videos, batch.video_grid_thw
    )
    return batch.input_ids, embeds


__all__ = ["add_arguments", "vl_prompt"]
