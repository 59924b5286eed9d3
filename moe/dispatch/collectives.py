"""The MoE layers' collectives (the EP token exchange, the balance loss's all-reduce), in the form that
suits who is watching.

    all_to_all(x, out_splits, in_splits, group) -> the exchanged rows (None splits: equal parts)
    all_reduce_sum(x, group) -> the elementwise sum over the group
    all_gather(x, group) -> every rank's x, stacked along dim 0 in rank order
    reduce_scatter_sum(x, group) -> this rank's part (dim 0 in ranks' parts) of the elementwise sum over the group

Under a torch dispatch mode (selective activation checkpointing's caching and cached modes) or while
torch.compile traces, they are functional collectives: ops that return their output, which the
checkpoint policy can keep instead of exchanging again in backward, and which compile traces. Otherwise
they are torch.distributed's synchronous collectives, which NCCL launches on the current stream; the
functional ones run on the process group's own stream, joined back with events and stashed inputs,
which made the exchange slower in the EP layer bench (docs/benchmarks.md#expert-parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def _functional() -> bool:
    # is_compiling first: dynamo folds it to True and never traces the dispatch-stack query.
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def all_to_all(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
    x = x.contiguous()
    if _functional():
        return funcol.wait_tensor(funcol.all_to_all_single(x, out_splits, in_splits, group))
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if _functional():
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    if _functional():
        return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def reduce_scatter_sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    if _functional():
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, group))
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out
