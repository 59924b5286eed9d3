"""FSDP2's mixed-precision policies (runtime.distributed.fsdp): what the parameter gathers and gradient
reductions compute in."""

from __future__ import annotations

import torch

from runtime.distributed.fsdp import _expert_mp_policy, _mp_policy


def test_gathers_follow_autocast():
    """bf16 gathers when the step autocasts on CUDA; fp32 ones when it does not (runtime.verify --exact)."""
    assert _mp_policy("cuda").param_dtype == torch.bfloat16 and _mp_policy("cuda").reduce_dtype == torch.float32
    assert _mp_policy("cuda", autocast=False).param_dtype is None
    assert _mp_policy("cpu").param_dtype is None


def test_experts_alone_on_their_fsdp_mesh_make_no_fp32_gradient_copy():
    mp = _mp_policy("cuda")
    assert _expert_mp_policy(mp, 1).reduce_dtype is None and _expert_mp_policy(mp, 1).param_dtype == torch.bfloat16
    assert _expert_mp_policy(mp, 2).reduce_dtype == torch.float32
