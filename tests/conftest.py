"""Shared fixtures: tiny HF checkpoints written by transformers' own save_pretrained."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels run in the interpreter. It is chosen when triton is first imported,
# so it is set here, before any test module imports a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY_MOE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                max_position_embeddings=256, rms_norm_eps=1e-6, norm_topk_prob=True)
TINY_DENSE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, max_position_embeddings=256)


def perturb_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere (norms and routers too), so parity does not pass by symmetry."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0))


def write_hf_checkpoint(path, kind: str = "moe", seed: int = 0, **overrides):
    """Writes a randomly perturbed transformers model with save_pretrained; returns the HF model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_MOE, **overrides}))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**{**TINY_DENSE, **overrides}))
    perturb_(model, seed)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_moe_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe")
    write_hf_checkpoint(path, "moe")
    return path
