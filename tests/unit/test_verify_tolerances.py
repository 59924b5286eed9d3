"""runtime.verify.compare: bf16 gradient bounds are strict at step 1 and looser once the runs have drifted."""

from __future__ import annotations

import torch

from runtime.verify import compare


def _step(expert_grad: torch.Tensor, router_grad: torch.Tensor) -> dict:
    grads = {"model.layers.0.mlp.experts.down": expert_grad, "model.layers.0.mlp.gate.weight": router_grad}
    return {"loss": 6.0, "grad_norm": 1.0, "grads": grads}


def _steps(expert_errors: list[float], router_error: float = 0.0) -> tuple[list[dict], list[dict]]:
    """Distributed and reference records whose expert gradient differs by the given norm-relative errors."""
    ref = torch.ones(64)
    direction = torch.zeros(64)
    direction[0] = ref.norm()
    dist = [_step(ref + e * direction, ref + router_error * direction) for e in expert_errors]
    return dist, [_step(ref, ref) for _ in expert_errors]


def test_bf16_step_one_keeps_the_strict_bound():
    ok, lines = compare(*_steps([7e-2]), "bfloat16")
    assert not ok and lines[1].endswith("FAIL")


def test_bf16_after_an_update_allows_routing_drift():
    ok, lines = compare(*_steps([3e-2, 7e-2, 9e-2]), "bfloat16")
    assert ok, lines


def test_bf16_after_an_update_still_catches_real_errors():
    ok, lines = compare(*_steps([3e-2, 2e-1]), "bfloat16")
    assert not ok and lines[2].endswith("FAIL")


def test_fp32_bound_does_not_loosen():
    ok, _ = compare(*_steps([1e-5, 5e-4]), "float32")
    assert not ok


def test_router_bound():
    assert compare(*_steps([1e-2], router_error=9e-2), "bfloat16")[0]
    assert not compare(*_steps([1e-2], router_error=2e-1), "bfloat16")[0]
