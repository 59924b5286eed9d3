"""Model definitions, the one build path and HF checkpoint I/O (public: from_pretrained, save_pretrained)."""

from runtime.models.build import build, from_pretrained, random_init
from runtime.models.hf import save_pretrained
from runtime.models.qwen import QwenConfig, QwenForCausalLM

__all__ = ["QwenConfig", "QwenForCausalLM", "build", "from_pretrained", "random_init", "save_pretrained"]
