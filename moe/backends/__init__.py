"""Expert compute backends, interchangeable under one contract, in the `EXPERT_BACKENDS` registry.

    y_MH = expert_backend(name)(x_MH, expert_ids_Mk, weights_Mk, experts, valid_slots=None)

computes y[m] = sum_j weights[m, j] * expert_{ids[m, j]}(x[m]) over slots with id >= 0, where
expert(x) = down(silu(gate(x)) * up(x)) (+ LoRA). Sentinel-skip: no row is computed for a -1 slot.
valid_slots: the number of slots with id >= 0 when the caller knows it on the host (the EP dispatchers'
Routed.valid_slots), else None; it must be exact. scattermoe sizes its per-slot buffers by it (under EP
most of the M*k slots are -1), grouped_mm takes it instead of reading the count from the device.
Backends read weights only through `experts.base_weight(name)` and `experts.lora(name)`.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from gpu.registry import Registry


class ExpertBackend(Protocol):
    def __call__(self, x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor,
                 experts, valid_slots: int | None = None) -> torch.Tensor: ...


def resolve_expert_backend(name: str, device: torch.device | str) -> str:
    """"auto" is scattermoe (fused Triton kernels, LoRA included) on CUDA where Triton is installed, else
    grouped_mm; other names as given."""
    if name != "auto":
        return name
    on_cuda = torch.device(device).type == "cuda"
    return "scattermoe" if on_cuda and EXPERT_BACKENDS.is_available("scattermoe") else "grouped_mm"


def _auto_backend() -> str:
    return resolve_expert_backend("auto", "cuda" if torch.cuda.is_available() else "cpu")


EXPERT_BACKENDS: Registry[ExpertBackend] = Registry("expert backend", "model.expert_backend", auto=_auto_backend)
# Backends live in their own modules and register when imported (at the end of this module).
# sonicmoe registers itself as unavailable without the sonic-moe package or CUDA ("auto" never picks it).
_MODULES = {"eager": "moe.backends.eager", "grouped_mm": "moe.backends.grouped_mm",
            "scattermoe": "moe.backends.scattermoe", "sonicmoe": "moe.backends.sonicmoe"}


def expert_backend(name: str, device: torch.device | str = "cpu") -> ExpertBackend:
    """The backend registered as `name` ("auto" resolved for `device`). A plain dict lookup (every backend
    is imported with this module), so a first call inside a torch.compile(fullgraph=True) region traces
    without a break."""
    return EXPERT_BACKENDS.get(resolve_expert_backend(name, device))


def _import_backends() -> None:
    """Import every backend now, not lazily: an import inside a compiled region breaks the graph.
    One whose optional dependency is missing is registered as unavailable (Triton stays optional)."""
    for name, module in _MODULES.items():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is None or err.name.split(".")[0] != "triton":
                raise
            EXPERT_BACKENDS.unavailable(name, f"{err} (install triton)")


_import_backends()
