"""Model definitions and their HF checkpoint I/O (public: from_pretrained, save_pretrained)."""

from runtime.models.hf import from_pretrained, random_init, save_pretrained
from runtime.models.qwen import QwenConfig, QwenForCausalLM

__all__ = ["QwenConfig", "QwenForCausalLM", "from_pretrained", "random_init", "save_pretrained"]
