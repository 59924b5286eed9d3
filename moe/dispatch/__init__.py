"""Token dispatchers behind one contract (see moe/dispatch/base.py), in the `DISPATCHERS` registry
(config key parallelism.dispatcher).

    dispatcher = build_dispatcher(name, ep_group, num_experts)

`local` keeps every expert on this rank (the identity); `all_to_all` exchanges tokens over the EP
group, and is the identity too when that group has one rank (nothing to exchange, no collective).
`deepep` exchanges them with DeepEP's NVLink kernels (moe/dispatch/deepep.py); runtime.plan refuses it
where the deep_ep package is not installed (benchmarks/build_deepep.sh builds it), which is imported on
first use, and it is the identity too with one rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from gpu.registry import Capabilities, Registry
from moe.dispatch.all_to_all import AllToAllDispatcher
from moe.dispatch.base import Dispatcher, Routed
from moe.dispatch.deepep import deepep_unavailable_reason
from moe.dispatch.load import LoadReading
from moe.dispatch.local import LocalDispatcher

__all__ = ["DISPATCHERS", "AllToAllDispatcher", "Dispatcher", "LoadReading", "LocalDispatcher", "Routed",
           "build_dispatcher"]

# (EP group or None, num_experts) -> a dispatcher for the blocks of one model
DispatcherFactory = Callable[[dist.ProcessGroup | None, int], Dispatcher]
DISPATCHERS: Registry[DispatcherFactory] = Registry("dispatcher", "parallelism.dispatcher")


def _ep_size(ep_group: dist.ProcessGroup | None) -> int:
    return 1 if ep_group is None else dist.get_world_size(ep_group)


# Every expert on every rank: ep 1 only (runtime.plan refuses it under ep > 1).
@DISPATCHERS.register("local", Capabilities(ep=False))
def _local(ep_group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    return LocalDispatcher()


@DISPATCHERS.register("all_to_all", Capabilities())
def _all_to_all(ep_group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    if _ep_size(ep_group) == 1:
        return LocalDispatcher()
    return AllToAllDispatcher(ep_group, num_experts)


def _deepep_missing() -> str | None:
    missing = deepep_unavailable_reason()
    return None if missing is None else f"{missing}; or use all_to_all"


@DISPATCHERS.register("deepep", Capabilities(devices=("cuda",), unavailable=_deepep_missing))
def _deepep(ep_group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    if _ep_size(ep_group) == 1:
        return LocalDispatcher()
    from moe.dispatch.deepep import DeepEPDispatcher  # imports deep_ep (and CUDA) only now

    return DeepEPDispatcher(ep_group, num_experts)


def build_dispatcher(name: str, ep_group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    """The dispatcher `name` over `ep_group` (None: no expert parallelism)."""
    return DISPATCHERS.get(name)(ep_group, num_experts)
