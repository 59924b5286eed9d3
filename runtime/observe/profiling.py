"""Traces chosen optimizer steps with torch.profiler (config section `profiling`).

    profiler = StepProfiler(cfg.profiling.steps, cfg.profiling.top, output_dir, rank, device)
    with profiler.step(step):          # a no-op for steps not in profiling.steps
        train_step(...)

For every traced step, every rank writes under <output_dir>/profile/:
    step{N}_rank{R}.json.gz   a Chrome trace (chrome://tracing, Perfetto)
    step{N}_rank{R}.txt       the summary line, on a GPU where the compute stream waited (runtime.timeline), then
                              the top ops by device self time (CPU self time off CUDA)
and rank 0 logs the summary line: the step's wall time, the time the device spent in kernels (a share of the
wall, summed over streams: a low share means the step waits on the host or on other ranks), and the host
syncs (stream and device synchronizations: `.item()`, `.tolist()` of device tensors), where an expert-parallel
step blocks on each layer's token exchange sizes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from runtime.observe import timeline

log = logging.getLogger("runtime")

# CUDA runtime calls that block the host until the device catches up: a device-to-host copy (`.item()`,
# `.tolist()`) is an async copy and a stream synchronization, so it counts once, by the latter. Not counted:
# cudaMemcpyAsync alone (host-to-device and device-to-device copies do not wait), `.item()` of CPU tensors.
HOST_SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})


class StepProfiler:
    def __init__(self, steps: list[int], top: int, output_dir: str | Path, rank: int, device: torch.device):
        self.steps, self.top, self.rank, self.device = set(steps), top, rank, device
        self.folder = Path(output_dir) / "profile"

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step not in self.steps:
            yield
            return
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            yield
            if cuda:
                torch.cuda.synchronize(self.device)
            wall_ms = (time.perf_counter() - start) * 1e3
        self._write(prof, step, wall_ms, cuda)

    def _write(self, prof, step: int, wall_ms: float, cuda: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"step{step}_rank{self.rank}"
        averages = prof.key_averages()  # seconds on a big step's trace: once
        line = summary_line(averages, step, wall_ms, cuda)
        sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = averages.table(sort_by=sort_by, row_limit=self.top)
        trace = f"{stem}.json.gz"
        prof.export_chrome_trace(trace)  # torch compresses a .gz path itself
        gaps = timeline.analyze(timeline.load_events(trace)).lines() if cuda else []
        head = "\n".join([line, *gaps])
        stem.with_suffix(".txt").write_text(f"{head}\n\n{table}\n")
        if self.rank == 0:
            log.info("%s (rank 0; every rank's trace and top ops in %s)", head, self.folder)


def summary_line(averages, step: int, wall_ms: float, cuda: bool) -> str:
    """One line: wall, device kernel time and its share, host syncs (count, CPU ms)."""
    syncs = [a for a in averages if a.key in HOST_SYNC_CALLS]
    sync_count = sum(a.count for a in syncs)
    sync_ms = sum(a.cpu_time_total for a in syncs) / 1e3
    parts = [f"profile step {step}: wall {wall_ms:.1f} ms"]
    if cuda:
        # the device's own events, as torch's table totals them: a CPU op's device time is its kernels' again
        kernel_ms = sum(a.self_device_time_total for a in averages
                        if a.device_type == DeviceType.CUDA and not a.is_user_annotation) / 1e3
        parts.append(f"device kernels {kernel_ms:.1f} ms ({kernel_ms / wall_ms:.0%} of wall)")
    parts.append(f"host syncs {sync_count} ({sync_ms:.1f} ms CPU)")
    return ", ".join(parts)
