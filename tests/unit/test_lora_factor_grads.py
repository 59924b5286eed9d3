"""lora_factor_grads (the four LoRA-factor gradients of the scattermoe backward in one launch) against
torch math, on the CPU (Triton interpreter, fp32, tiny shapes).

The reference works in slot layout (slot s = m*k + j, its token row s // k) and sums per expert over
the slots routed to it, so it shares no indexing with the kernel. The kernel's expert-sorted inputs
are built from the slot-layout tensors, with NaN in the rows of the -1 slots, and its outputs start
as NaN, so every element must be written (zeros for experts without rows) and no -1 row may leak.
H, I and r are not multiples of the interpreter blocks (BLOCK_Q 32, BLOCK_K 16, BLOCK_P >= 16).
"""

from __future__ import annotations

import os

import pytest
import torch

# Must precede the first triton import (the kernels are decorated for the interpreter at import time);
# only without a GPU, so a GPU session keeps compiled kernels for every other test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from moe.kernels import tuning
from moe.kernels.grouped_xty import FactorGrad, lora_factor_grads
from moe.kernels.routing import SlotOrder, sort_slots

if not tuning.INTERPRET:
    pytest.skip("interpreter tests (CPU)", allow_module_level=True)

H, I, M = 40, 24, 13
SCALING = 0.75
TOL = 1e-5
NAN = float("nan")


def routing(E: int, k: int, seed: int = 1) -> torch.Tensor:
    """ids [M, k] with a row whose slots are all -1, a partly routed row and an expert without rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    ids[2] = -1
    ids[5, 0] = -1
    ids[ids == E - 1] = 0
    return ids


def expert_sorted(t_S: torch.Tensor, slots: SlotOrder) -> torch.Tensor:
    """A slot-layout tensor in expert-sorted order; the rows of the -1 slots hold NaN."""
    out = torch.full_like(t_S, NAN)
    valid_S = slots.ids_S >= 0
    out[slots.inv_S[valid_S].long()] = t_S[valid_S]
    return out


def reference(a_SP: torch.Tensor, b_SQ: torch.Tensor, ids_S: torch.Tensor, E: int) -> torch.Tensor:
    """[E, P, Q]: scaling * sum over the slots s routed to e of a[s]^T b[s] (slot layout)."""
    out = torch.zeros(E, a_SP.shape[1], b_SQ.shape[1])
    for e in range(E):
        s_e = (ids_S == e).nonzero().squeeze(1)
        out[e] = SCALING * a_SP[s_e].T @ b_SQ[s_e]
    return out


def assert_close(got: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    assert got.shape == ref.shape and got.is_contiguous(), f"{name}: {tuple(got.shape)} {got.stride()}"
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= TOL, f"{name}: norm-relative error {err:.2e}"


def factor_grads(problems: list[FactorGrad | None], slots: SlotOrder) -> list[torch.Tensor | None]:
    """lora_factor_grads with outputs that start as NaN: an element the kernel does not write shows."""
    real_empty = torch.empty
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(NAN))
        return lora_factor_grads(problems, slots, SCALING)


def backward_case(ids: torch.Tensor, E: int, r_gu: int, r_down: int, seed: int = 0):
    """The four problems of the scattermoe backward, as the kernel takes them and as the reference
    computes them: {name: (FactorGrad, reference [E, out, in] in the parameter's layout)}."""
    g = torch.Generator().manual_seed(seed)
    k = ids.shape[1]
    slots = sort_slots(ids, E)
    ids_S = ids.reshape(-1)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    x_MH = randn(M, H)
    dgub, xa, dgu = randn(M * k, r_gu), randn(M * k, r_gu), randn(M * k, 2 * I)
    dyb, hw, hwa, dyg = randn(M * k, r_down), randn(M * k, I), randn(M * k, r_down), randn(M * k, H)
    x_S = x_MH.repeat_interleave(k, 0)  # slot s reads token row s // k
    problems = {
        "gu_A": (FactorGrad(expert_sorted(dgub, slots), x_MH, gather_r=True), reference(dgub, x_S, ids_S, E)),
        "gu_B": (FactorGrad(expert_sorted(xa, slots), expert_sorted(dgu, slots), transposed=True),
                 reference(dgu, xa, ids_S, E)),
        "down_A": (FactorGrad(expert_sorted(dyb, slots), expert_sorted(hw, slots)),
                   reference(dyb, hw, ids_S, E)),
        "down_B": (FactorGrad(expert_sorted(hwa, slots), expert_sorted(dyg, slots), transposed=True),
                   reference(dyg, hwa, ids_S, E)),
    }
    return slots, problems


def check(slots: SlotOrder, problems: dict, wanted: tuple[str, ...]) -> dict:
    got = factor_grads([problems[n][0] if n in wanted else None for n in problems], slots)
    for name, out in zip(problems, got):
        if name not in wanted:
            assert out is None, name
            continue
        assert_close(out, problems[name][1], name)
    return dict(zip(problems, got))


@pytest.mark.parametrize("E,k,r", [(4, 1, 4), (4, 2, 8), (8, 1, 8), (8, 2, 4)])
def test_all_four_match_torch(E, k, r):
    slots, problems = backward_case(routing(E, k), E, r, r)
    got = check(slots, problems, tuple(problems))
    assert got["gu_A"].shape == (E, r, H) and got["gu_B"].shape == (E, 2 * I, r)
    assert got["down_A"].shape == (E, r, I) and got["down_B"].shape == (E, H, r)
    for name, out in got.items():
        assert (out[E - 1] == 0).all(), name  # the expert without rows


@pytest.mark.parametrize("wanted", [("gu_A", "down_B"), ("gu_B",), ("gu_B", "down_A", "down_B")])
def test_subsets(wanted):
    E = 4
    slots, problems = backward_case(routing(E, 2), E, 4, 4)
    check(slots, problems, wanted)


def test_ranks_differ_per_problem():
    """One launch, BLOCK_P from the larger rank (20: not a power of two)."""
    E = 4
    slots, problems = backward_case(routing(E, 2), E, 4, 20)
    check(slots, problems, tuple(problems))


def test_all_rows_to_one_expert():
    E = 4
    ids = torch.full((M, 2), -1)
    ids[:, 0] = 3
    slots, problems = backward_case(ids, E, 8, 8)
    got = check(slots, problems, tuple(problems))
    for name, out in got.items():
        assert (out[:3] == 0).all(), name


def test_no_valid_slots_gives_zeros():
    E = 4
    slots, problems = backward_case(torch.full((M, 2), -1), E, 4, 4)
    for name, out in zip(problems, factor_grads([p for p, _ in problems.values()], slots)):
        assert (out == 0).all(), name


def test_nothing_needed():
    slots = sort_slots(torch.zeros(3, 2, dtype=torch.long), 4)
    assert lora_factor_grads([None, None, None, None], slots, SCALING) == [None] * 4


def test_more_than_four_problems_raise():
    E = 4
    slots, problems = backward_case(routing(E, 2), E, 4, 4)
    with pytest.raises(ValueError, match="at most 4"):
        lora_factor_grads([p for p, _ in problems.values()] * 2, slots, SCALING)
