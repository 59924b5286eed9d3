"""Expert compute backends, interchangeable under one contract, in the `EXPERT_BACKENDS` registry.

    y_MH = expert_backend(name)(x_MH, expert_ids_Mk, weights_Mk, experts, valid_slots=None, bound=None)

computes y[m] = sum_j weights[m, j] * expert_{ids[m, j]}(x[m]) over slots with id >= 0, where
expert(x) = down(silu(gate(x)) * up(x)) (+ LoRA). Sentinel-skip: no row is computed for a -1 slot.
valid_slots: the number of slots with id >= 0 when the caller knows it on the host (the EP dispatchers'
Routed.valid_slots), else None; it must be exact. scattermoe sizes its per-slot buffers by it (under EP
most of the M*k slots are -1), grouped_mm takes it instead of reading the count from the device.
bound: a moe.capacity.SlotCapacity where valid_slots is unknown (the all_gather dispatcher in
training): scattermoe sizes its buffers by bound.rows and drops (and counts) the valid slots past it; the
other backends hold every valid slot and ignore it (exact, no memory saved).
Backends read weights only through `experts.base_weight(name)` and `experts.lora(name)`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from gpu.registry import TRITON_DEVICES, Capabilities, Registry, triton_missing
from quant.weight import FP4_FORMATS


class ExpertBackend(Protocol):
    def __call__(self, x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor,
                 experts, valid_slots: int | None = None, bound=None) -> torch.Tensor: ...


def _module(name: str, module: str) -> Callable[[], ExpertBackend]:
    """Imports `module`, which registers the backend `name`, on first use (never inside a compiled region:
    layers fetch their backend when they are built)."""
    def load() -> ExpertBackend:
        importlib.import_module(module)  # registers `name`
        return EXPERT_BACKENDS.get(name)
    return load


def _sonicmoe_missing() -> str | None:
    return importlib.import_module("moe.backends.sonicmoe").unavailable_reason()



EXPERT_BACKENDS: Registry[ExpertBackend] = Registry("expert backend", "model.expert_backend", auto=True)
# The per-expert loop: the numerical reference (its FP4 path dequantizes by the eager valid count).
EXPERT_BACKENDS.declare("eager", Capabilities(reference=True, compile_quantized=()),
                        _module("eager", "moe.backends.eager"))
# torch._grouped_mm traces only in bf16; FP4 experts are dequantized by the eager valid count, FP8 ones run
# on FP8 GEMMs. Those eager only: compiled, FP8 training's dX and the FP8 base GEMM's output came out zero on an
# H200 (and inductor's CPU code gave NaN weight gradients), docs/validation.md.
EXPERT_BACKENDS.declare("grouped_mm", Capabilities(auto_on=("cpu", "cuda"), priority=1, compile_quantized=(),
                                                   train_fp8=True, compile_train_fp8=False,
                                                   compile_cpu_dtypes=("bfloat16",)),
                        _module("grouped_mm", "moe.backends.grouped_mm"))
# Fused Triton kernels, LoRA, FP4 dequant, FP8 base GEMMs and FP8 training (eager only) included: the fastest
# where CUDA and Triton are, FP8 paths included (docs/benchmarks.md, FP8 experts).
EXPERT_BACKENDS.declare("scattermoe", Capabilities(devices=TRITON_DEVICES, unavailable=triton_missing,
                                                   auto_on=("cuda",), priority=2,
                                                   quantized_base=(*FP4_FORMATS, "fp8"),
                                                   compile_quantized=(*FP4_FORMATS, "fp8"),
                                                   train_fp8=True, compile_train_fp8=False),
                        _module("scattermoe", "moe.backends.scattermoe"))
# Eager only (SonicMoE asserts it is not compiling); slower than scattermoe, so never "auto".
EXPERT_BACKENDS.declare("sonicmoe", Capabilities(devices=("cuda",), unavailable=_sonicmoe_missing, compile=False),
                        _module("sonicmoe", "moe.backends.sonicmoe"))


def expert_backend(name: str) -> ExpertBackend:
    """The backend registered as `name` (a concrete name: runtime.plan resolves "auto"). Its module is
    imported on the first call, so call it once outside any compiled region (MoEBlock does, when built)."""
    return EXPERT_BACKENDS.get(name)


@contextmanager
def kernel_warm_up(group) -> Iterator[None]:
    """Kernel choices that the loaded backends time (moe.kernels.tuning.faster) are made inside, agreed over
    `group` (a torch.distributed ProcessGroup, None: this process alone). The runtime wraps its first step in it,
    once, after parallelize; no forward outside it communicates for tuning."""
    tuning = sys.modules.get("moe.kernels.tuning")  # loaded only with a Triton backend
    if tuning is None:
        yield
        return
    with tuning.warm_up(group):
        yield
