"""CUDA-graph capture for the benchmarks: `capture_graph(fn, warmup)` -> a torch.cuda.CUDAGraph of fn."""

from __future__ import annotations

import torch


def capture_graph(fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph, after `warmup` calls (compiling, autotuning) on a side stream, as
    capture wants. Raises RuntimeError where fn syncs with the host."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
