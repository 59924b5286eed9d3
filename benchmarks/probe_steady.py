"""Why back-to-back timings of the expert layer exceed its kernel sum: the GPU's clocks under sustained load.

    python benchmarks/probe_steady.py

Qwen3-30B-A3B shapes, T=8192, scattermoe, full and LoRA r=16. For each mode: the mean ms per fwd+bwd of
n calls issued back to back (n = 3, 10, 30, 100, then 10 again) with the SM clock read right after;
10 steps under the profiler (kernel span and kernel sum per step); the layer captured
in one CUDA graph replayed 10 and 100 times back to back (GPU time alone, no host); then the graph replayed
for ~2 s while a thread samples NVML every 20 ms: SM clock, power draw against the enforced limit,
temperature, and which clock-limiting reasons the driver reports (why the clocks drop under load).
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_experts import (
    fwd_bwd_step,
    kernel_sum_and_span,
    make_case,
    profiled_kernels,
    sm_clock_mhz,
    steady_time_ms,
)
from benchmarks.cuda_graphs import capture_graph


def profiled_steps(step, n: int = 10) -> str:
    busy, span = kernel_sum_and_span(profiled_kernels(step, n))
    return f"span {span / n:.3f} ms/step, kernel sum {busy / n:.3f}"


# NVML's clocks-event reason bits (nvmlClocksEventReason*).
_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
            0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
            0x100: "display_clocks"}


def nvml_during(fn, seconds: float = 2.0, every_s: float = 0.02) -> str:
    """Runs fn repeatedly for ~`seconds` while a thread samples NVML; what the driver said about the clocks."""
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
    reasons = collections.Counter(name for *_, bits in samples for bit, name in _REASONS.items() if bits & bit)
    clocks, watts, temps = ([s[i] for s in samples] for i in range(3))
    limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    default = pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1e3
    max_sm = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
    return (f"{len(samples)} samples: SM clock min/median/max {min(clocks)}/{statistics.median(clocks):.0f}/"
            f"{max(clocks)} MHz (max {max_sm}); power median/max {statistics.median(watts):.0f}/{max(watts):.0f} W, "
            f"enforced limit {limit:.0f} W (default {default:.0f}); temperature max {max(temps)} C; reasons "
            + (", ".join(f"{name} {100 * n / len(samples):.0f}%" for name, n in reasons.most_common()) or "none"))


def main() -> None:
    for mode in ("full", "lora16"):
        ex, x, ids, w, _ = make_case("qwen3-30b-a3b", 8192, mode, ep=1)
        step = fwd_bwd_step("scattermoe", ex, x, ids, w)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        for n in (3, 10, 30, 100, 10):
            print(f"== {mode} steady n={n}: {steady_time_ms(step, n, warmup=1):.3f} ms/step, SM clock after "
                  f"{sm_clock_mhz()} MHz", flush=True)
        print(f"== {mode} profiled 10 steps: {profiled_steps(step)}", flush=True)
        graph = capture_graph(step)
        for n in (10, 100):
            ms = steady_time_ms(graph.replay, n, warmup=2)
            print(f"== {mode} graph replays back to back n={n}: {ms:.3f} ms/step, "
                  f"SM clock after {sm_clock_mhz()} MHz", flush=True)
        print(f"== {mode} graph replayed ~2 s, NVML: {nvml_during(graph.replay)}", flush=True)
        del graph, step, ex, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
