"""glm53: a pure-PyTorch reference and training library for GLM-5.3-Flash (transformers' `glm5_next`).

Packages: `glm53.model` (the blocks and the computing model), `glm53.kernels` (fast eager ops beside their
references), `glm53.checkpoint` (the official on-disk layout), `glm53.losses` (the losses and Glm53ForCausalLM,
the model with `labels=`), `glm53.training` (data, the trainer),
`glm53.parallel` (FSDP2 / tensor parallelism; the only package importing torch.distributed), `glm53.peft` (LoRA,
freezing, a frozen FP8 base), `glm53.vision` (the vision tower, the vision-language model
Glm53ForConditionalGeneration, the image/video processors).
"""

from .config import Glm53Config
from .errors import CheckpointError, ConfigError, Glm53Error
from .losses import CausalLMOutput, Glm53ForCausalLM
from .model import ForwardContext, Glm53LMHeadModel, Glm53Model, LMOutput
from .peft import apply_lora, freeze, load_lora, merge_lora, save_lora
from .vision.model import Glm53ForConditionalGeneration

__all__ = [
    "Glm53Config",
    "Glm53Model",
    "Glm53LMHeadModel",
    "Glm53ForCausalLM",
    "Glm53ForConditionalGeneration",
    "CausalLMOutput",
    "LMOutput",
    "ForwardContext",
    "CheckpointError",
    "ConfigError",
    "Glm53Error",
    "apply_lora",
    "freeze",
    "merge_lora",
    "save_lora",
    "load_lora",
]
__version__ = "0.1.0"
