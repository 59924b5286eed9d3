"""sort_slots (Triton interpreter, CPU) against independent torch references.

Every SlotOrder field must equal the reference exactly: the order is stable (slot order within a key),
so there is one right answer. Blocks are shrunk to 32 slots so small S spans many blocks and the last
block is partial.
"""

from __future__ import annotations

import os

import pytest
import torch

# Must precede the first triton import (see tests/unit/test_scattermoe.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from moe.kernels import routing, tuning
from moe.kernels.routing import gather_rows, slot_capacity, sort_slots
from tests.conftest import nan_slot_buffers

if not tuning.INTERPRET:
    pytest.skip("interpreter tests (CPU); with a GPU, tests/gpu/test_routing_gpu.py covers the kernels",
                allow_module_level=True)

SMALL_BLOCK = 32


def _ref_sort_slots(expert_ids_Mk: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor]:
    """The previous torch implementation: a stable torch.sort of the keys."""
    ids_S = expert_ids_Mk.reshape(-1)
    key_S = torch.where(ids_S >= 0, ids_S, num_experts)
    key_sorted_S, order_S = torch.sort(key_S, stable=True)
    bounds_E1 = torch.arange(num_experts + 1, dtype=key_sorted_S.dtype)
    offsets_E1 = torch.searchsorted(key_sorted_S, bounds_E1).to(torch.int32)
    order_S = order_S.to(torch.int32)
    inv_S = torch.empty_like(order_S)
    inv_S[order_S.long()] = torch.arange(order_S.numel(), dtype=torch.int32)
    rows_S = torch.div(order_S, expert_ids_Mk.shape[1], rounding_mode="floor")
    return {"order_S": order_S, "inv_S": inv_S, "offsets_E1": offsets_E1, "rows_S": rows_S, "ids_S": ids_S}


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(routing, "_MIN_BLOCK_S", SMALL_BLOCK)
    monkeypatch.setattr(routing, "_MAX_BLOCK_S", SMALL_BLOCK)


def random_ids(M: int, k: int, E: int, seed: int = 0, invalid: float = 0.25) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (M, k), generator=g)
    return torch.where(torch.rand(M, k, generator=g) < invalid, -1, ids)


def assert_matches_reference(ids_Mk: torch.Tensor, E: int):
    got, ref = sort_slots(ids_Mk, E), _ref_sort_slots(ids_Mk, E)
    assert got.topk == ids_Mk.shape[1] and got.num_experts == E
    for name, r in ref.items():
        g = getattr(got, name)
        assert g.dtype == r.dtype and torch.equal(g, r), name
    return got


# M * k > 1000 means many interpreted programs: one expert count there (CI time)
RANDOM_CASES = [(E, k, M) for E in (4, 8, 130) for k in (1, 2, 8) for M in (0, 1, 5, 300)
                if M * k <= 1000 or E == 130]


@pytest.mark.parametrize("E,k,M", RANDOM_CASES)
def test_random_ids(E, k, M, small_blocks):
    if M * k > 1000:  # keep the file fast with larger blocks
        routing._MIN_BLOCK_S = routing._MAX_BLOCK_S = 128
    assert_matches_reference(random_ids(M, k, E, seed=M * 100 + k * 10 + E), E)


def test_no_rows_gives_zero_offsets(small_blocks):
    s = assert_matches_reference(torch.empty(0, 2, dtype=torch.long), 6)
    assert s.order_S.numel() == 0 and s.offsets_E1.tolist() == [0] * 7


@pytest.mark.parametrize("M,k", [(5, 2), (40, 2)], ids=["one-block", "several-blocks"])
def test_all_slots_invalid(M, k, small_blocks):
    s = assert_matches_reference(torch.full((M, k), -1), 8)
    assert s.offsets_E1.tolist() == [0] * 9 and s.order_S.tolist() == list(range(M * k))


def test_all_tokens_to_one_expert(small_blocks):
    ids = torch.full((50, 2), -1)
    ids[:, 0] = 3
    s = assert_matches_reference(ids, 4)
    assert s.offsets_E1.tolist() == [0, 0, 0, 0, 50]


def test_experts_without_tokens(small_blocks):
    ids = random_ids(70, 3, 4, seed=5) * 3  # experts 0, 3, 6, 9 of 12 (and -3 -> treated as -1 below)
    ids = torch.where(ids < 0, -1, ids)
    assert_matches_reference(ids, 12)


def test_one_partial_block(small_blocks):
    assert_matches_reference(random_ids(7, 3, 5, seed=9), 5)  # S = 21 < one block


def test_default_blocks():
    """The block size the module picks (no monkeypatch): several 1024-slot blocks, the last partial."""
    assert_matches_reference(random_ids(1100, 2, 8, seed=3), 8)


def test_int32_ids(small_blocks):
    assert_matches_reference(random_ids(30, 2, 8, seed=4).to(torch.int32), 8)


def test_layout_example():
    ids = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]])
    s = sort_slots(ids, num_experts=4)
    assert s.offsets_E1.tolist() == [0, 2, 3, 5, 5]
    assert s.order_S.tolist() == [2, 7, 6, 0, 3, 1, 4, 5]
    assert s.rows_S.tolist() == [1, 3, 3, 0, 1, 0, 2, 2]


@pytest.mark.parametrize("M,k,E,H,invalid", [(40, 2, 4, 37, 0.25), (30, 3, 8, 70, 0.0), (20, 2, 4, 16, 1.0)],
                         ids=["some-invalid", "all-valid", "all-invalid"])
def test_gather_rows_writes_the_valid_positions(M, k, E, H, invalid, small_blocks, monkeypatch):
    """out[p] = x[slot // k] for the valid sorted positions (x a column-strided view); the -1 tail is
    never written (with NaN-filled buffers its rows stay NaN). With valid_slots the output has
    slot_capacity's rows (the valid ones rounded up to 16), the same valid rows."""
    ids = random_ids(M, k, E, seed=M + H, invalid=invalid)
    x = torch.randn(H, M).t()
    valid = int((ids >= 0).sum())
    nan_slot_buffers(monkeypatch)
    for given, rows in ((None, M * k), (valid, slot_capacity(M * k, valid))):
        slots = sort_slots(ids, E, given)
        out = gather_rows(x, slots)
        ref = x[(slots.order_S[:valid] // k).long()]
        assert out.shape == (rows, H) and torch.equal(out[:valid], ref)
        assert out[valid:].isnan().all()
