"""What every benchmark shares: timing, device facts, shape presets, result rows.

    from benchmarks.harness import SHAPES, Report, Column, event_times_ms, steady_ms, device_info

Benches time with these functions, take their shapes from SHAPES and record through Report, so numbers
of different benches are taken and written the same way (docs/benchmarks.md quotes them). On a CUDA
device times come from CUDA events; on the CPU (a bench's --dry smoke run) from perf_counter, and
those numbers mean nothing. Nothing here runs on import.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import torch

# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """A model's layer dimensions: experts (E, H, I, top-k; 0 for a dense model) and attention heads."""

    experts: int
    hidden: int
    intermediate: int  # per expert (the MoE intermediate size)
    top_k: int
    q_heads: int
    kv_heads: int
    head_dim: int


SHAPES = {
    "qwen3-30b-a3b": Shape(128, 2048, 768, 8, q_heads=32, kv_heads=4, head_dim=128),
    "qwen3.5-35b-a3b": Shape(256, 2048, 512, 8, q_heads=16, kv_heads=2, head_dim=256),
    "olmoe": Shape(64, 2048, 1024, 8, q_heads=16, kv_heads=16, head_dim=128),
    "mixtral-8x7b": Shape(8, 4096, 14336, 2, q_heads=32, kv_heads=8, head_dim=128),
    "qwen3-14b": Shape(0, 5120, 0, 0, q_heads=40, kv_heads=8, head_dim=128),  # dense: attention only
    "tiny": Shape(8, 64, 32, 2, q_heads=4, kv_heads=2, head_dim=16),  # --dry runs on the CPU
}
MOE_SHAPES = [name for name, s in SHAPES.items() if s.experts and name != "tiny"]


# ----------------------------------------------------------------------------- timing


def _on_cuda() -> bool:
    return torch.cuda.is_available()


def _timed_calls(fn: Callable, iters: int, warmup: int, before: Callable | None,
                 time_ms: Callable[[Callable], float]) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        times.append(time_ms(fn))
    return times


def _wall_ms(fn: Callable) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _event_ms(fn: Callable) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def wall_times_ms(fn: Callable, iters: int, warmup: int, before: Callable | None = None) -> list[float]:
    """perf_counter ms of each of `iters` calls after `warmup` (CPU runs; no device sync)."""
    return _timed_calls(fn, iters, warmup, before, _wall_ms)


def event_times_ms(fn: Callable, iters: int, warmup: int, before: Callable | None = None) -> list[float]:
    """ms of each of `iters` calls between two CUDA events, after `warmup` calls. Each call starts on an
    idle GPU, so the host time before its first kernel is included. `before` runs ahead of each call,
    outside the timed range (an L2 flush, a barrier)."""
    if not _on_cuda():
        return wall_times_ms(fn, iters, warmup, before)
    return _timed_calls(fn, iters, warmup, before, _event_ms)


def median_ms(fn: Callable, iters: int = 10, warmup: int = 3, before: Callable | None = None) -> float:
    return statistics.median(event_times_ms(fn, iters, warmup, before))


def steady_ms(fn: Callable, iters: int, warmup: int = 1) -> float:
    """Mean ms per call of `iters` calls issued back to back with one sync at the end: the host runs
    ahead of the GPU, as inside a training step, so host time shows only where it exceeds GPU time."""
    if not _on_cuda():
        return statistics.mean(wall_times_ms(fn, iters, warmup))
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


def capture_graph(fn: Callable, warmup: int = 3, mode: str = "global") -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph after `warmup` calls (compiling, autotuning) on a side stream, as
    capture wants. Raises RuntimeError where fn syncs with the host. `mode`: torch.cuda.graph's
    capture_error_mode (thread_local where other threads use CUDA meanwhile, as NCCL's watchdog does)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        fn()
    return graph


def graph_times_ms(fn: Callable, iters: int, warmup: int = 3, before: Callable | None = None) -> list[float]:
    """ms of each replay of `fn` captured once in a CUDA graph: the GPU time alone, no host in it."""
    if not _on_cuda():
        return wall_times_ms(fn, iters, warmup)
    graph = capture_graph(fn, warmup)
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    try:
        return event_times_ms(graph.replay, iters, 0, before)
    finally:
        del graph
        torch.cuda.synchronize()


class L2Flush:
    """Called before a timed call: overwrites a buffer larger than any L2 (H100 50 MB, H200 60 MB), so
    the call reads its inputs from HBM as it would in training. A no-op on the CPU."""

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        self.buf = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


# ----------------------------------------------------------------------------- device


def sm_clock_mhz() -> int | None:
    """The SM clock now (NVML). The GPU clocks down under sustained load, so every timing depends on it."""
    if not _on_cuda():
        return None
    try:
        return torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 - no NVML here: the column stays empty
        return None


def device_info() -> dict:
    """Device name, SM count, memory, library versions and the SM clock before the run (an idle GPU's is
    low; rows record the clock they ran at), for a run's JSON and header."""
    info = {"torch": torch.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if _on_cuda():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(device=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, sm_clock_mhz_at_start=sm_clock_mhz())
    else:
        info.update(device="cpu", sms=None, memory_gib=None, cuda=None, sm_clock_mhz_at_start=None)
    return info


# NVML's clocks-event reason bits (nvmlClocksEventReason*).
_CLOCK_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                  0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                  0x100: "display_clocks"}


def clocks_under_load(fn: Callable, seconds: float = 2.0, every_s: float = 0.02) -> str:
    """Runs fn repeatedly for ~`seconds` while a thread samples NVML: SM clock, power against the enforced
    limit, temperature, and the reasons the driver gives for the clocks (why a steady timing is slower)."""
    import collections
    import threading

    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    reasons_of = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons  # the older name
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append((pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                            pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
                            reasons_of(handle)))
            time.sleep(every_s)

    thread = threading.Thread(target=sample)
    thread.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    done.set()
    thread.join()
    reasons = collections.Counter(name for *_, bits in samples
                                  for bit, name in _CLOCK_REASONS.items() if bits & bit)
    clocks, watts, temps = ([s[i] for s in samples] for i in range(3))
    limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    default = pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1e3
    max_sm = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
    return (f"{len(samples)} samples: SM clock min/median/max {min(clocks)}/{statistics.median(clocks):.0f}/"
            f"{max(clocks)} MHz (max {max_sm}); power median/max {statistics.median(watts):.0f}/{max(watts):.0f} W, "
            f"enforced limit {limit:.0f} W (default {default:.0f}); temperature max {max(temps)} C; reasons "
            + (", ".join(f"{name} {100 * n / len(samples):.0f}%" for name, n in reasons.most_common()) or "none"))


def matmul_tflops(n: int = 8192) -> float:
    """bf16 n^3 matmul rate of this device now: the anchor a kernel's TFLOP/s is read against."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / median_ms(lambda: a @ b, iters=20, warmup=5) / 1e9


def copy_gbps(device: torch.device | str = "cuda", nbytes: int = 1 << 30) -> float:
    """Device copy rate (bytes read + written per second): the roofline of memory-bound kernels. Timed
    by events around a direct copy_ (host time is negligible at this size; a copy captured in a CUDA
    graph becomes a memcpy node on the copy engines, ~35% slower on an H200)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=10, warmup=2)
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- profiling


def profiled_kernels(fn: Callable, calls: int) -> list:
    """The CUDA kernel events (torch.profiler) of `calls` calls of fn issued back to back, by start time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)


def kernel_sum_and_span(kernels: list) -> tuple[float, float]:
    """(sum of the kernels' times, first start to last end) in ms, of profiled kernels by start time."""
    total = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    return total, (max(e.time_range.end for e in kernels) - kernels[0].time_range.start) / 1e3


def print_cprofile(fn: Callable, calls: int, sort: str = "tottime", lines: int = 28, prefix: str = "  ") -> None:
    """cProfile of `calls` calls of fn: the top `lines` functions by `sort`."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if _on_cuda():
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(lines)
    for line in out.getvalue().splitlines()[6:]:
        if line.strip():
            print(prefix + line[:170])


# ----------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Column:
    """One column of the printed table: the row's key, its header, and a format spec for its values."""

    key: str
    header: str
    spec: str = ""  # e.g. ".3f"
    width: int = 0  # at least the header's; text is left-aligned, numbers right-aligned


def _as_dict(row) -> dict:
    return asdict(row) if is_dataclass(row) else dict(row)


def fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


class Report:
    """A bench run's rows: each `add` prints one line of the table and rewrites OUT/<name>.json (a run
    cut short keeps what it measured). The JSON holds the device, date and command beside the rows;
    `meta` adds run-level values (anchors, targets). `out=None`: print only."""

    def __init__(self, name: str, columns: list[Column], out: str | None = None, printing: bool = True):
        self.name, self.columns, self.printing = name, columns, printing
        self.path = Path(out) / f"{name}.json" if out else None
        self.rows: list[dict] = []
        self.meta: dict = {}
        self.info = device_info()
        self.command = " ".join(["python -m benchmarks." + Path(sys.argv[0]).stem, *sys.argv[1:]])

    @staticmethod
    def _cell(c: Column, value) -> str:
        width = max(len(c.header), c.width)
        return str(value).ljust(width) if isinstance(value, str) else fmt(value, c.spec).rjust(width)

    def header(self, title: str = "") -> None:
        if not self.printing:
            return
        i = self.info
        print(f"{title}{' ' if title else ''}[{i['device']}, torch {i['torch']}, triton {i['triton']}]")
        print("  ".join(self._cell(c, c.header) for c in self.columns) + "  note", flush=True)

    def add(self, row) -> dict:
        row = _as_dict(row)
        self.rows.append(row)
        if self.printing:
            print("  ".join(self._cell(c, row.get(c.key)) for c in self.columns)
                  + ("  " + row["note"] if row.get("note") else ""), flush=True)
        self.save()
        return row

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"bench": self.name, "date": time.strftime("%Y-%m-%d"), "command": self.command,
                  **self.info, **self.meta, "rows": self.rows}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        os.replace(tmp, self.path)


