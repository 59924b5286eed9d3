"""The bound on the valid slots an expert backend holds where their count is known only on the device.

    bound = SlotCapacity(rows, dropped=torch.zeros((), dtype=torch.int64, device=dev))

The all_gather dispatcher routes every rank's tokens to every rank, so how many of a rank's slots are valid
(its experts') is known only on the device. Rather than size every per-slot buffer by all of them, a backend
sizes them by `rows` (rounded up to 16, at most all slots: moe.kernels.routing.slot_capacity), drops the valid
slots sorted past them (never computed, combined or given a gradient) and adds their number to `dropped`, a
device int64 scalar. The runtime reads it after the step and, when it is not zero, grows `rows` and computes
the step again (runtime.train), so no result ever comes from a dropped slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SlotCapacity:
    rows: int
    dropped: torch.Tensor
