"""Fused per-head q/k RMSNorm + rotary embedding (Qwen3 / Qwen3.5 / Qwen3-Next attention).

Contract::

    qk_norm_rope(q_BSHD, k_BSKD, q_weight_D, k_weight_D, cos_BSR, sin_BSR, eps,
                 unit_offset=False, rotary_dim=None, impl="torch",
                 launch_settings=None) -> (q_out_BSHD, k_out_BSKD)

B batch, S sequence, H query heads, K key/value heads, D head_dim, R rotary_dim (<= D, even).
q/k may be non-contiguous views (e.g. slices of a fused qkv projection); the last dim must be dense.
cos/sin are what transformers' rotary embedding returns: cat(freqs, freqs) layout, rotate-half
convention, shape [B, S, R] (a batch dim of 1 broadcasts).

Per (token, head) row: RMSNorm over D in fp32, x * rsqrt(mean(x^2) + eps) * w, or * (1 + w) when
`unit_offset` (Qwen3.5 / Qwen3-Next), then RoPE on the first R dims; dims R..D pass through.

impl (the names of NORM_ROPE_IMPLS, config key model.norm_rope_impl):
"torch" is the plain-torch reference here and reproduces transformers' numerics step by step
(Qwen3RMSNorm casts the normalized row to the input dtype before the weight multiply, Qwen3NextRMSNorm
multiplies by (1 + w) in fp32 and casts after; RoPE then runs in the input dtype).
"triton" is the fused kernel of attention/kernels/norm_rope.py (forward and backward are
`torch.library.triton_op`s, so torch.compile traces them without a graph break); it keeps the whole row
in fp32 and rounds once at the store. `launch_settings` (attention.kernels.norm_rope.LaunchSettings, None:
its defaults) tunes its launches and nothing else; the kernel module is imported when triton is first used.
"auto" (config only) is resolved by runtime.plan: triton on CUDA where the triton package is installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from gpu.registry import TRITON_DEVICES, Capabilities, Registry, triton_missing

# name -> fn(q, k, q_weight, k_weight, cos, sin, eps, unit_offset, launch_settings) -> (q, k)
NORM_ROPE_IMPLS = Registry("norm/RoPE impl", "model.norm_rope_impl", auto=True)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, unit_offset: bool = False,
                 rotary_dim: int | None = None, impl: str = "torch",
                 launch_settings=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize each q/k head over D and rotate its first `rotary_dim` dims; see the module docstring."""
    fn = NORM_ROPE_IMPLS.get(impl)
    if torch.compiler.is_compiling():  # shapes may be symbolic (unhashable): check them uncached
        _check_inputs(q, k, q_weight, k_weight, cos, sin, rotary_dim)
    else:
        _check_inputs_cached(q.shape, k.shape, q_weight.shape, k_weight.shape, cos.shape, sin.shape,
                             q.dtype, k.dtype, rotary_dim)
    return fn(q, k, q_weight, k_weight, cos, sin, eps, unit_offset, launch_settings)


def _check_inputs(q, k, q_weight, k_weight, cos, sin, rotary_dim: int | None) -> None:
    """Validate shapes once, up front. After this, cos.shape[-1] is the rotary dim both impls use."""
    _check_shapes(q.shape, k.shape, q_weight.shape, k_weight.shape, cos.shape, sin.shape, q.dtype, k.dtype,
                  rotary_dim)


def _check_shapes(q_shape, k_shape, q_weight_shape, k_weight_shape, cos_shape, sin_shape, q_dtype, k_dtype,
                  rotary_dim: int | None) -> None:
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(f"q and k must be [B, S, heads, D]; got {tuple(q_shape)} and {tuple(k_shape)}")
    head_dim = q_shape[-1]
    if q_shape[:2] != k_shape[:2] or k_shape[-1] != head_dim:
        raise ValueError(f"q {tuple(q_shape)} and k {tuple(k_shape)} disagree on B, S or D")
    if q_dtype != k_dtype:
        raise ValueError(f"q and k dtypes differ: {q_dtype} vs {k_dtype}")
    if q_weight_shape != (head_dim,) or k_weight_shape != (head_dim,):
        raise ValueError(f"weights must be [{head_dim}]; got {tuple(q_weight_shape)}, {tuple(k_weight_shape)}")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}]; got {rotary_dim}")
    for name, shape in (("cos", cos_shape), ("sin", sin_shape)):
        if len(shape) != 3 or shape[-1] != rotary_dim or shape[1] != q_shape[1] or shape[0] not in (1, q_shape[0]):
            raise ValueError(f"{name} must be [B or 1, S, rotary_dim={rotary_dim}]; got {tuple(shape)}")


# Eager calls check each distinct set of shapes once (a success is cached; a failure raises every time).
_check_inputs_cached = functools.lru_cache(maxsize=256)(_check_shapes)


# ----------------------------------------------------------------------------- torch reference


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim with transformers' cast order (see the module docstring)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def rope_reference(x_BSHD: torch.Tensor, cos_BSR: torch.Tensor, sin_BSR: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R dims of each head; the remaining dims pass through."""
    rotary_dim = cos_BSR.shape[-1]
    cos_BS1R = cos_BSR.unsqueeze(2).to(x_BSHD.dtype)
    sin_BS1R = sin_BSR.unsqueeze(2).to(x_BSHD.dtype)
    x_rot, x_pass = x_BSHD[..., :rotary_dim], x_BSHD[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos_BS1R + rotated * sin_BS1R, x_pass), dim=-1)


def qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps: float,
                           unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch qk_norm_rope (differentiable by autograd); the rotary dim is cos.shape[-1]."""
    q_out = rope_reference(rms_norm_reference(q, q_weight, eps, unit_offset), cos, sin)
    k_out = rope_reference(rms_norm_reference(k, k_weight, eps, unit_offset), cos, sin)
    return q_out, k_out


@NORM_ROPE_IMPLS.register("torch", Capabilities(auto_on=("cpu", "cuda"), reference=True))
def _torch_impl(q, k, q_weight, k_weight, cos, sin, eps, unit_offset, launch_settings):
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, unit_offset)


def _load_triton():
    kernels = importlib.import_module("attention.kernels.norm_rope")

    def triton_impl(q, k, q_weight, k_weight, cos, sin, eps, unit_offset, launch_settings):
        settings = kernels.DEFAULT_LAUNCH_SETTINGS if launch_settings is None else launch_settings
        return kernels.qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps, unit_offset, settings)
    return triton_impl


NORM_ROPE_IMPLS.declare("triton", Capabilities(devices=TRITON_DEVICES, unavailable=triton_missing, auto_on=("cuda",),
                                               priority=1), _load_triton)
