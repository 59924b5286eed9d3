"""The benchmark's transformers baseline computes the same expert layer as ours, so the comparison is fair.

benchmarks/baselines/transformers_experts.py wraps transformers' own Qwen3MoeExperts (its grouped_mm implementation; HF+PEFT
for LoRA). Its output and input gradient must equal our eager per-expert reference for the same weights,
including an EP rank's -1 slots, and its PEFT adapters must have the size of ours.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from benchmarks.baselines.transformers_experts import transformers_layer
from moe.backends import expert_backend
from moe.experts import GroupedExperts

E, H, I, K, T = 8, 48, 32, 2, 24


def _case(rank: int, ep: int):
    torch.manual_seed(0)
    ex = GroupedExperts(E // ep, H, I, lora_rank=rank, lora_alpha=2 * rank if rank else None)
    with torch.no_grad():
        ex.gate_up.normal_(0, 0.2)
        ex.down.normal_(0, 0.2)
    w, ids = torch.randn(T, E).softmax(-1).topk(K, dim=-1)
    ids = torch.where(ids < E // ep, ids, -1)
    return ex, torch.randn(T, H, requires_grad=True), ids, w


@pytest.mark.parametrize("ep", [1, 2])
def test_transformers_layer_matches_our_reference(ep):
    ex, x, ids, w = _case(rank=0, ep=ep)
    assert (ids < 0).any() == (ep > 1)
    layer, backend, hf_ids = transformers_layer(ex, ids)
    y_hf = backend(x, hf_ids, w, layer)
    (dx_hf,) = torch.autograd.grad(y_hf.sum(), x)
    y_ref = expert_backend("eager")(x, ids, w, ex)
    (dx_ref,) = torch.autograd.grad(y_ref.sum(), x)
    torch.testing.assert_close(y_hf, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_hf, dx_ref, rtol=1e-5, atol=1e-5)
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == {"experts.gate_up_proj",
                                                                           "experts.down_proj"}


def test_transformers_lora_trains_adapters_of_our_size_on_a_frozen_base():
    ex, x, ids, w = _case(rank=4, ep=1)
    layer, backend, hf_ids = transformers_layer(ex, ids)
    trainable = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    ours = sum(p.numel() for n, p in ex.named_parameters() if "lora" in n)
    assert sum(p.numel() for p in trainable.values()) == ours
    assert all("lora" in n for n in trainable)
    backend(x, hf_ids, w, layer).sum().backward()
    assert all(p.grad is not None for p in trainable.values())
