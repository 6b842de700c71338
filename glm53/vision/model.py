"""Glm53ForConditionalGeneration: the vision-language model (transformers' Glm5NextForConditionalGeneration).

Legend: B batch, T time, D model width, N patch rows, G merged rows (N / m^2).
It is a Glm53ForCausalLM with a VisionTower under `visual` (`model.visual.*` on disk). forward embeds the ids,
runs the tower once over every image (and once over every video) of the batch, splices the merged features into
the placeholder embeddings (splice.py; under context parallelism each rank runs the tower on the items its slice's
placeholders take and splices its own rows) and hands `inputs_embeds` to Glm53ForCausalLM's forward, so it returns
exactly what the text model returns (losses, MTP, indexer KL, balance, return_logits, packed documents). A batch
without pixels is the text model's forward on the same embeddings. The config is the text Glm53Config whose
outer part declares `vision_config` and the token ids (config.py `with_vision`; a VL checkpoint's config.json).
"""

from __future__ import annotations

import torch

from ..config import Glm53Config
from ..errors import InputError
from ..losses import CausalLMOutput, Glm53ForCausalLM
from .config import has_vision, vision_parts
from .splice import Placeholders, placeholder_masks, splice
from .tower import VisionTower, check_vision_inputs


class Glm53ForConditionalGeneration(Glm53ForCausalLM):
    def __init__(self, config: Glm53Config) -> None:
        if not isinstance(config, Glm53Config):
            raise TypeError(
                f"config must be a Glm53Config with a vision_config (glm53.vision.with_vision), got "
                f"{type(config).__name__}"
            )
        vision, tokens = vision_parts(config)
        super().__init__(config)
        self.vision_config = vision
        self.token_ids = tokens
        self.visual = VisionTower(vision)
        # Set by glm53.parallel.parallelize when the tower is sharded: every forward then runs the tower (on a
        # zero-weighted dummy image when the batch has none), so FSDP's collectives match on every rank.
        self.always_run_tower = False
        if not self.lm_head.weight.is_meta:
            self.visual.init_weights()

    def init_weights(self) -> None:
        super().init_weights()
        if "visual" in self._modules:  # Glm53ForCausalLM.__init__ initialises before the tower exists
            self.visual.init_weights()

    def gradient_checkpointing_enable(self) -> None:
        super().gradient_checkpointing_enable()
        self.visual.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        super().gradient_checkpointing_disable()
        self.visual.gradient_checkpointing = False

    def vision_features(
        self,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """(image features, video features), merged rows [G, D] in order (None where absent): ONE tower call over
        the images and the videos together (every rank of a sharded model then runs the tower exactly once)."""
        parts = []
        for kind, pixels, grid in (
            ("image", pixel_values, image_grid_thw),
            ("video", pixel_values_videos, video_grid_thw),
        ):
            names = ("pixel_values", "image_grid_thw") if kind == "image" else ("pixel_values_videos", "video_grid_thw")
            if pixels is None and grid is not None:
                raise InputError(f"{names[1]} was given without its pixels ({names[0]})")
            if pixels is not None:
                if grid is None:
                    raise InputError(f"{names[0]} was given without {names[1]}")
                parts.append((kind, check_vision_inputs(pixels, grid, self.vision_config, *names), pixels))
        if not parts:
            return None, None
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.cat([p.to(weight.dtype) for _, _, p in parts])
        grid = torch.cat([g.to(pixels.device) for _, g, _ in parts])
        pooled = self.visual(pixels, grid).pooler_output
        merge = self.vision_config.spatial_merge_size**2
        sizes = [int(g.prod(-1).sum()) // merge for _, g, _ in parts]  # NOTE: syncs
        features = dict(zip([kind for kind, _, _ in parts], pooled.split(sizes)))
        return features.get("image"), features.get("video")

    def embed_multimodal(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        placeholders: tuple[Placeholders, Placeholders] | None = None,
    ) -> torch.Tensor:
        """The text model's input embeddings [B, T, D] with the vision features spliced in. `placeholders`: (image,
        video) of a context-parallel slice `input_ids` of whole rows (splice.py `sliced_placeholders`); default:
        found in `input_ids`, the whole batch."""
        embeds = self.model.embed(input_ids, None)
        image_at, video_at = placeholders if placeholders is not None else placeholder_masks(input_ids, self.token_ids)
        images, videos = self.vision_features(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        embeds = splice(embeds, image_at, images, "image")
        embeds = splice(embeds, video_at, videos, "video")
        if images is None and videos is None and self.always_run_tower:
            embeds = embeds + 0.0 * self._dummy_features().sum()
        return embeds

    def _dummy_features(self) -> torch.Tensor:
        """The tower on one black m x m image: keeps every rank's tower parameters in the graph (zero-weighted)."""
        m = self.vision_config.spatial_merge_size
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.zeros(m * m, self.vision_config.patch_width, dtype=weight.dtype, device=weight.device)
        grid = torch.tensor([[1, m, m]], device=weight.device)
        return self.visual(pixels, grid).pooler_output

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        placeholders: tuple[Placeholders, Placeholders] | None = None,
        **kwargs,
    ) -> CausalLMOutput:
        """transformers' meaning for the vision inputs: `pixel_values` [N, C*T*P*P] and `image_grid_thw` [images,
        3] (t, h, w); `pixel_values_videos` / `video_grid_thw` likewise. Every other keyword is
        Glm53ForCausalLM.forward's (loss_denominators, cu_seqlens, position_ids, return_logits, cp).
        Under context parallelism (`cp`) `input_ids` are this rank's slice of every row, the pixels those of the
        items its placeholders take, `placeholders` where they go (found in the whole rows, splice.py);
        glm53.parallel.context_parallel_inputs(model, ..., pixel_values=...) makes all of them."""
        visual = pixel_values is not None or pixel_values_videos is not None
        if inputs_embeds is not None:
            if visual or placeholders is not None:
                raise InputError(
                    "pass input_ids (not inputs_embeds) with pixel_values / pixel_values_videos / placeholders: the "
                    "placeholders are found in the ids"
                )
            return super().forward(input_ids, attention_mask, labels, inputs_embeds, **kwargs)
        if input_ids is None:
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if visual and kwargs.get("cp") is not None and placeholders is None:
            raise InputError(
                "images under context parallelism (cp) need the placeholders of the whole rows: pass "
                "glm53.parallel.context_parallel_inputs(model, input_ids, ..., pixel_values=..., "
                "image_grid_thw=...) to the forward"
            )
        embeds = self.embed_multimodal(
            input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, placeholders
        )
        return super().forward(None, attention_mask, labels, embeds, **kwargs)

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """glm53.generation.generate with images / videos: the tower runs once, its features are spliced into
        the prompt's embeddings for the prefill; decode steps are text only."""
        if pixel_values is None and pixel_values_videos is None:
            return super().generate(input_ids, attention_mask, **kwargs)
        from ..generation.loop import generate  # the loop imports nothing from the model packages

        with torch.inference_mode():
            embeds = self.embed_multimodal(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        return generate(self, input_ids, attention_mask, inputs_embeds=embeds, **kwargs)


def model_class_for(config: Glm53Config) -> type[Glm53ForCausalLM]:
    """The class a config builds: the VL model when it declares a vision tower, else the text model."""
    return Glm53ForConditionalGeneration if has_vision(config) else Glm53ForCausalLM


__all__ = ["Glm53ForConditionalGeneration", "model_class_for"]
