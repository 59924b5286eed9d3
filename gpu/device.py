"""Properties of the device: the CUDA device's that kernels size their grids by (read once per device), the
dtype a kernel without an autocast rule computes in, and how host tensors reach it without a wait."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (as nn.Linear would compute; custom kernels and Triton GEMMs have
    no autocast rule), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without the host waiting: to CUDA through pinned memory (a copy from pageable
    memory waits for the work queued on the stream before it)."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
