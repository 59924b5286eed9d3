"""Every tuned config of the grouped GEMM kernel, on each operand path, against CUTLASS (bf16, H200).

The expert layer test checks whatever config the autotuner picks on that machine; this one forces each
candidate config in turn, so a config that is wrong on one path (persistent tiles, TMA descriptors of a
transposed weight view, gathered rows) fails here on any machine.
Paths at Qwen3-30B-A3B shapes: expert-sorted rows x W (the down projection), x a transposed weight view
(dx = d gate_up W_gu), and gathered rows x W_gu (the forward's gate_up, SwiGLU epilogue). Reference:
torch._grouped_mm on the same bf16 operands (norm-relative error <= 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from moe.kernels import grouped_linear as gl
from moe.kernels.routing import sort_slots
from moe.kernels.tuning import GEMM_CONFIGS
from quant import triton_launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K_TOP, T = 128, 2048, 768, 8, 2048
WIDE = [c for c in GEMM_CONFIGS if c.kwargs["BLOCK_N"] >= 128]


@pytest.fixture
def one_config(monkeypatch):
    """Makes the kernel's autotuner hold only `config` (and forget what it had compiled or chosen)."""
    tuner = gl._grouped_linear_kernel

    def use(config):
        monkeypatch.setattr(tuner, "configs", [config])
        monkeypatch.setattr(tuner, "cache", {})
        monkeypatch.setattr(triton_launch, "_COMPILED", {})
    return use


def operands(ep: int = 1):
    gen = torch.Generator(device="cuda").manual_seed(0)
    _, ids = torch.randn(T, E, device="cuda", generator=gen).softmax(-1).topk(K_TOP, dim=-1)
    ids = torch.where(ids < E // ep, ids, -1)
    slots = sort_slots(ids, E)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    return slots, {"x": torch.randn(T, H, **bf), "hw": torch.randn(T * K_TOP, I, **bf),
                   "dgu": torch.randn(T * K_TOP, 2 * I, **bf), "w_gu": torch.randn(E, 2 * I, H, **bf) * 0.02,
                   "w_down": torch.randn(E, H, I, **bf) * 0.02}


def rel_err(got: torch.Tensor, ref: torch.Tensor, n: int) -> float:
    return ((got[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm()).item()


@pytest.mark.parametrize("ep", [1, 4])
@pytest.mark.parametrize("config", WIDE, ids=[str(c) for c in WIDE])
def test_each_config_on_each_path(config, ep, one_config):
    one_config(config)
    slots, t = operands(ep)
    n = int(slots.offsets_E1[-1])
    down = gl._triton_gemm(t["hw"], slots, t["w_down"])
    assert rel_err(down, gl._cutlass_gemm(t["hw"], slots, t["w_down"]), n) <= 1e-2, "down (W)"
    w_gu_T = t["w_gu"].transpose(1, 2)
    dx = gl._triton_gemm(t["dgu"], slots, w_gu_T)
    assert rel_err(dx, gl._cutlass_gemm(t["dgu"], slots, w_gu_T), n) <= 1e-2, "dx (W^T view)"
    weights = torch.rand(T, K_TOP, device="cuda")
    gu, _, _ = gl.gate_up_swiglu(t["x"], slots, t["w_gu"], None, weights)
    xg = t["x"].index_select(0, slots.rows_S)
    assert rel_err(gu, gl._cutlass_gemm(xg, slots, t["w_gu"]), n) <= 1e-2, "gate_up (gathered rows)"
