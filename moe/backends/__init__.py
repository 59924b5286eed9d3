"""Expert compute backends, interchangeable under one contract (explicit registry).

    y_MH = expert_backend(name)(x_MH, expert_ids_Mk, weights_Mk, experts)

computes y[m] = sum_j weights[m, j] * expert_{ids[m, j]}(x[m]) over slots with id >= 0, where
expert(x) = down(silu(gate(x)) * up(x)) (+ LoRA). Sentinel-skip: no row is computed for a -1 slot.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

import torch


class ExpertBackend(Protocol):
    def __call__(self, x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor,
                 experts) -> torch.Tensor: ...


_BACKENDS: dict[str, ExpertBackend] = {}
# Backends live in their own modules and register on import; importing lazily keeps Triton optional.
_MODULES = {"eager": "moe.backends.eager", "grouped_mm": "moe.backends.grouped_mm",
            "scattermoe": "moe.backends.scattermoe"}


def register_backend(name: str) -> Callable[[ExpertBackend], ExpertBackend]:
    def wrap(fn: ExpertBackend) -> ExpertBackend:
        _BACKENDS[name] = fn
        return fn
    return wrap


def available_backends() -> list[str]:
    return sorted(_MODULES)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: the autocast dtype when autocast is on (the fp32 residual
    stream enters the experts, and the Triton / grouped GEMMs have no autocast rule), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def expert_backend(name: str) -> ExpertBackend:
    if name not in _BACKENDS:
        if name not in _MODULES:
            raise ValueError(f"unknown expert backend {name!r}; choose one of {available_backends()} "
                             "(config key model.expert_backend)")
        importlib.import_module(_MODULES[name])
    return _BACKENDS[name]
