"""FSDP2's mixed-precision policies (runtime.distributed.fsdp): what the parameter gathers and gradient
reductions compute in."""

from __future__ import annotations

import torch

from runtime.distributed.fsdp import (
    FROZEN_DENSE_CAP,
    _expert_mp_policy,
    _mp_policy,
    experts_left_unwrapped,
    frozen_dense_placement,
    fsdp_gather_dtype,
)


def test_gathers_follow_autocast():
    """bf16 gathers when the step autocasts on CUDA; fp32 ones when it does not (runtime.verify --exact)."""
    assert _mp_policy("cuda").param_dtype == torch.bfloat16 and _mp_policy("cuda").reduce_dtype == torch.float32
    assert _mp_policy("cuda", autocast=False).param_dtype is None
    assert _mp_policy("cpu").param_dtype is None


def test_fp32_gathers_keep_the_parameters_dtype_under_autocast():
    """parallelism.fsdp_param_dtype fp32: no cast at the gather (autocast casts the matmul inputs, as on one
    GPU), reductions still fp32."""
    mp = _mp_policy("cuda", param_dtype="fp32")
    assert mp.param_dtype is None and mp.reduce_dtype == torch.float32


def test_experts_alone_on_their_fsdp_mesh_make_no_fp32_gradient_copy():
    assert _expert_mp_policy("cuda", True, 1).reduce_dtype is None
    assert _expert_mp_policy("cuda", True, 1).param_dtype == torch.bfloat16
    assert _expert_mp_policy("cuda", True, 2).reduce_dtype == torch.float32
    assert _expert_mp_policy("cpu", False, 2).param_dtype is None


def test_auto_gathers_in_fp32_under_ep_only():
    """Under EP the experts keep their own bf16 units, so fp32 gathers of the rest are cheap; without EP the
    experts would gather in fp32 with their block."""
    assert fsdp_gather_dtype("auto", 2) == "fp32" and fsdp_gather_dtype("auto", 1) == "bf16"
    assert fsdp_gather_dtype("bf16", 4) == "bf16" and fsdp_gather_dtype("fp32", 1) == "fp32"


GIB = 2**30


def test_frozen_dense_auto_replicates_small_frozen_weights_under_lora():
    # Qwen3-30B-A3B's dense part (~3 GiB bf16) on an 80 GiB card; a dense 32B model (~61 GiB bf16) keeps sharding
    assert frozen_dense_placement("auto", True, 3 * GIB, 80 * GIB) == "replicate"
    assert frozen_dense_placement("auto", True, 61 * GIB, 80 * GIB) == "shard"
    assert frozen_dense_placement("auto", True, 10 * GIB, 80 * GIB) == "replicate"  # the 1/8 bound is inclusive
    assert frozen_dense_placement("auto", True, 10 * GIB + 1, 80 * GIB) == "shard"
    # unknown memory (CPU): the fixed cap
    assert frozen_dense_placement("auto", True, FROZEN_DENSE_CAP, None) == "replicate"
    assert frozen_dense_placement("auto", True, FROZEN_DENSE_CAP + 1, None) == "shard"


def test_frozen_dense_full_fine_tune_shards_and_explicit_settings_win():
    assert frozen_dense_placement("auto", False, 0, 80 * GIB) == "shard"
    assert frozen_dense_placement("shard", True, 0, 80 * GIB) == "shard"
    assert frozen_dense_placement("shard", False, 0, None) == "shard"
    assert frozen_dense_placement("replicate", True, 100 * GIB, 80 * GIB) == "replicate"


def test_experts_are_left_unwrapped_alone_on_their_mesh_and_readable_as_stored():
    """apply_fsdp's rule (and estimate's and plan's, through leaves_no_unit): one rank on the experts' FSDP mesh,
    not packed, stored in the dtype CUDA autocast gathers (bf16); the CPU gathers in the parameters' own dtype."""
    assert experts_left_unwrapped(1, False, torch.bfloat16, "cuda") is True
    assert experts_left_unwrapped(1, False, torch.float32, "cuda") is False  # a cast copy per layer
    assert experts_left_unwrapped(1, False, torch.float32, "cuda", autocast=False) is True
    assert experts_left_unwrapped(2, False, torch.bfloat16, "cuda") is False
    assert experts_left_unwrapped(1, True, torch.bfloat16, "cuda") is False
    assert experts_left_unwrapped(1, False, torch.float32, "cpu") is True

