"""Activation checkpointing (full / selective) recomputes blocks without changing loss or gradients."""

from __future__ import annotations

import pytest
import torch

from runtime.distributed.activation_checkpoint import apply_activation_checkpointing
from runtime.models import from_pretrained


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_blocks_give_the_same_gradients(tiny_moe_ckpt, mode):
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for ac in ("none", mode):
        model = from_pretrained(tiny_moe_ckpt, expert_backend="grouped_mm")
        apply_activation_checkpointing(model, ac)
        loss = model(ids).float().square().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7), name
    assert all(b.checkpoint_fn is not None for b in model.model.layers.values())
