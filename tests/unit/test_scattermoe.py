"""scattermoe backend vs the eager reference on the CPU (Triton interpreter, fp32, tiny shapes).

Shapes are chosen so that H, I and r are not multiples of the kernel blocks. Every case checks the
output and all gradients (x, routing weights, base weights, LoRA factors) by norm-relative error.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# Must precede the first triton import (the kernels are decorated for the interpreter at import time);
# only without a GPU, so a GPU session keeps compiled kernels for every other test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from moe.kernels import tuning
from moe.kernels.routing import sort_slots

if not tuning.INTERPRET:
    pytest.skip("interpreter tests (CPU); with a GPU, tests/gpu/test_scattermoe_gpu.py covers the kernels",
                allow_module_level=True)

H, I, R = 40, 24, 4  # not multiples of the interpreter blocks (16/32)
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


def routing(M: int, E: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    return ids, torch.rand(M, k, generator=g)


def run(name: str, ex: GroupedExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> dict:
    """Output and every gradient that exists, after one backward of <y, dy>."""
    x = x.detach().requires_grad_(x.requires_grad)
    w = w.detach().requires_grad_(True)
    for p in ex.parameters():
        p.grad = None
    y = expert_backend(name)(x, ids, w, ex)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * dy).sum().backward()
    out = {"y": y.detach(), "dx": x.grad, "dw": w.grad}
    out.update({n: p.grad for n, p in ex.named_parameters()})
    return out


def assert_matches_eager(ex, x, ids, w):
    got, ref = run("scattermoe", ex, x, ids, w), run("eager", ex, x, ids, w)
    for name, r in ref.items():
        g = got[name]
        if r is None:
            assert g is None, name
            continue
        err = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err <= TOL, f"{name}: norm-relative error {err:.2e}"
    return got


@pytest.mark.parametrize("E,k,rank,split",
                         [(4, 1, R, False), (8, 2, R, False), (8, 2, R, True), (4, 2, 0, False)],
                         ids=["E4-k1-lora", "E8-k2-lora", "E8-k2-lora-split", "E4-k2-full"])
def test_matches_eager(E, k, rank, split, monkeypatch):
    if split:  # force the large-experts (split-LoRA) path at tiny shapes
        monkeypatch.setattr("moe.backends.scattermoe._SPLIT_MIN_WEIGHT_ELEMS", 0)
    ex = make_experts(E, rank)
    M = 13
    ids, w = routing(M, E, k)
    ids[2] = -1            # a row whose slots are all -1
    ids[5, 0] = -1         # a partially routed row
    ids[ids == E - 1] = 0  # the last expert receives no tokens
    x = torch.randn(M, H, requires_grad=True)
    got = assert_matches_eager(ex, x, ids, w)
    assert got["y"][2].abs().max() == 0 and got["dx"][2].abs().max() == 0
    assert got["dw"][2].abs().max() == 0 and got["dw"][5, 0] == 0
    assert got["gate_up"][E - 1].abs().max() == 0


def test_all_tokens_to_one_expert():
    E, M = 4, 24
    ex = make_experts(E, R)
    ids = torch.full((M, 2), -1)
    ids[:, 0] = 3
    x = torch.randn(M, H, requires_grad=True)
    got = assert_matches_eager(ex, x, ids, torch.rand(M, 2))
    assert got["down"][:3].abs().max() == 0 and got["down_lora_A"][:3].abs().max() == 0


def test_frozen_base_and_input():
    """LoRA on a frozen base: no base-weight gradients, and x without grad takes the rank-only path."""
    E, M = 4, 11
    ex = make_experts(E, R)
    ex.gate_up.requires_grad_(False)
    ex.down.requires_grad_(False)
    ids, w = routing(M, E, 2)
    got = assert_matches_eager(ex, torch.randn(M, H), ids, w)
    assert got["gate_up"] is None and got["dx"] is None and got["gate_up_lora_A"] is not None


def test_every_slot_invalid():
    ex = make_experts(4, R)
    M = 5
    x = torch.randn(M, H, requires_grad=True)
    got = run("scattermoe", ex, x, torch.full((M, 2), -1), torch.rand(M, 2))
    for name, g in got.items():
        assert g.abs().max() == 0, name


def test_no_rows():
    """An EP rank can receive no tokens at all: empty output, zero weight gradients."""
    ex = make_experts(4, R)
    got = run("scattermoe", ex, torch.randn(0, H, requires_grad=True), torch.empty(0, 2, dtype=torch.long),
              torch.rand(0, 2))
    assert got["y"].shape == (0, H) and got["gate_up"].abs().max() == 0 and got["down_lora_B"].abs().max() == 0


def test_zero_scaling_equals_base():
    E, M = 4, 9
    ex, base = make_experts(E, R), make_experts(E, 0)
    with torch.no_grad():
        base.gate_up.copy_(ex.gate_up)
        base.down.copy_(ex.down)
    ex.lora_scaling = 0.0
    ids, w = routing(M, E, 2)
    x = torch.randn(M, H, requires_grad=True)
    got, ref = run("scattermoe", ex, x, ids, w), run("scattermoe", base, x, ids, w)
    for name in ("y", "dx", "dw", "gate_up", "down"):
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)


def test_lora_dropout_in_training_raises():
    ex = GroupedExperts(4, H, I, lora_rank=R, lora_dropout=0.1)
    ids, w = routing(3, 4, 2)
    with pytest.raises(NotImplementedError, match="lora_dropout"):
        expert_backend("scattermoe")(torch.randn(3, H), ids, w, ex)


def test_sort_slots_layout():
    ids = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]])
    s = sort_slots(ids, num_experts=4)
    assert s.offsets_E1.tolist() == [0, 2, 3, 5, 5]
    assert s.order_S[:5].tolist() == [2, 7, 6, 0, 3]  # by expert, token order within an expert
    assert torch.equal(s.order_S[s.inv_S.long()], torch.arange(8, dtype=torch.int32))


def test_import_without_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", "import moe.backends.scattermoe"], check=True, env=env,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
