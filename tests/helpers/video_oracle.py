"""transformers 5.23's Glm5NextVideoProcessor rules that run without torchvision, taken from its source.

The module imports torchvision at the top (whose CUDA wheel does not load here), so its pure-Python/torch methods
are compiled from the file itself (ast) and bound to a stand-in holding the class's defaults: `sample_frames`,
`get_num_of_video_patches`, `patchify` and the module's `smart_resize`. Resizing (torchvision) is not among them.
"""

from __future__ import annotations

import ast
import functools
import math
import os
import types

import numpy as np
import torch

METHODS = ("sample_frames", "get_num_of_video_patches", "patchify")
DEFAULTS = dict(
    fps=2,
    max_duration=0,
    max_frames=2048,
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    patch_expand_factor=1,
    min_image_tokens=16,
    max_image_tokens=240000,
)


@functools.cache
def _source() -> ast.Module:
    import transformers

    path = os.path.join(os.path.dirname(transformers.__file__), "models", "glm5_next", "video_processing_glm5_next.py")
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


def video_oracle(**overrides) -> types.SimpleNamespace:
    """A stand-in Glm5NextVideoProcessor: its defaults (plus overrides) and the methods above, bound."""
    from transformers.video_utils import VideoMetadata

    tree = _source()
    namespace = {"np": np, "math": math, "torch": torch, "VideoMetadata": VideoMetadata}
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Glm5NextVideoProcessor")
    nodes += [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    for node in nodes:  # drop annotations that name torchvision types
        node.returns = None
        for arg in node.args.args + node.args.kwonlyargs:
            arg.annotation = None
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "video_processing_glm5_next.py", "exec"), namespace)
    oracle = types.SimpleNamespace(**{**DEFAULTS, **overrides})
    for name in METHODS:
        setattr(oracle, name, types.MethodType(namespace[name], oracle))
    oracle.smart_resize = namespace["smart_resize"]
    return oracle


def replace_video_token(grid_thw, timestamps_all_frames, image_token: str = "<|image|>") -> str:
    """Glm5NextProcessor.replace_video_token for one video, on plain values (grid and the sampled frames'
    timestamps), by calling the processor's own method on a stand-in."""
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor

    class Meta:
        fps = 1.0
        timestamps = list(timestamps_all_frames)

    stand_in = types.SimpleNamespace(image_token=image_token, video_processor=types.SimpleNamespace(merge_size=2))
    stand_in.replace_frame_token_id = types.MethodType(Glm5NextProcessor.replace_frame_token_id, stand_in)
    inputs = {"video_grid_thw": torch.tensor([list(grid_thw)]), "video_metadata": [Meta()]}
    return Glm5NextProcessor.replace_video_token(stand_in, inputs, 0)
