"""sonicmoe backend on the CPU: its layout helpers and the whole backend with SonicMoE's general-routing
call replaced by `emulate_general_routing` (plain torch, asserting the input layout SonicMoE's kernels
rely on), against the eager reference in fp32: output and every gradient, -1 slots, rows without a valid
slot, experts without rows, LoRA through the merged weight, FP4-packed bases. The package itself only runs
on a GPU (tests/gpu/test_sonicmoe_gpu.py); here the registry must call it unavailable.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import moe.backends.sonicmoe as sm
from moe.backends import EXPERT_BACKENDS, expert_backend
from moe.experts import GroupedExperts
from quant import quantize_experts
from runtime.registry import check_choice

H, I, R = 64, 32, 4  # FP4 needs in-features that are multiples of its 32-element blocks
TOL = 1e-5


def make_experts(E: int, rank: int, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    ex = GroupedExperts(E, H, I, lora_rank=rank, lora_alpha=2 * rank if rank else None)
    with torch.no_grad():
        ex.gate_up.normal_(0, 0.2)
        ex.down.normal_(0, 0.2)
        if rank:  # B starts at zero; make the LoRA path (and dA) non-trivial
            ex.gate_up_lora_B.normal_(0, 0.2)
            ex.down_lora_B.normal_(0, 0.2)
    return ex


def routing(M: int, E: int, k: int, owned: int | None = None, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per row; ids >= `owned` become -1 (the slots an EP rank owning [0, owned) sees)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    if owned is not None:
        ids = torch.where(ids < owned, ids, -1)
    return ids, torch.rand(M, k, generator=g)


def emulated(x, ids, w, ex):
    return sm.sonicmoe_forward(x, ids, w, ex, sm.emulate_general_routing, "swiglu")


def run(fn, ex: GroupedExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> dict:
    """Output and every gradient that exists, after one backward of <y, dy>."""
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    for p in ex.parameters():
        p.grad = None
    y = fn(x, ids, w, ex)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.dtype)
    (y * dy).sum().backward()
    out = {"y": y.detach(), "dx": x.grad, "dw": w.grad}
    out.update({n: p.grad for n, p in ex.named_parameters()})
    return out


def assert_close(got: dict, ref: dict, tol: float) -> None:
    for name, r in ref.items():
        g = got[name]
        if r is None:
            assert g is None, name
            continue
        err = ((g.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: norm-relative error {err:.2e}"


# ----------------------------------------------------------------------------- helpers

def test_valid_pairs_are_the_valid_slots_in_row_order():
    ids, _ = routing(37, 8, 3, owned=4)
    ids[5] = -1  # a row without any valid slot
    rows, slots = sm.valid_pairs(ids)
    assert rows.numel() == int((ids >= 0).sum())
    assert bool((rows[1:] >= rows[:-1]).all()), "SonicMoE needs its token indices sorted"
    assert bool((ids[rows, slots] >= 0).all())
    assert 5 not in rows.tolist()
    assert sorted(zip(rows.tolist(), slots.tolist())) == [tuple(p) for p in torch.nonzero(ids >= 0).tolist()]


def test_active_experts_renumbers_into_the_experts_with_rows():
    expert_P = torch.tensor([5, 1, 5, 3, 1, 1])
    active, local = sm.active_experts(expert_P, num_experts=8)
    assert active.tolist() == [0, 1, 3, 5]  # 3 with rows, padded to 4 with the lowest idle one
    assert torch.equal(active[local], expert_P)
    # one compiled shape per power of two: 5..8 experts with rows all give 8; never more than E
    for with_rows in ([0, 1, 2, 3, 4], [0, 2, 4, 5, 6, 7], list(range(8))):
        active, local = sm.active_experts(torch.tensor(with_rows[::-1]), num_experts=8)
        assert active.tolist() == list(range(8)) and torch.equal(active[local], torch.tensor(with_rows[::-1]))
    active, _ = sm.active_experts(torch.tensor([0, 1, 2, 4, 5]), num_experts=6)  # 5 -> 8, capped at E = 6
    assert active.tolist() == list(range(6))
    active, _ = sm.active_experts(torch.tensor([2, 2]), num_experts=6)
    assert active.tolist() == [2]


def test_weight_views_are_permuted_views_in_sonicmoe_layout():
    ex = make_experts(6, 0)
    w1, w2 = sm.sonic_weight_views(ex.gate_up, ex.down)
    assert w1.shape == (2 * I, H, 6) and w2.shape == (H, I, 6)
    assert w1.data_ptr() == ex.gate_up.data_ptr() and w2.data_ptr() == ex.down.data_ptr()  # no copy
    assert w1.stride() == (H, 1, 2 * I * H) and w2.stride() == (I, 1, H * I)  # stride order (2, 0, 1)
    for e in range(6):
        assert torch.equal(w1[:, :, e], ex.gate_up[e]) and torch.equal(w2[:, :, e], ex.down[e])
    # SonicMoE's own MoE module passes its [E, out, in] parameters the same way
    assert torch.equal(w1, ex.gate_up.permute(1, 2, 0))


def test_merged_weight_is_w_plus_scaled_b_a_of_the_active_experts():
    ex = make_experts(5, R)
    active = torch.tensor([0, 3])
    merged = sm.merged_weight(ex.gate_up.index_select(0, active), ex.lora("gate_up"), ex.lora_scaling, active)
    for i, e in enumerate(active.tolist()):
        expected = ex.gate_up[e] + ex.lora_scaling * ex.gate_up_lora_B[e] @ ex.gate_up_lora_A[e]
        torch.testing.assert_close(merged[i], expected)


# ----------------------------------------------------------------------------- the backend, emulated call

@pytest.mark.parametrize("E,k,rank,owned", [(8, 2, 0, None), (8, 3, 0, 4), (8, 2, R, None), (6, 3, R, 3),
                                            (16, 4, R, 8)])
def test_emulated_backend_matches_eager(E, k, rank, owned):
    """Full fine-tune (rank 0) and LoRA with the base trained too: y, dx, dw, dW, dA, dB as eager."""
    ex = make_experts(E, rank)
    ids, w = routing(29, E, k, owned)
    ids[3] = -1  # a row with no valid slot: y = 0, dx = 0
    ids = torch.where(ids == 1, -1, ids)  # local expert 1 gets no rows: its dW (and dA, dB) are 0
    x = torch.randn(29, H)
    got, ref = run(emulated, ex, x, ids, w), run(expert_backend("eager"), ex, x, ids, w)
    assert_close(got, ref, TOL)
    assert got["y"][3].abs().max() == 0 and got["dx"][3].abs().max() == 0
    assert got["gate_up"][1].abs().max() == 0 and got["down"][1].abs().max() == 0
    if rank:
        assert got["gate_up_lora_A"][1].abs().max() == 0 and got["down_lora_B"][1].abs().max() == 0


def test_frozen_base_lora_and_fp4_base_match_eager():
    for fmt in (None, "mxfp4", "nvfp4"):
        ex = make_experts(8, R)
        ex.gate_up.requires_grad_(False)
        ex.down.requires_grad_(False)
        if fmt:
            quantize_experts(ex, fmt)
        ids, w = routing(21, 8, 2, owned=6)
        x = torch.randn(21, H)
        got, ref = run(emulated, ex, x, ids, w), run(expert_backend("eager"), ex, x, ids, w)
        assert_close(got, ref, TOL)


def test_full_fine_tune_passes_the_base_weights_without_a_copy():
    ex = make_experts(8, 0)
    seen = {}

    def spy(**kwargs):
        seen["w1"], seen["w2"] = kwargs["w1"].data_ptr(), kwargs["w2"].data_ptr()
        seen["tokens"], seen["E"] = kwargs["token_indices"], kwargs["E"]
        return sm.emulate_general_routing(**kwargs)

    ids, w = routing(13, 8, 2, owned=4)
    sm.sonicmoe_forward(torch.randn(13, H), ids, w, ex, spy, "swiglu")
    assert seen["w1"] == ex.gate_up.data_ptr() and seen["w2"] == ex.down.data_ptr()
    assert seen["tokens"].numel() == int((ids >= 0).sum()) and seen["E"] == 8


def test_lora_passes_only_the_experts_with_rows():
    ex = make_experts(8, R)
    seen = {}

    def spy(**kwargs):
        seen["E"], seen["experts"] = kwargs["E"], kwargs["expert_indices"]
        return sm.emulate_general_routing(**kwargs)

    ids, w = routing(13, 8, 2, owned=4)  # only local experts 0..3 get rows
    sm.sonicmoe_forward(torch.randn(13, H), ids, w, ex, spy, "swiglu")
    assert seen["E"] == 4 and int(seen["experts"].max()) == 3


def test_all_slots_invalid_gives_zeros():
    ex = make_experts(4, 0)
    ids = torch.full((5, 2), -1)
    y = emulated(torch.randn(5, H), ids, torch.rand(5, 2), ex)
    assert y.shape == (5, H) and y.abs().max() == 0


def test_bf16_under_autocast_matches_eager_under_autocast():
    """fp32 masters and fp32 x under bf16 autocast: the backend casts every operand to bf16 (the dtype
    SonicMoE runs in) and returns bf16; eager under the same autocast is the reference."""
    ex = make_experts(8, R)
    ids, w = routing(33, 8, 2, owned=6)
    x = torch.randn(33, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, ref = run(emulated, ex, x, ids, w), run(expert_backend("eager"), ex, x, ids, w)
    assert got["y"].dtype == torch.bfloat16
    assert_close(got, ref, 2e-2)


# ----------------------------------------------------------------------------- registry, imports, errors

@pytest.mark.skipif(importlib.util.find_spec("sonicmoe") is not None and torch.cuda.is_available(),
                    reason="sonic-moe and CUDA are both here")
def test_plan_says_unavailable_with_the_install_hint():
    from runtime.choices import Needs, choose
    from runtime.config import ConfigError

    assert "sonicmoe" in EXPERT_BACKENDS.names()
    assert check_choice("model.expert_backend", "sonicmoe") is None  # a config may name it (runs elsewhere)
    with pytest.raises(ConfigError, match="model.expert_backend: sonicmoe cannot run here") as info:
        choose("model.expert_backend", "sonicmoe", Needs("cuda"))
    if importlib.util.find_spec("sonicmoe") is None:
        assert "moe-runtime[sonicmoe]" in str(info.value) and "sonic-moe" in str(info.value)
    assert EXPERT_BACKENDS.capabilities("sonicmoe").compile is False  # eager only: refused under compile


def test_auto_never_picks_sonicmoe():
    assert "sonicmoe" not in EXPERT_BACKENDS.candidates("cpu") + EXPERT_BACKENDS.candidates("cuda")


def test_the_runtime_never_imports_the_package():
    """moe.backends is imported above; sonicmoe (and its CuTe DSL stack) must not be."""
    if importlib.util.find_spec("sonicmoe") is None:
        assert "sonicmoe" not in sys.modules and "quack" not in sys.modules and "cutlass" not in sys.modules


def test_missing_package_raises_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # import of sonicmoe raises ImportError
    sm.load_sonic.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"moe-runtime\[sonicmoe\]"):
            sm.load_sonic()
    finally:
        sm.load_sonic.cache_clear()


def test_fixed_gemm_configs_binds_tuned_false_in_the_given_modules_only():
    import functools
    from types import SimpleNamespace

    def gemm(a, tuned=True):
        return tuned

    fwd, bwd = SimpleNamespace(gemm=gemm, gemm_gated=gemm), SimpleNamespace(gemm=gemm, gemm_dgated=gemm)
    sm.fixed_gemm_configs((fwd, bwd))
    sm.fixed_gemm_configs((fwd, bwd))  # idempotent: one partial, not nested
    assert fwd.gemm(0) is False and fwd.gemm_gated(0) is False and bwd.gemm_dgated(0) is False
    assert isinstance(fwd.gemm, functools.partial) and fwd.gemm.func is gemm
    assert gemm(0) is True


def test_check_inputs_refuses_what_sonicmoe_cannot_run():
    ex = make_experts(4, R)
    ex.lora_dropout = 0.1
    ex.train()
    with pytest.raises(NotImplementedError, match="lora_dropout"):
        sm.check_inputs(torch.randn(3, H), ex)
    ex.lora_dropout = 0.0
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            sm.check_inputs(torch.randn(3, H), ex)
