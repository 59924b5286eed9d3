"""sort_slots on the GPU at real routing shapes, against torch references.

The slot order must equal a stable torch.sort exactly (every SlotOrder field).
"""

from __future__ import annotations

import pytest
import torch

from moe.kernels.routing import gather_rows, sort_slots

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (M, k, E, fraction of -1 slots)
CASES = [(8192, 8, E, p) for E in (128, 256) for p in (0.0, 0.5, 0.75)] + [(65536 * 4, 8, 512, 0.5)]


def _ref_sort_slots(expert_ids_Mk: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor]:
    """The previous torch implementation: a stable torch.sort of the keys."""
    ids_S = expert_ids_Mk.reshape(-1)
    key_S = torch.where(ids_S >= 0, ids_S, num_experts)
    key_sorted_S, order_S = torch.sort(key_S, stable=True)
    bounds_E1 = torch.arange(num_experts + 1, device=ids_S.device, dtype=key_sorted_S.dtype)
    offsets_E1 = torch.searchsorted(key_sorted_S, bounds_E1).to(torch.int32)
    order_S = order_S.to(torch.int32)
    inv_S = torch.empty_like(order_S)
    inv_S[order_S.long()] = torch.arange(order_S.numel(), device=ids_S.device, dtype=torch.int32)
    rows_S = torch.div(order_S, expert_ids_Mk.shape[1], rounding_mode="floor")
    return {"order_S": order_S, "inv_S": inv_S, "offsets_E1": offsets_E1, "rows_S": rows_S, "ids_S": ids_S}


def make_ids(M: int, k: int, E: int, invalid: float, seed: int = 0) -> torch.Tensor:
    """Top-k of random logits (distinct experts per row, int64 like torch.topk), a fraction set to -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randn(M, E, device="cuda", generator=g).topk(k, dim=-1).indices
    return torch.where(torch.rand(M, k, device="cuda", generator=g) < invalid, -1, ids)


def assert_matches_reference(ids_Mk: torch.Tensor, E: int):
    got, ref = sort_slots(ids_Mk, E), _ref_sort_slots(ids_Mk, E)
    for name, r in ref.items():
        g = getattr(got, name)
        assert g.dtype == r.dtype and torch.equal(g, r), name
    return got


@pytest.mark.parametrize("M,k,E,invalid", CASES, ids=[f"M{m}-k{k}-E{e}-inv{p}" for m, k, e, p in CASES])
def test_sort_slots_matches_stable_sort(M, k, E, invalid):
    assert_matches_reference(make_ids(M, k, E, invalid), E)


def test_sort_slots_edge_cases():
    assert_matches_reference(torch.full((1000, 8), -1, device="cuda"), 128)  # every slot -1
    one = torch.full((5000, 2), -1, device="cuda")
    one[:, 1] = 7
    assert_matches_reference(one, 8)  # every token to one expert
    assert_matches_reference(make_ids(3, 8, 512, 0.3), 512)  # fewer slots than one block
    empty = sort_slots(torch.empty(0, 8, dtype=torch.long, device="cuda"), 64)
    assert empty.order_S.numel() == 0 and empty.offsets_E1.tolist() == [0] * 65


@pytest.mark.parametrize("invalid", [0.0, 0.75])
def test_gather_rows_matches_index_select(invalid):
    ids = make_ids(8192, 8, 128, invalid)
    slots = sort_slots(ids, 128)
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    valid = int((ids >= 0).sum())
    out = gather_rows(x, slots)
    assert torch.equal(out[:valid], x.index_select(0, slots.rows_S[:valid]))
