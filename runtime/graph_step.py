"""The training step's device work replayed from CUDA graphs (`train.graph_step`).

A step whose host work outlasts its GPU work leaves the GPU waiting on launches: LoRA under EP (docs/
benchmarks.md, "the whole step in one CUDA graph"). Here a step's forward, backward and update
(runtime.step.forward_backward and apply_update) are captured once per shape bucket and replayed: the host
then copies the batch in, sets the learning rates and replays.

Shapes. A packed row's document count, longest document and label count change every step; a graph holds
them fixed, so `static_batch` rounds them up: the documents to a power of two (cu_seqlens padded with empty
documents; rows of one document each stay as they are, cuDNN's branch), the longest document to a power of
two (the varlen kernel's bound), the loss's rows to a multiple of LABEL_BUCKET (runtime.loss: the rows past
the count add nothing). The label count the loss divides by stays the true one, a device scalar copied in
before each replay. Every rank pads to the buckets of the largest rank (one all-reduce on a gloo group: no
device sync), so all ranks capture and replay alike and their collectives stay matched.

Per bucket: the first time, a forward and backward of the padded batch on a side stream (compiles and tunes
those shapes; discarded), then the capture into a memory pool every graph shares (replays never overlap),
then the replay that is this step. Each later step: its rows and label count are loaded into the graph's
buffers, queued behind the step before; then the step before is settled (runtime.step.settle: the host reads
whether it dropped slots, so its wait follows the loads); then the replay. A step while the optimizer has no
states yet (a run's first, unless resumed) runs eagerly: it creates them, which a capture must not. Past
GRAPH_LIMIT buckets a new one runs eagerly. A grown dispatcher bound (the step before dropped slots:
runtime.step.settle) changes buffers every graph holds: they are dropped.

Contract
    steps = GraphedSteps(model, optimizer, cfg, env)   # after parallelize and build_optimizer
    launched = steps.launch(batches, previous)         # in place of runtime.step.train_step
The capture itself is `capture_step` (torch.cuda.graph); the rest runs anywhere (tests/unit/test_graph_step.py
drives it on the CPU with a stand-in that runs the recorded step at each replay).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from gpu.launch import cdiv
from runtime.config import Config
from runtime.data.packing import Batch
from runtime.distributed.process_group import DistEnv
from runtime.errors import ConfigError
from runtime.step import (
    LaunchedStep,
    apply_update,
    compute_context,
    discard_tallies,
    forward_backward,
    global_label_count,
    launched_step,
    learning_rates,
    settle,
    train_step,
)

log = logging.getLogger("runtime")

LABEL_BUCKET = 1024  # the loss's rows round up to this: at most 1023 extra rows of lm_head per micro-batch
GRAPH_LIMIT = 32  # buckets captured at most; each holds its static batch and its kernels' launch parameters


def _power_of_two_above(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def bucket_of(batch: Batch) -> tuple[int, int, int]:
    """(documents, longest document, loss rows) of `batch` rounded up to its bucket (module docstring)."""
    B, S = batch.input_ids.shape
    docs = batch.cu_seqlens.numel() - 1
    rows = min(B * S, cdiv(batch.num_label_tokens, LABEL_BUCKET) * LABEL_BUCKET)
    if docs == B:  # one document per row: the dense causal branch, shapes already static
        return docs, batch.max_seqlen, rows
    return min(_power_of_two_above(docs), B * S), min(_power_of_two_above(batch.max_seqlen), S), rows


def static_batch(batch: Batch, bucket: tuple[int, int, int]) -> Batch:
    """`batch` padded to `bucket` (at least bucket_of(batch) in every entry): empty documents appended to
    cu_seqlens, max_seqlen and label_bound raised. The tokens, labels and positions are unchanged."""
    docs, longest, rows = bucket
    have = batch.cu_seqlens.numel() - 1
    if docs < have or longest < batch.max_seqlen or rows < batch.num_label_tokens:
        raise ValueError(f"bucket {bucket} is below the batch's ({have}, {batch.max_seqlen}, "
                         f"{batch.num_label_tokens})")
    cu_seqlens = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:].expand(docs - have)])
    return replace(batch, cu_seqlens=cu_seqlens, max_seqlen=longest, label_bound=rows)


def agreed_buckets(batches: list[Batch], group: dist.ProcessGroup | None) -> tuple:
    """Every micro-batch's bucket, the largest over the ranks of `group` (a host-side group: gloo), so every
    rank pads alike and captures and replays the same graph."""
    mine = torch.tensor([entry for b in batches for entry in bucket_of(b)], dtype=torch.int64)
    if group is not None:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    flat = mine.tolist()
    return tuple(tuple(flat[i:i + 3]) for i in range(0, len(flat), 3))


def capture_step(step: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor]:
    """`step` captured in a CUDA graph (nothing runs): (its replay, the tensor `step` returned, which every
    replay rewrites in place). thread_local: NCCL's watchdog thread queries events while this thread captures."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()
    return graph.replay, out


@dataclass
class _Captured:
    replay: Callable[[], None]
    batches: list[Batch]  # the device batches the graph reads, refilled before each replay
    numbers: torch.Tensor  # the step's numbers (runtime.step.LaunchedStep), written by each replay


class GraphedSteps:
    """The step launcher of `train.graph_step` (module docstring)."""

    def __init__(self, model, optimizer, cfg: Config, env: DistEnv):
        check_optimizer(optimizer)
        self.model, self.optimizer, self.cfg, self.env = model, optimizer, cfg, env
        self.compute = compute_context(env, autocast=True)
        self.pool = torch.cuda.graph_pool_handle() if env.device.type == "cuda" else None
        self.graphs: dict[tuple, _Captured | None] = {}
        self.labels = torch.zeros((), dtype=torch.float64, device=env.device)  # this step's global label count
        self.lrs = [torch.zeros((), dtype=torch.float32, device=env.device) for _ in optimizer.param_groups]
        # the bucket agreement travels on the host: a device all-reduce would be read back, a sync per step
        self.host_group = dist.new_group(backend="gloo") if env.world_size > 1 else None
        for group in optimizer.param_groups:  # the step count stays on the device in a replay
            group["capturable"] = env.device.type == "cuda"

    def launch(self, batches: list[Batch], previous: LaunchedStep | None) -> LaunchedStep:
        """Queues one optimizer step over this rank's micro-batches (runtime.step.train_step's contract)."""
        if not self.optimizer.state:  # the first step creates the optimizer's states, outside any graph
            return train_step(self.model, batches, self.optimizer, self.cfg, self.env, previous=previous)
        key = agreed_buckets(batches, self.host_group)
        padded = [static_batch(b, bucket) for b, bucket in zip(batches, key)]
        captured = self.graphs.get(key)
        if captured is not None:  # queued behind the step before (which read them), while it computes
            self.load(captured, batches, padded)
        # The step before must have counted before this one's update is queued (a replay holds both).
        if previous is not None and settle(previous, self.model, self.optimizer, self.cfg, self.env):
            self.drop("the dispatcher's bound grew")
            captured = None
        if key not in self.graphs and len(self.graphs) < GRAPH_LIMIT:
            # None where it failed: that bucket stays eager. A new graph's buffers already hold this step.
            self.graphs[key] = captured = self.capture(key, padded)
        if captured is None:
            return train_step(self.model, padded, self.optimizer, self.cfg, self.env)
        for lr, group in zip(self.lrs, self.optimizer.param_groups):
            lr.fill_(group["lr"])
        captured.replay()
        return launched_step(self.model, batches, self.optimizer, captured.numbers, None)

    def load(self, captured: _Captured, batches: list[Batch], padded: list[Batch]) -> None:
        """This step's rows and global label count into what `captured` reads."""
        for static, batch in zip(captured.batches, padded):
            _copy_batch(static, batch.to(self.env.device))
        self.labels.copy_(global_label_count(batches, self.model, self.env))

    def capture(self, key: tuple, padded: list[Batch]) -> _Captured | None:
        """The graph of one step at these shapes, or None where a rank could not capture it (logged; the
        bucket then runs eagerly on every rank)."""
        static = [_own_copy(b.to(self.env.device)) for b in padded]
        self.labels.copy_(global_label_count(padded, self.model, self.env))
        self.warm_up(static)

        def step() -> torch.Tensor:
            loss = forward_backward(self.model, static, self.env, self.compute, self.labels)
            return apply_update(self.model, self.optimizer, self.cfg, self.env, loss, self.labels)[0]

        replay = numbers = error = None
        try:
            with learning_rates_from(self.optimizer, self.lrs):
                replay, numbers = capture_step(step, self.pool)
        except RuntimeError as err:
            error = str(err).strip().splitlines()[0][:300]
        if self.everyone_captured(error is None):
            log.info("train.graph_step: captured bucket %s (%d graphs)", key, len(self.graphs) + 1)
            return _Captured(replay, static, numbers)
        log.warning("train.graph_step: bucket %s runs eagerly, a rank could not capture it%s", key,
                    f": {error}" if error else "")
        self.optimizer.zero_grad(set_to_none=True)
        discard_tallies(self.model)
        return None

    def warm_up(self, static: list[Batch]) -> None:
        """A forward and backward of the capture's batch on a side stream (compiles and tunes its shapes; the
        gradients and tallies are dropped), then what eager work cached goes back to the device."""
        if self.env.device.type != "cuda":
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward_backward(self.model, static, self.env, self.compute, self.labels)
            self.optimizer.zero_grad(set_to_none=True)
            discard_tallies(self.model)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def everyone_captured(self, captured: bool) -> bool:
        if self.host_group is None:
            return captured
        flag = torch.tensor([int(captured)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.host_group)
        return bool(flag.item())

    def drop(self, why: str) -> None:
        if self.graphs:
            log.info("train.graph_step: %s; the %d graphs are captured again", why, len(self.graphs))
        self.graphs.clear()


@contextmanager
def learning_rates_from(optimizer, lrs: list[torch.Tensor]):
    """The optimizer's groups read their learning rate from `lrs` (device scalars) for the duration: a captured
    update takes it from there at every replay instead of baking the float in."""
    for group, lr in zip(optimizer.param_groups, lrs):
        lr.fill_(group["lr"])
    with learning_rates(optimizer, lrs):
        yield


_BATCH_TENSORS = ("input_ids", "labels", "position_ids", "cu_seqlens")


def _own_copy(batch: Batch) -> Batch:
    """`batch` in tensors of its own: the loads into a graph's batch must not write into the batch a step to be
    computed again holds (Batch.to keeps the tensors already on the device)."""
    return replace(batch, **{name: getattr(batch, name).clone() for name in _BATCH_TENSORS})


def _copy_batch(static: Batch, batch: Batch) -> None:
    for name in _BATCH_TENSORS:
        getattr(static, name).copy_(getattr(batch, name), non_blocking=True)


def check_optimizer(optimizer) -> None:
    """Refuses an optimizer other than torch's fused AdamW, on every rank alike (the config's needs, the layout's
    FSDP units included: runtime.plan.check_graph_step)."""
    if not optimizer.defaults.get("fused"):
        raise ConfigError("train.graph_step needs torch's fused AdamW (optim.master_dtype: fp32 on CUDA); "
                          "set optim.master_dtype: fp32 or train.graph_step: false")
