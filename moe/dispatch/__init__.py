"""Token dispatchers behind one contract (see moe/dispatch/base.py), in the `DISPATCHERS` registry
(config key parallelism.dispatcher).

    dispatcher = build_dispatcher(name, ep_group, num_experts)

`local` keeps every expert on this rank (the identity); `all_to_all` exchanges tokens over the EP
group, and is the identity too when that group has one rank (nothing to exchange, no collective).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from gpu.registry import Registry
from moe.dispatch.all_to_all import AllToAllDispatcher
from moe.dispatch.base import Dispatcher, Routed
from moe.dispatch.local import LocalDispatcher

__all__ = ["DISPATCHERS", "AllToAllDispatcher", "Dispatcher", "LocalDispatcher", "Routed", "build_dispatcher"]

# (EP group or None, num_experts) -> a dispatcher for the blocks of one model
DispatcherFactory = Callable[[dist.ProcessGroup | None, int], Dispatcher]
DISPATCHERS: Registry[DispatcherFactory] = Registry("dispatcher", "parallelism.dispatcher")


def _ep_size(ep_group: dist.ProcessGroup | None) -> int:
    return 1 if ep_group is None else dist.get_world_size(ep_group)


@DISPATCHERS.register("local")
def _local(ep_group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    if _ep_size(ep_group) > 1:
        raise ValueError(f"dispatcher 'local' keeps every expert on this rank, but the EP group has "
                         f"{_ep_size(ep_group)} ranks; use all_to_all (config key parallelism.dispatcher)")
    return LocalDispatcher()


@DISPATCHERS.register("all_to_all")
def _all_to_all(ep_group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    if _ep_size(ep_group) == 1:
        return LocalDispatcher()
    return AllToAllDispatcher(ep_group, num_experts)


DISPATCHERS.unavailable("deepep", "it is not implemented yet; use all_to_all")


def build_dispatcher(name: str, ep_group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    """The dispatcher `name` over `ep_group` (None: no expert parallelism)."""
    return DISPATCHERS.get(name)(ep_group, num_experts)
