"""glm53: a pure-PyTorch reference and training library for GLM-5.3-Flash (transformers' `glm5_next`)."""

from .config import Glm53Config
from .model import CausalLMOutput, Glm53ForCausalLM, Glm53Model

__all__ = ["Glm53Config", "Glm53Model", "Glm53ForCausalLM", "CausalLMOutput"]
__version__ = "0.1.0"
