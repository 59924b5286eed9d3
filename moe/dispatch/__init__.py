"""Token dispatchers behind one contract (see moe/dispatch/base.py), in the `DISPATCHERS` registry
(config key parallelism.dispatcher).

    dispatcher = build_dispatcher(name, ep_group, num_experts, tokens_per_rank, gather_capacity)

`local` keeps every expert on this rank (the identity); `all_to_all` exchanges tokens over the EP
group, and is the identity too when that group has one rank (nothing to exchange, no collective).
`all_gather` gathers every rank's tokens to every rank and reduce-scatters the results
(moe/dispatch/all_gather.py): no host sync, so it traces and the host runs ahead, for bytes that match
all_to_all's where a token needs most ranks anyway; it pads each rank's tokens to tokens_per_rank.
`deepep` exchanges them with DeepEP's NVLink kernels (moe/dispatch/deepep.py); runtime.plan refuses it
where the deep_ep package is not installed (benchmarks/build_deepep.sh builds it), which is imported on
first use, and it is the identity too with one rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from gpu.registry import Capabilities, Registry
from moe.dispatch.all_gather import AllGatherDispatcher
from moe.dispatch.all_to_all import AllToAllDispatcher
from moe.dispatch.base import Dispatcher, Routed
from moe.dispatch.deepep import deepep_unavailable_reason
from moe.dispatch.load import LoadReading
from moe.dispatch.local import LocalDispatcher

__all__ = ["DISPATCHERS", "AllGatherDispatcher", "AllToAllDispatcher", "Dispatcher", "LoadReading",
           "LocalDispatcher", "Routed", "build_dispatcher"]

# (EP group or None, num_experts, tokens per rank per forward or None, all_gather's capacity) -> a dispatcher
DispatcherFactory = Callable[[dist.ProcessGroup | None, int, int | None, float], Dispatcher]
# auto is resolved by runtime.plan (memory and LoRA decide, not capabilities alone)
DISPATCHERS: Registry[DispatcherFactory] = Registry("dispatcher", "parallelism.dispatcher", auto=True)


def _ep_size(ep_group: dist.ProcessGroup | None) -> int:
    return 1 if ep_group is None else dist.get_world_size(ep_group)


# Every expert on every rank: ep 1 only (runtime.plan refuses it under ep > 1).
@DISPATCHERS.register("local", Capabilities(ep=False))
def _local(ep_group: dist.ProcessGroup | None, num_experts: int, tokens_per_rank: int | None,
           capacity: float) -> Dispatcher:
    return LocalDispatcher()


@DISPATCHERS.register("all_to_all", Capabilities())
def _all_to_all(ep_group: dist.ProcessGroup | None, num_experts: int, tokens_per_rank: int | None,
                capacity: float) -> Dispatcher:
    if _ep_size(ep_group) == 1:
        return LocalDispatcher()
    return AllToAllDispatcher(ep_group, num_experts)


@DISPATCHERS.register("all_gather", Capabilities())
def _all_gather(ep_group: dist.ProcessGroup | None, num_experts: int, tokens_per_rank: int | None,
                capacity: float) -> Dispatcher:
    if _ep_size(ep_group) == 1:
        return LocalDispatcher()
    if tokens_per_rank is None:
        raise ValueError("the all_gather dispatcher pads every rank's tokens to one size: pass tokens_per_rank")
    return AllGatherDispatcher(ep_group, num_experts, tokens_per_rank, capacity)


def _deepep_missing() -> str | None:
    missing = deepep_unavailable_reason()
    return None if missing is None else f"{missing}; or use all_to_all"


@DISPATCHERS.register("deepep", Capabilities(devices=("cuda",), unavailable=_deepep_missing))
def _deepep(ep_group: dist.ProcessGroup | None, num_experts: int, tokens_per_rank: int | None,
            capacity: float) -> Dispatcher:
    if _ep_size(ep_group) == 1:
        return LocalDispatcher()
    from moe.dispatch.deepep import DeepEPDispatcher  # imports deep_ep (and CUDA) only now

    return DeepEPDispatcher(ep_group, num_experts)


def build_dispatcher(name: str, ep_group: dist.ProcessGroup | None, num_experts: int,
                     tokens_per_rank: int | None = None, gather_capacity: float = 1.25) -> Dispatcher:
    """The dispatcher `name` over `ep_group` (None: no expert parallelism); tokens_per_rank: the most tokens a
    rank routes in one forward (all_gather pads to it); gather_capacity: all_gather's first bound on a rank's
    valid slots, in multiples of their balanced count (moe/dispatch/all_gather.py)."""
    return DISPATCHERS.get(name)(ep_group, num_experts, tokens_per_rank, gather_capacity)
