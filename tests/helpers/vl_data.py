"""VL data fixtures: a tiny BPE tokenizer with the GLM media tokens, generated images/videos, and transformers'
Glm5NextProcessor as the expansion oracle (its video processor needs torchvision, so a stand-in hands it the
grids and frame timestamps; the expansion itself is the processor's own code).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from PIL import Image

from glm53.training.data.vl_tokenize import MEDIA_TOKENS

# GLM-style: content strings, or content lists whose image/video parts the template writes as markers.
MARKER_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% elif p['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif p['type'] == 'video' %}<|begin_of_video|><|video|><|end_of_video|>{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def vl_tokenizer(template: str = "markers"):
    """examples/finetune.py's BPE tokenizer plus the six media tokens; template "markers" (writes the media),
    "plain" (that example's text-only template) or "none"."""
    from examples.finetune import CHAT_TEMPLATE, build_tokenizer

    tok = build_tokenizer(chat_template=template != "none")
    tok.add_special_tokens({"additional_special_tokens": list(MEDIA_TOKENS)})
    if template == "markers":
        tok.chat_template = MARKER_TEMPLATE
    elif template == "plain":
        tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(tok, path: str) -> str:
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(path)
    return path


def write_image(path: str, h: int, w: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def write_frames(folder: str, n: int, h: int, w: int, seed: int = 0) -> str:
    for i in range(n):
        write_image(os.path.join(folder, f"frame_{i:03d}.png"), h, w, seed + i)
    return folder


def write_jsonl(path: str, records: list) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def hf_processor(tok, video_layouts=()):
    """Glm5NextProcessor with the PIL image processor; `video_layouts`: per video (grid, every sampled frame's
    timestamp), what its video processor would return."""
    from transformers.feature_extraction_utils import BatchFeature
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
    from transformers.video_utils import VideoMetadata

    class Processor(Glm5NextProcessor):
        def check_argument_for_proper_class(self, name, arg):  # the stand-in is not a registered class
            return None

    class StandInVideos:
        merge_size = 2
        model_input_names = ["pixel_values_videos", "video_grid_thw"]

        def __call__(self, videos=None, **kwargs):
            grids = [list(g) for g, _ in video_layouts]
            meta = [VideoMetadata(total_num_frames=len(s), fps=1.0, frames_indices=list(s)) for _, s in video_layouts]
            return BatchFeature({"video_grid_thw": torch.tensor(grids), "video_metadata": meta})

    return Processor(image_processor=Glm5NextImageProcessorPil(), tokenizer=tok, video_processor=StandInVideos())


def _example():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune_vl.py")
    spec = importlib.util.spec_from_file_location("finetune_vl_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_vl_model(tok, seed: int = 0, **text):
    """examples/finetune_vl.py's tiny Glm53ForConditionalGeneration (patch 2, merge 2: one language-model token per
    4 x 4 pixels) over `tok`'s vocabulary and media token ids; `text`: text-config overrides."""
    return _example().build_vl_model(tok, seed, text=text)


def vl_corpus(root: str, n: int = 8, seed: int = 0, prefix: str = "img") -> list[dict]:
    """examples/finetune_vl.py's generated images (16..28 px) under `root` and records about them in both
    conventions, one video record, two text-only records (file names start with `prefix`)."""
    return _example().write_media_and_records(root, n, prefix, seed)
