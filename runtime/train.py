"""The training loop: build (model, optimizer, schedule, data) from a Config, then step.

One optimizer step = `grad_accum_steps` micro-batches per data rank, computed by runtime.step (the loss
normalized over the global step's label tokens, so the distributed run equals one process's). A step is
queued without host reads; the loop reads step N's numbers once step N+1 is queued, so the host prepares the
next step while the device computes this one. Before an evaluation, a checkpoint or the end, the step under
way is read first.

A step is skipped (no update, counted, logged with `"skipped"`) when its global batch holds no label
token, or when its loss or grad norm is not finite and `train.nan_policy: skip`; with `stop` (the
default), or after `train.max_nan_skips` non-finite steps in a row, the run ends with TrainingDiverged
naming the step and the last good (finite) checkpoint. The optimizer never applies a non-finite gradient.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.backends import kernel_warm_up
from runtime.checkpoint import CheckpointManager, NonFiniteParameters, check_same_model, model_changes
from runtime.config import Config
from runtime.data.chat import load_tokenizer
from runtime.data.loader import build_dataloader, eval_batches
from runtime.distributed.mesh import Meshes, ParallelDims
from runtime.distributed.parallelize import parallelize
from runtime.distributed.process_group import DistEnv, all_reduce_sum
from runtime.evaluation import evaluate
from runtime.graph_step import GraphedSteps
from runtime.guard.failures import Progress
from runtime.guard.run_dir import (
    CONFIG_FILE,
    RunDir,
    RunDirError,
    claim_run_dir,
    finished_checkpoints,
    read_run_config,
    release_run_dir,
    write_run_config,
)
from runtime.models.factory import build_model
from runtime.observe.gc_schedule import scheduled_gc
from runtime.observe.metrics import (
    MetricsLogger,
    RecompileCounter,
    StepTimer,
    device_peak_flops,
    flops_per_token,
    peak_memory_gib,
)
from runtime.observe.profiling import StepProfiler
from runtime.observe.slow_step import SlowStepNotice
from runtime.observe.trackers import Trackers
from runtime.optim import build_optimizer
from runtime.plan import Plan
from runtime.plan import plan as make_plan
from runtime.step import LaunchedStep, StepResult, settle, train_step

log = logging.getLogger("runtime")


class TrainingDiverged(RuntimeError):
    """A non-finite loss or grad norm; the message names the step and the last good checkpoint."""


class StepGuard:
    """Applies train.nan_policy to step results and counts the skipped steps."""

    def __init__(self, policy: str, max_in_a_row: int):
        self.policy, self.max_in_a_row = policy, max_in_a_row
        self.in_a_row = 0
        self.counts = {"no_labels": 0, "non_finite": 0}

    def check(self, step: int, result: StepResult, last_good: str) -> None:
        if result.skipped is None:
            self.in_a_row = 0
            return
        self.counts[result.skipped] += 1
        if result.skipped == "no_labels":
            log.warning("step %d skipped: its global batch holds no label tokens (%d such steps so far)",
                        step, self.counts["no_labels"])
            return
        self.in_a_row += 1
        what = f"loss {result.loss:.4g}, grad norm {result.grad_norm:.4g} at step {step}"
        if self.policy == "stop":
            raise TrainingDiverged(f"{what}: the update was not applied; last good checkpoint: {last_good}; "
                                   "lower optim.lr or check the data of this step, or set train.nan_policy: skip")
        if self.in_a_row >= self.max_in_a_row:
            raise TrainingDiverged(f"{what}: {self.in_a_row} non-finite steps in a row (train.max_nan_skips="
                                   f"{self.max_in_a_row}); last good checkpoint: {last_good}; lower optim.lr")
        log.warning("%s: update skipped (train.nan_policy: skip; %d in a row, %d in all)", what, self.in_a_row,
                    self.counts["non_finite"])


def claim(cfg: Config, env: DistEnv, resume: bool) -> RunDir:
    """claim_run_dir on every rank; rank 0's lock failure becomes every rank's error, so none goes on
    into collectives alone."""
    error = None
    try:
        run_dir = claim_run_dir(cfg.train.output_dir, resume, env.rank)
    except RunDirError as err:
        error = err
    if all_reduce_sum(error is not None, env):
        raise error or RunDirError(f"output dir {cfg.train.output_dir} cannot be claimed (rank 0 says why)")
    return run_dir


def check_resumed_model(cfg: Config, run_dir: RunDir) -> None:
    """Every rank, before the run folder's config.yaml is rewritten: a resume whose config defines another
    model than the one its checkpoints hold is refused (ResumeError), or with
    checkpoint.resume_allow_model_change logged as intended."""
    if not finished_checkpoints(run_dir.root) or not (run_dir.root / CONFIG_FILE).is_file():
        return
    saved, new = read_run_config(run_dir.root), cfg.model_dump(mode="json")
    if not cfg.checkpoint.resume_allow_model_change:
        check_same_model(run_dir.root, saved, new)
    elif changes := model_changes(saved, new):
        log.warning("resuming with another model definition (checkpoint.resume_allow_model_change): %s",
                    "; ".join(changes))


def train(cfg: Config, env: DistEnv, dims: ParallelDims, meshes: Meshes | None = None,
          resume: bool = False, on_grads=None, progress: Progress | None = None, autocast: bool = True,
          plan: Plan | None = None) -> list[dict]:
    """Runs cfg.train.max_steps optimizer steps; returns the per-step metric records (every rank).
    `plan`: runtime.plan's for cfg (launch makes it before any process group), made here when not given;
    everything is built from plan.config, whose implementation names are concrete.
    `on_grads(model)` runs after each step's backward, before clipping (runtime.verify uses it);
    `autocast=False` computes in the parameters' dtype on CUDA too (verify's fp32 reference);
    `progress` is kept up to date with the step, for the failure report (runtime.guard.failures)."""
    progress = progress or Progress()
    plan = plan or make_plan(cfg, env.world_size, env.device)
    resume = resume or cfg.checkpoint.resume
    run_dir = claim(cfg, env, resume)
    try:
        return _train(plan, env, dims, meshes, run_dir, resume, on_grads, progress, autocast)
    finally:
        release_run_dir(run_dir)


def _train(plan: Plan, env: DistEnv, dims: ParallelDims, meshes: Meshes | None, run_dir: RunDir,
           resume: bool, on_grads, progress: Progress, autocast: bool) -> list[dict]:
    cfg = plan.config
    torch.manual_seed(cfg.train.seed)
    if resume:
        check_resumed_model(cfg, run_dir)
    if env.is_main:  # what the user wrote, and beside it what the plan resolved
        write_run_config(run_dir.root, plan.user_config.model_dump(mode="json"))
        plan.write(run_dir.root)
    model = build_model(cfg, env, dims)
    parallelize(model, dims, meshes, cfg, autocast)
    optimizer, scheduler = build_optimizer(model, cfg, env.device)
    # runtime.verify's runs (on_grads, fp32) read each step's gradients: they step eagerly
    graphed = (GraphedSteps(model, optimizer, cfg, env) if cfg.train.graph_step and on_grads is None and autocast
               else None)
    tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.model.path)
    loader = build_dataloader(cfg.data, tokenizer, cfg.train.micro_batch_size,
                              dp_rank=dims.dp_rank(env.rank), dp_world=dims.dp_world)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep_last, env, ep=dims.ep)
    start, last_good = 0, "none (no checkpoint was saved yet)"
    progress.step = 1
    if resume:
        latest = ckpt.latest()
        if latest is None:
            log.warning("resume requested but %s holds no checkpoint: starting from step 0", ckpt.root)
        else:
            start = ckpt.load(latest, model, optimizer, scheduler, loader)
            progress.step = start + 1
            last_good = str(latest)  # load() checked its parameters finite
            log.info("resumed from %s (step %d)", latest, start)
    peak = device_peak_flops(env.device)
    flops_tok = flops_per_token(model.config, cfg.data.seq_len)
    eval_data = (eval_batches(cfg.data, tokenizer, cfg.train.micro_batch_size, loader.held_out,
                              dims.dp_rank(env.rank), dims.dp_world) if cfg.data.has_eval else None)
    trackers = Trackers.start(cfg, run_dir.run_id, mesh_summary(dims), env.is_main)
    metrics = MetricsLogger(cfg.train.output_dir, cfg.train.max_steps, env.is_main, cfg.logging.progress_bar,
                            cfg.logging.jsonl, cfg.logging.every_n_steps, start_step=start, run_id=run_dir.run_id,
                            trackers=trackers)
    guard = StepGuard(cfg.train.nan_policy, cfg.train.max_nan_skips)
    profiler = StepProfiler(cfg.profiling.steps, cfg.profiling.top, cfg.train.output_dir, env.rank, env.device)
    records, timer, recompiles = [], StepTimer(), RecompileCounter()
    world_group = dist.group.WORLD if env.world_size > 1 else None

    def warm_up(first: bool):
        """The first step makes the kernels' timed choices, agreed over every rank (moe.backends.kernel_warm_up)."""
        return kernel_warm_up(world_group) if first else nullcontext()

    def finish(queued: QueuedStep) -> None:
        """Reads a queued step's numbers (waiting for its end; computed again first if it dropped expert slots:
        runtime.step.settle), then judges, records and logs it."""
        settle(queued.launched, model, optimizer, cfg, env, autocast)
        result = queued.launched.result()
        guard.check(queued.step, result, last_good)
        log_step(queued, result)

    def log_step(queued: QueuedStep, result: StepResult) -> None:
        record = step_record(queued.step, result, queued.lr, timer.lap(queued.launched), dims, env, peak,
                             flops_tok)
        record["recompiles"] = queued.recompiles
        records.append(record)
        metrics.log(record)

    queued = None
    try:
        with scheduled_gc(cfg.train.gc_every_n_steps) as collect_garbage, SlowStepNotice() as notice:
            for step in range(start + 1, cfg.train.max_steps + 1):
                progress.step, progress.training = step, True
                with notice.step(step):
                    batches = [next(loader) for _ in range(cfg.train.grad_accum_steps)]
                    with profiler.step(step), warm_up(step == start + 1):
                        previous = queued.launched if queued is not None else None
                        launched = (graphed.launch(batches, previous) if graphed is not None else
                                    train_step(model, batches, optimizer, cfg, env, on_grads, autocast,
                                               previous=previous))
                    if queued is not None:
                        before, queued = queued, None  # judged from here on: the error path leaves it
                        finish(before)  # the step before, read while this one computes
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                if collect_garbage(step):  # in this step's time: the first step's freeze is warm-up, as its compile
                    launched.ends_now()
                queued = QueuedStep(step, launched, lr, recompiles.after_step(step, warn=env.is_main))
                evaluating = eval_data is not None and (step == cfg.train.max_steps or step % (
                    cfg.train.eval_every_n_steps or cfg.train.max_steps) == 0)
                every = cfg.checkpoint.every_n_steps
                saving = every and step % every == 0 and step < cfg.train.max_steps
                if evaluating or saving or step == cfg.train.max_steps:
                    last, queued = queued, None
                    finish(last)
                if evaluating:
                    metrics.log(evaluate(model, eval_data, env, step))  # in metrics.jsonl and the trackers
                if saving:
                    last_good = str(save_checkpoint(ckpt, step, model, optimizer, scheduler, loader, last_good))
                if evaluating or saving:
                    timer.reset()  # eval and checkpoint time is not the next step's (its step_s and tok_s)
        if cfg.checkpoint.save_final:
            save_checkpoint(ckpt, cfg.train.max_steps, model, optimizer, scheduler, loader, last_good)
        if cfg.checkpoint.export_hf:
            from runtime.export import export_final

            export_final(model, cfg, env.rank, meshes)
        if cfg.checkpoint.export_merged:
            from runtime.export import export_merged

            export_merged(model, cfg, env.rank, meshes)
        if any(guard.counts.values()):
            log.info("skipped steps: %d without label tokens, %d non-finite", guard.counts["no_labels"],
                     guard.counts["non_finite"])
    except BaseException:
        # The step launched before the error, not yet read: its line, where the numbers are there without
        # waiting (a device stopped in a collective would hold the read) and complete (nothing to compute again).
        # A step finish() took up (a diverged one the guard refused) is no longer here.
        if queued is not None and queued.launched.ready() and not queued.launched.dropped():
            log_step(queued, queued.launched.result())
        raise
    finally:
        metrics.close()
        recompiles.close()
    return records


@dataclass
class QueuedStep:
    """A step launched and not yet read, with what the loop knew of it at launch."""

    step: int
    launched: LaunchedStep
    lr: float
    recompiles: int


def mesh_summary(dims: ParallelDims) -> dict:
    """The resolved mesh, as the trackers record it once."""
    return {"world_size": dims.world_size, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
            "cp": dims.cp, "ep": dims.ep, "efsdp": dims.efsdp}


def step_record(step: int, result: StepResult, lr: float, elapsed: float, dims: ParallelDims, env: DistEnv,
                peak: float | None, flops_tok: float) -> dict:
    tokens = result.num_tokens * dims.dp_world
    record = {"step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
              "tok_s": tokens / elapsed, "step_s": elapsed}
    if result.skipped:
        record["skipped"] = result.skipped
    if result.ep_load is not None:
        record["ep_imbalance"] = result.ep_load.imbalance
        if result.ep_load.host_skew_s is not None:  # a dispatcher without host waits has no skew
            record.update(ep_host_skew_s=result.ep_load.host_skew_s, ep_slowest_host=result.ep_load.slowest_host)
    if peak:
        record["mfu"] = flops_tok * tokens / elapsed / (peak * env.world_size)
    if (mem := peak_memory_gib(env.device)) is not None:
        record["peak_mem_gib"] = mem
    return record


def save_checkpoint(ckpt: CheckpointManager, step: int, model, optimizer, scheduler, loader, last_good: str):
    try:
        return ckpt.save(step, model, optimizer, scheduler, loader)
    except NonFiniteParameters as err:
        raise TrainingDiverged(f"{err}; last good checkpoint: {last_good}") from None
