"""Rotary position embeddings: inverse frequencies for the HF rope types and cos/sin per position.

cos/sin come out as [B, S, rotary_dim] in the cat(freqs, freqs) layout that transformers uses, with
the attention scaling factor (yarn) already folded in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int = 32768
    partial_rotary_factor: float = 1.0
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: RopeConfig, dim: int, base_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    orig = cfg.original_max_position_embeddings or cfg.max_position_embeddings
    factor = cfg.factor
    if cfg.attention_factor is not None:
        attn_factor = cfg.attention_factor
    elif cfg.mscale and cfg.mscale_all_dim:
        attn_factor = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
    else:
        attn_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv_freq = base_freqs / factor * (1 - extrapolate) + base_freqs * extrapolate
    return inv_freq, attn_factor


def _llama3(cfg: RopeConfig, base_freqs: torch.Tensor) -> torch.Tensor:
    orig = cfg.original_max_position_embeddings
    low_wavelen = orig / cfg.low_freq_factor
    high_wavelen = orig / cfg.high_freq_factor
    wavelen = 2 * math.pi / base_freqs
    scaled = torch.where(wavelen > low_wavelen, base_freqs / cfg.factor, base_freqs)
    smooth = (orig / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq_and_scale(cfg: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    dim = int(head_dim * cfg.partial_rotary_factor)
    base_freqs = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_type == "linear":
        return base_freqs / cfg.factor, 1.0
    if cfg.rope_type == "yarn":
        return _yarn(cfg, dim, base_freqs)
    if cfg.rope_type == "llama3":
        return _llama3(cfg, base_freqs), 1.0
    return base_freqs, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: RopeConfig, head_dim: int, device=None):
        super().__init__()
        inv_freq, self.attention_scaling = inv_freq_and_scale(cfg, head_dim)
        self.rotary_dim = 2 * inv_freq.numel()
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def reset_parameters(self, cfg: RopeConfig, head_dim: int, device=None) -> None:
        """Recomputes inv_freq after meta-device construction (buffers are not in checkpoints)."""
        inv_freq, _ = inv_freq_and_scale(cfg, head_dim)
        self.inv_freq = inv_freq.to(device)

    @torch.no_grad()
    def forward(self, position_ids_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 angles regardless of autocast: bf16 positions lose precision beyond a few thousand.
        with torch.autocast(device_type=position_ids_BS.device.type, enabled=False):
            freqs_BSd = position_ids_BS.float().unsqueeze(-1) * self.inv_freq.float()
            emb = torch.cat((freqs_BSd, freqs_BSd), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
