"""One optimizer step, launched without reading the device on the host.

Contract
    launched = train_step(model, batches, optimizer, cfg, env, previous=before)  # queues the whole step's work
    settle(launched, model, optimizer, cfg, env)   # the last step of a run, before reading it (see below)
    result = launched.result()                     # waits for that step's end only; a StepResult

The loss of every micro-batch is its summed token cross-entropy divided by the label-token count of the whole
global step (every micro-batch of every data rank), so distributed gradients equal one process's.

Why no host reads: a host that waits for the device (a loss's .item(), a norm compared on the host, a
pageable batch copy) cannot queue the next work meanwhile, so the device idles while the host launches. Here
the label count travels to the device (and over the ranks) as a tensor; the clip factor and the decision to
skip a step stay on the device and reach the optimizer as its grad_scale / found_inf (runtime.optim); the
step's numbers are copied to pinned host memory behind an event. The training loop reads step N while step
N+1 is queued.

A dispatcher that bounds its buffers (parallelism.gather_capacity) may drop slots; such a step must not
count. Its update is skipped on the device, and the next step, once its own forward and backward are queued,
reads the count of the step before (long finished by then): when slots were dropped it raises the bound,
computes that step again (at once, reading its count until nothing drops), then its own forward and backward
again, from the parameters the redone update left; the order of updates is the single process's. The loop
settles the last step the same way before it reads it. With `on_grads` (runtime.verify) every step reads its
count at once instead, so the hook sees each step's gradients once.

A step is skipped (no update, the router biases kept) when its global batch holds no label token, or when
its loss or grad norm is not finite; the reason reaches the host with the numbers (StepResult.skipped).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from gpu.device import to_device_async
from moe.dispatch import LoadReading
from moe.dispatch.load import DeviceLoadLog
from runtime.config import Config
from runtime.distributed.expert_parallel import moe_dispatcher
from runtime.distributed.fsdp import total_grad_norm
from runtime.distributed.process_group import DistEnv
from runtime.optim import optimizer_step

log = logging.getLogger("runtime")

# the step's skip code on the device; 0: applied. 3 (slots dropped) never reaches a result: settle redoes the step
SKIP_REASONS = {1: "no_labels", 2: "non_finite"}
DROPPED = 3


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    skipped: str | None = None  # "no_labels" | "non_finite": the optimizer did not step
    ep_load: LoadReading | None = None  # routing imbalance and host skew of the EP exchanges (moe/dispatch/load.py)


@dataclass
class Redo:
    """What computing a step again takes: its micro-batches and the optimizer's learning rates at its launch."""

    batches: list
    lrs: list[float]


@dataclass
class LaunchedStep:
    """A step whose work is queued: its numbers arrive in `numbers` (host) once `done` has passed."""

    num_tokens: int
    numbers: torch.Tensor  # [loss, grad norm, skip code, EP imbalance sum, EP dispatches, dropped slots] (float64)
    done: torch.cuda.Event | None  # None: the numbers are already there (a CPU step)
    host_load: LoadReading | None  # a host-side load log's reading (an exchange that syncs anyway)
    redo: Redo | None = None  # under a bounded dispatcher: to compute the step again, should it drop slots
    launched_at: float = field(default_factory=time.perf_counter)  # when its work was queued (done, on the CPU)

    def ends_now(self) -> None:
        """Moves the step's end (its step_s, StepTimer) to now: host work after its launch that is its own (the
        collection after it), so the device's wait for that work is not counted in the next step."""
        self.launched_at = time.perf_counter()
        if self.done is not None:
            self.done.record()

    def ready(self) -> bool:
        """Whether the numbers are there (reading them would not wait)."""
        return self.done is None or self.done.query()

    def read(self) -> list[float]:
        if self.done is not None:
            self.done.synchronize()
        return self.numbers.tolist()

    def dropped(self) -> int:
        """Expert slots the step dropped over every rank (no read without a bound: none can drop)."""
        return int(self.read()[5]) if self.redo is not None else 0

    def become(self, redone: LaunchedStep) -> None:
        """Takes the place of the step computed again, for whoever holds this one."""
        vars(self).update(vars(redone))

    def result(self) -> StepResult:
        loss, grad_norm, code, imbalance_sum, dispatches, _ = self.read()
        if code == DROPPED:
            raise RuntimeError("a step that dropped expert slots was read before settle() computed it again")
        load = self.host_load or (LoadReading(imbalance_sum / dispatches, None, None) if dispatches else None)
        skipped = SKIP_REASONS.get(int(code))
        if skipped == "no_labels":  # no token to average over: the loss and its gradients mean nothing
            loss = grad_norm = float("nan")
        return StepResult(loss, grad_norm, self.num_tokens, skipped, load)


def train_step(model, batches: list, optimizer, cfg: Config, env: DistEnv, on_grads=None, autocast: bool = True,
               previous: LaunchedStep | None = None) -> LaunchedStep:
    """Queues one optimizer step over `batches` (this data rank's micro-batches); every rank calls it alike.
    `previous`: the step launched before, settled here (module docstring)."""
    compute = compute_context(env, autocast)
    labels = global_label_count(batches, model, env)
    if on_grads is not None:
        loss = fitting_forward_backward(model, batches, optimizer, env, compute, labels)
        on_grads(model)
    else:
        loss = forward_backward(model, batches, env, compute, labels)
        if previous is not None and settle(previous, model, optimizer, cfg, env, autocast):
            # this step's gradients came from the parameters before the redone update
            loss = forward_backward(model, batches, env, compute, labels)
    return update(model, batches, optimizer, cfg, env, loss, labels)


def compute_context(env: DistEnv, autocast: bool):
    """bf16 autocast on CUDA (unless `autocast=False`: runtime.verify's fp32 reference); nothing elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if autocast and env.device.type == "cuda" else nullcontext()


def settle(launched: LaunchedStep, model, optimizer, cfg: Config, env: DistEnv, autocast: bool = True) -> bool:
    """Computes `launched` again when it dropped slots (a host read of its count; the same on every rank):
    the bound grows until its slots fit, and its update is applied. Gradients and tallies of work queued
    since are dropped. Returns whether it did."""
    dropped = launched.dropped()
    if not dropped:
        return False
    optimizer.zero_grad(set_to_none=True)
    discard_tallies(model)
    grow_bound(model, dropped)
    batches = launched.redo.batches
    labels = global_label_count(batches, model, env)
    loss = fitting_forward_backward(model, batches, optimizer, env, compute_context(env, autocast), labels)
    with learning_rates(optimizer, launched.redo.lrs):
        launched.become(update(model, batches, optimizer, cfg, env, loss, labels))
    return True


@contextmanager
def learning_rates(optimizer, lrs: list[float] | list[torch.Tensor]):
    """The optimizer's groups at `lrs` (a step's own, as the schedule gave them at its launch; or device scalars
    a captured update reads: runtime.graph_step), then back."""
    now = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, now):
            group["lr"] = lr


def fitting_forward_backward(model, batches: list, optimizer, env: DistEnv, compute, labels: torch.Tensor):
    """forward_backward, read back and computed again with a grown bound until no slot is dropped."""
    dispatcher = moe_dispatcher(model)
    while True:
        loss = forward_backward(model, batches, env, compute, labels)
        dropped = take_dropped_slots(dispatcher, env)
        if dropped is None or not (count := int(dropped.item())):
            return loss
        grow_bound(model, count)  # the same micro-batches again, on every rank alike
        optimizer.zero_grad(set_to_none=True)
        discard_tallies(model)


def update(model, batches: list, optimizer, cfg: Config, env: DistEnv, loss: torch.Tensor,
           labels: torch.Tensor) -> LaunchedStep:
    """Queues the step's update after its backward (apply_update), then the copy of its numbers to the host."""
    numbers, host_load = apply_update(model, optimizer, cfg, env, loss, labels)
    return launched_step(model, batches, optimizer, numbers, host_load)


def launched_step(model, batches: list, optimizer, numbers: torch.Tensor,
                  host_load: LoadReading | None) -> LaunchedStep:
    """The LaunchedStep of a step whose work, ending in `numbers` (apply_update's), is queued: the copy of its
    numbers, and under a bounded dispatcher what computing it again takes (its batches, its learning rates)."""
    dispatcher = moe_dispatcher(model)
    bounded = dispatcher is not None and dispatcher.dropped is not None
    redo = Redo(batches, [group["lr"] for group in optimizer.param_groups]) if bounded else None
    return launch_read(sum(b.input_ids.numel() for b in batches), numbers, host_load, redo)


def apply_update(model, optimizer, cfg: Config, env: DistEnv, loss: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, LoadReading | None]:
    """The update's device work: clip factor and skip decided on the device, the optimizer, the router biases.
    Returns the step's numbers (LaunchedStep.numbers, on the device) and a host-side load log's reading. Apart
    from that reading (an exchange whose counts reach the host anyway), nothing here reads the device or copies
    from the host: with the step's forward and backward it can be captured whole in a CUDA graph."""
    dispatcher = moe_dispatcher(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = total_grad_norm(grads, env.world_size).to(loss.device, torch.float64)
    dropped = take_dropped_slots(dispatcher, env)
    dropped = torch.zeros((), device=loss.device, dtype=torch.float64) if dropped is None else dropped.double()
    # Every number is global (all-reduced), so every rank decides alike.
    code = torch.where(labels == 0, 1, torch.where(loss.isfinite() & grad_norm.isfinite(), 0, 2))
    code = torch.where(dropped > 0, DROPPED, code)
    skip = (code != 0).float()
    optimizer_step(optimizer, clip_factor(grad_norm, cfg.optim.grad_clip), skip)
    update_router_biases(model, env, keep=1 - skip)
    optimizer.zero_grad(set_to_none=True)
    load_sums, host_load = take_ep_load(dispatcher, env.device)
    return torch.cat([torch.stack([loss, grad_norm, code.double()]), load_sums, dropped[None]]), host_load


def global_label_count(batches: list, model, env: DistEnv) -> torch.Tensor:
    """The step's label tokens over every data rank, a float64 device scalar (context-parallel ranks of a data
    slice hold the same rows, so their count is divided out). A collective on the device: no host wait."""
    cp = model.context_parallel
    count = to_device_async(torch.tensor(float(sum(b.num_label_tokens for b in batches)), dtype=torch.float64),
                            env.device)
    if env.world_size > 1:
        torch.distributed.all_reduce(count)
    return count / (cp.size if cp is not None else 1)


def forward_backward(model, batches: list, env: DistEnv, compute, labels: torch.Tensor) -> torch.Tensor:
    """Accumulates the gradients of the step's micro-batches (summed over the ranks where parameters are
    replicated without FSDP); returns their summed loss (a float64 device scalar). `labels`: the global label
    count (0 gives a zero loss: global_label_count's step is skipped)."""
    cp = model.context_parallel
    loss_total = torch.zeros((), device=env.device, dtype=torch.float64)
    divisor = labels.clamp_min(1)
    for batch in batches:
        batch = batch.to(env.device)
        if cp is not None:
            batch = cp.shard(batch)  # the one place a batch is split along the sequence
        with compute:
            loss_sum = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                             max_seqlen=batch.max_seqlen, labels=batch.labels,
                             cp=batch.cp if cp is not None else None, num_labels=batch.loss_rows)
            # The router balance losses ride on the MoE outputs' backward (moe.layer._AttachAuxLoss).
            loss = loss_sum / divisor.to(loss_sum.dtype)
        loss.backward()
        loss_total += loss.detach()
    if model.replicated_grads is not None:
        model.replicated_grads.all_reduce()
    if env.world_size > 1:
        torch.distributed.all_reduce(loss_total)
    return loss_total


def clip_factor(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that scales the gradients down to max_norm when their norm exceeds it, else 1 (a device
    scalar); the optimizer applies it inside its update (runtime.optim.optimizer_step). A non-finite norm is
    never clipped: that step is skipped."""
    if max_norm <= 0:
        return torch.ones((), device=grad_norm.device, dtype=torch.float32)
    return torch.where(grad_norm.isfinite() & (grad_norm > max_norm), max_norm / (grad_norm + 1e-6), 1.0).float()


def take_dropped_slots(dispatcher, env: DistEnv) -> torch.Tensor | None:
    """The expert slots a dispatcher's bound on the backends' buffers (parallelism.gather_capacity) dropped on
    every rank since the last call (a device int64, all-reduced), its counter zeroed; None without a bound."""
    if dispatcher is None or dispatcher.dropped is None:
        return None
    dropped = dispatcher.dropped.clone()
    dispatcher.dropped.zero_()
    if env.world_size > 1:
        torch.distributed.all_reduce(dropped)
    return dropped


def discard_tallies(model) -> None:
    """Forgets what the MoE layers counted during work that will not count (a step computed again): the
    routers' expert counts, the EP load log's sums, the dropped slots."""
    for block in model.moe_blocks():
        if block.gate.bias_update_rate > 0:  # only a biased router counts
            block.gate.take_counts()
    dispatcher = moe_dispatcher(model)
    if dispatcher is not None and isinstance(dispatcher.loads, DeviceLoadLog):
        dispatcher.loads.take()
    if dispatcher is not None and dispatcher.dropped is not None:
        dispatcher.dropped.zero_()


def grow_bound(model, dropped: int) -> None:
    """Raises the bound after `dropped` slots (summed over the ranks) did not fit, with one warning."""
    capacity = moe_dispatcher(model).grow()
    log.warning("parallelism.gather_capacity: %d expert slots did not fit the bound; computing the step again "
                "at capacity %.3g (set parallelism.gather_capacity: %.3g to start there)", dropped, capacity, capacity)


def update_router_biases(model, env: DistEnv, keep: torch.Tensor) -> None:
    """Aux-loss-free balancing (model.router_bias_update_rate): every biased router's bias moves by the
    step's global expert counts, all layers' summed over the ranks in one all-reduce. `keep` (a device 0/1)
    is 0 for a skipped step: its counts move nothing."""
    routers = [block.gate for block in model.moe_blocks() if block.gate.bias_update_rate > 0]
    if not routers:
        return
    counts_LE = torch.stack([router.take_counts() for router in routers])
    if env.world_size > 1:
        torch.distributed.all_reduce(counts_LE)  # every rank's tokens: data, context and EP shards alike
    for router, counts_E in zip(routers, counts_LE):
        router.update_bias(counts_E, keep)


def take_ep_load(dispatcher, device: torch.device) -> tuple[torch.Tensor, LoadReading | None]:
    """The EP load since the last call: ([imbalance sum, dispatches] on the device, None) from a device log,
    or (zeros, its reading) from a host log, whose exchange reads the host anyway (None without EP)."""
    if dispatcher is not None and isinstance(dispatcher.loads, DeviceLoadLog):
        return dispatcher.loads.take().to(device), None
    host_load = None if dispatcher is None else dispatcher.load_reading(device)
    return torch.zeros(2, device=device, dtype=torch.float64), host_load


def launch_read(num_tokens: int, numbers: torch.Tensor, host_load: LoadReading | None,
                redo: Redo | None) -> LaunchedStep:
    """Queues the copy of the step's numbers to the host behind the step's work (a snapshot: a replayed graph
    rewrites its numbers tensor in place)."""
    if numbers.device.type != "cuda":
        return LaunchedStep(num_tokens, numbers.clone(), None, host_load, redo)
    host = torch.empty(numbers.shape, dtype=numbers.dtype, pin_memory=True)
    host.copy_(numbers, non_blocking=True)
    done = torch.cuda.Event(enable_timing=True)  # also the step's end on the device, for its step_s (StepTimer)
    done.record()
    return LaunchedStep(num_tokens, host, done, host_load, redo)
