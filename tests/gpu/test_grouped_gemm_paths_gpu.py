"""Every tuned config of the grouped GEMM kernel, on each operand path, against CUTLASS (bf16, H200).

The expert layer test checks whatever config the autotuner picks on that machine; this one forces each
candidate config in turn, so a config that is wrong on one path (persistent tiles, TMA descriptors of a
transposed weight view, gathered rows) fails here on any machine.
Paths at Qwen3-30B-A3B shapes and with Qwen3.5-35B-A3B's I=512 (a short K loop for the down projection):
expert-sorted rows x W (the down projection), x a transposed weight view (dx = d gate_up W_gu), and
gathered rows x W_gu (the forward's gate_up, SwiGLU epilogue); then the split-LoRA variants of down and
dx (the rank tiles loaded before the K loop, their product added after it: Triton 3.6 miscompiled them
in a flattened tile loop, for every persistent config at I = 768 and 512). Reference: torch._grouped_mm on the same bf16 operands (norm-relative
error <= 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from gpu import launch as gpu_launch
from moe.kernels import grouped_linear as gl
from moe.kernels.routing import sort_slots
from moe.kernels.tuning import GEMM_CONFIGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, K_TOP, T, R = 128, 2048, 8, 2048, 16
WIDE = [c for c in GEMM_CONFIGS if c.kwargs["BLOCK_N"] >= 128]
PERSISTENT = [c for c in WIDE if c.kwargs["PERSISTENT"]]
# (E, H, I) beyond the Qwen3-30B-A3B ones: Qwen3-Next-like, Qwen2-MoE-like, few wide experts.
OTHER_SHAPES = [(512, 2048, 512), (60, 2560, 1408), (8, 4096, 1792)]


@pytest.fixture
def one_config(monkeypatch):
    """Makes the kernel's autotuner hold only `config` (and forget what it had compiled or chosen)."""
    tuner = gl._grouped_linear_kernel

    def use(config):
        monkeypatch.setattr(tuner, "configs", [config])
        monkeypatch.setattr(tuner, "cache", {})
        monkeypatch.setattr(gpu_launch, "_COMPILED", {})
    return use


def operands(ep: int = 1, I: int = 768, num_experts: int = E, hidden: int = H):
    gen = torch.Generator(device="cuda").manual_seed(0)
    _, ids = torch.randn(T, num_experts, device="cuda", generator=gen).softmax(-1).topk(K_TOP, dim=-1)
    ids = torch.where(ids < num_experts // ep, ids, -1)
    slots = sort_slots(ids, num_experts)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    return slots, {"x": torch.randn(T, hidden, **bf), "hw": torch.randn(T * K_TOP, I, **bf),
                   "dgu": torch.randn(T * K_TOP, 2 * I, **bf), "w_gu": torch.randn(num_experts, 2 * I, hidden, **bf) * 0.02,
                   "w_down": torch.randn(num_experts, hidden, I, **bf) * 0.02, "ia": torch.randn(T * K_TOP, R, **bf),
                   "B_down": torch.randn(num_experts, hidden, R, **bf) * 0.02, "A_gu": torch.randn(num_experts, R, hidden, **bf) * 0.02}


def rel_err(got: torch.Tensor, ref: torch.Tensor, n: int) -> float:
    return ((got[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm()).item()


@pytest.mark.parametrize("ep,I", [(1, 768), (4, 768), (1, 512)])
@pytest.mark.parametrize("config", WIDE, ids=[str(c) for c in WIDE])
def test_each_config_on_each_path(config, ep, I, one_config):
    one_config(config)
    check_each_path(*operands(ep, I))


@pytest.mark.parametrize("num_experts,hidden,I", OTHER_SHAPES)
@pytest.mark.parametrize("config", PERSISTENT, ids=[str(c) for c in PERSISTENT])
def test_persistent_configs_at_other_shapes(config, num_experts, hidden, I, one_config):
    """The flattened tile loop of the persistent configs at other expert counts and widths (K is a constexpr:
    every reduction size is its own compiled kernel)."""
    one_config(config)
    check_each_path(*operands(1, I, num_experts, hidden))


def check_each_path(slots, t) -> None:
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


@pytest.mark.parametrize("I", [768, 512])
@pytest.mark.parametrize("config", WIDE, ids=[str(c) for c in WIDE])
def test_each_config_split_lora(config, I, one_config):
    """out = in W^T + s ia B^T with the rank-sized ia given (the split LoRA of the forward down and the dx)."""
    one_config(config)
    slots, t = operands(1, I)
    n, s = int(slots.offsets_E1[-1]), 2.0

    def reference(in_, w, B):
        offs = slots.offsets_E1[1:]
        return gl._cutlass_gemm(in_, slots, w).float() + s * torch._grouped_mm(t["ia"], B.transpose(1, 2), offs=offs)

    # A is not read when ia is given: any [E, r, K] tensor of the right shape serves.
    down_lora = gl.LoraView(torch.empty(E, R, I, device="cuda", dtype=torch.bfloat16), t["B_down"], s, True)
    down, _ = gl.expert_linear(t["hw"], slots, t["w_down"], down_lora, gather=False, ia_Sr=t["ia"])
    assert rel_err(down, reference(t["hw"], t["w_down"], t["B_down"]), n) <= 1e-2, "down + LoRA"
    w_gu_T, B_T = t["w_gu"].transpose(1, 2), t["A_gu"].transpose(1, 2)  # dx reads the gate_up LoRA backwards
    dx_lora = gl.LoraView(torch.empty(E, R, 2 * I, device="cuda", dtype=torch.bfloat16), B_T, s, True)
    dx, _ = gl.expert_linear(t["dgu"], slots, w_gu_T, dx_lora, gather=False, ia_Sr=t["ia"])
    assert rel_err(dx, reference(t["dgu"], w_gu_T, B_T), n) <= 1e-2, "dx + LoRA"
