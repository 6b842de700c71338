"""Fine-tune a vision-language checkpoint on your own image/video conversations, end to end, nothing downloaded.

    python examples/finetune_vl.py --out runs/finetune-vl-example

writes into --out (legend: no tensors here; the files are what a user brings):
    base/          examples/finetune.py's BPE tokenizer plus the GLM media tokens (<|image|>, <|begin_of_image|>,
                   ...) and a tiny random Glm53ForConditionalGeneration (a 2-block vision tower, patch 2, so one
                   language-model token per 4 x 4 pixels) whose config names those token ids
    media/         generated images (solid colours with noise) and a folder of video frames
    train.jsonl    records in both conventions users bring: transformers/OpenAI content lists and LLaMA-Factory
                   "images"/"videos" lists with <image>/<video> placeholders, plus text-only records
    heldout.jsonl  the same kind of records about other images
then runs
    python -m glm53 train --init OUT/base --data OUT/train.jsonl --media-root OUT/media --seq-len 128 --steps 30
        --save OUT/tuned                       (the vision tower frozen: the default --freeze vision_tower)
    python -m glm53 generate --model OUT/tuned --image OUT/media/heldout0.png --prompt "What colour?"
and prints the held-out loss of base/ and tuned/. Replace base/ by a real GLM-5.3 VL checkpoint directory and the
records by yours to fine-tune for real; the tests build their VL fixtures with the builders below.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import torch

from glm53.training.data.vl_tokenize import MEDIA_TOKENS
from glm53.training.vl_finetune import TOKEN_FIELDS, heldout_loss

# A tiny tower: 2 blocks of width 16, patch 2, merge 2; its output width is the text model's hidden size.
TOWER = dict(
    depth=2,
    hidden_size=16,
    num_heads=2,
    intermediate_size=24,
    projection_intermediate_size=20,
    patch_size=2,
    temporal_patch_size=2,
    in_channels=3,
    spatial_merge_size=2,
)
VOCAB_MULTIPLE = 64
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


def build_vl_tokenizer():
    """examples/finetune.py's tokenizer (chat template included) with the six media tokens added."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from finetune import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(MEDIA_TOKENS)})
    return tok


def build_vl_model(tok, seed: int = 0, tower: dict | None = None, text: dict | None = None):
    """A random tiny Glm53ForConditionalGeneration whose vocabulary and media token ids are `tok`'s (`tower`,
    `text`: config overrides)."""
    from glm53 import Glm53Config
    from glm53.vision import with_vision
    from glm53.vision.model import Glm53ForConditionalGeneration

    config = Glm53Config.tiny(
        hidden_size=36,
        q_lora_rank=20,
        kv_lora_rank=12,
        num_nextn_predict_layers=1,
        vocab_size=-(-len(tok) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        **(text or {}),
    )
    ids = {name: tok.convert_tokens_to_ids(t) for t, name in TOKEN_FIELDS.items()}
    config = with_vision(config, {**TOWER, "out_hidden_size": config.hidden_size, **(tower or {})}, ids)
    torch.manual_seed(seed)
    return Glm53ForConditionalGeneration(config)


def write_media_and_records(root: str, n: int, prefix: str = "img", seed: int = 0) -> list[dict]:
    """`n` small noisy solid-colour images (16..28 px) under `root` and a record about each ("What colour?" ->
    the colour), alternating the two conventions; one video record (a folder of 4 frames) and two text records."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    records = []
    for k in range(n):
        name = list(COLOURS)[k % len(COLOURS)]
        h, w = (int(v) for v in rng.integers(16, 29, 2))
        pixels = np.clip(np.array(COLOURS[name]) + rng.integers(-20, 21, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, f"{prefix}{k}.png"))
        if k % 2:
            records.append(
                {
                    "messages": [
                        {"role": "user", "content": "<image>What colour?"},
                        {"role": "assistant", "content": name},
                    ],
                    "images": [f"{prefix}{k}.png"],
                }
            )
        else:
            records.append(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image", "image": f"{prefix}{k}.png"},
                                {"type": "text", "text": "What colour?"},
                            ],
                        },
                        {"role": "assistant", "content": [{"type": "text", "text": name}]},
                    ]
                }
            )
    frames = os.path.join(root, f"{prefix}-clip")
    os.makedirs(frames, exist_ok=True)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(os.path.join(frames, f"{i}.png"))
    records.append(
        {
            "messages": [{"role": "user", "content": "<video>Is it noise?"}, {"role": "assistant", "content": "yes"}],
            "videos": [{"path": f"{prefix}-clip", "fps": 2}],
        }
    )
    records += [{"text": "red green blue"}, {"prompt": "Say blue", "completion": "blue"}]
    return records


def write_jsonl(path: str, records: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def prepare(out: str, seed: int = 0) -> dict[str, str]:
    """OUT/base (tokenizer + VL checkpoint), OUT/media, OUT/train.jsonl, OUT/heldout.jsonl -> their paths."""
    paths = {
        k: os.path.join(out, v)
        for k, v in (("base", "base"), ("media", "media"), ("train", "train.jsonl"), ("heldout", "heldout.jsonl"))
    }
    tok = build_vl_tokenizer()
    build_vl_model(tok, seed).save_pretrained(paths["base"], overwrite=True)
    tok.save_pretrained(paths["base"])
    write_jsonl(paths["train"], write_media_and_records(paths["media"], 12, "img", seed))
    write_jsonl(paths["heldout"], write_media_and_records(paths["media"], 3, "heldout", seed + 1))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/finetune-vl-example")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    paths = prepare(args.out)
    tuned = os.path.join(args.out, "tuned")
    train = [
        sys.executable,
        "-m",
        "glm53",
        "train",
        "--init",
        paths["base"],
        "--data",
        paths["train"],
        "--media-root",
        paths["media"],
        "--seq-len",
        "128",
        "--batch-size",
        "2",
        "--steps",
        str(args.steps),
        "--lr",
        "3e-3",
        "--log-every",
        "10",
        "--save",
        tuned,
        "--overwrite",
    ]
    print("$", " ".join(train), flush=True)
    subprocess.run(train, check=True)
    from glm53.vision.model import Glm53ForConditionalGeneration

    for name, ckpt in (("base", paths["base"]), ("tuned", tuned)):
        model = Glm53ForConditionalGeneration.from_pretrained(ckpt)
        loss, media = heldout_loss(model, paths["heldout"], ckpt, seq_len=128, media_root=paths["media"])
        print(f"held-out loss of {name}: {loss:.4f} ({media} image/video tokens in the held-out rows)")
    generate = [
        sys.executable,
        "-m",
        "glm53",
        "generate",
        "--model",
        tuned,
        "--image",
        os.path.join(paths["media"], "heldout0.png"),
        "--prompt",
        "What colour?",
        "--max-new-tokens",
        "4",
    ]
    print("$", " ".join(generate), flush=True)
    subprocess.run(generate, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
