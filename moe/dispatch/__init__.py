"""Token dispatchers behind one contract (see moe/dispatch/base.py).

    dispatcher = build_dispatcher(ep_group, num_experts)   # local when there is no EP
"""

from __future__ import annotations

import torch.distributed as dist

from moe.dispatch.all_to_all import AllToAllDispatcher
from moe.dispatch.base import Dispatcher, Routed
from moe.dispatch.local import LocalDispatcher

__all__ = ["AllToAllDispatcher", "Dispatcher", "LocalDispatcher", "Routed", "build_dispatcher"]


def build_dispatcher(ep_group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    """LocalDispatcher without an EP group (or with one of size 1), else AllToAllDispatcher."""
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return LocalDispatcher()
    return AllToAllDispatcher(ep_group, num_experts)
