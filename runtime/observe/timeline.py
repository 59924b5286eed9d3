"""Where a traced step's compute stream waits: the idle gaps of a torch.profiler Chrome trace, split into time
a collective was running (waiting on another rank or on the exchange) and time nothing ran on the device
(waiting on the host: launches, syncs), with the ops whose launches ended the host gaps, each after the
region around it (an FSDP hook, an autograd node: `FSDP::post_backward_reduce (model.layers.N.mlp.experts) >
aten::copy_`), layer numbers folded so a hook's gaps in every layer add up.

    python -m runtime.timeline RUN/profile/step6_rank0.json.gz [--min-gap-us 5] [--top 12]
    python -m runtime.timeline --skew RUN/profile/step6_rank*.json.gz

The compute stream is the stream with the most non-collective kernel time. runtime.observe.profiling prints this
summary beside its own for every traced step on a GPU. `--skew` takes the traces of one step on every rank of
one host (one clock): a collective's kernel starts when its rank reaches it and ends when all have, so the
ranks' start times of the same collective say who waited for whom.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def _is_collective(name: str) -> bool:
    return "nccl" in name.lower()


@dataclass
class Timeline:
    window_ms: float            # first device event's start to the last one's end
    busy_ms: float              # the compute stream's events, overlaps merged
    comm_ms: float              # collectives on any stream, overlaps merged
    gaps: int                   # idle gaps of the compute stream at least min_gap_us long
    gap_comm_ms: float          # of the gaps' time: a collective was running
    gap_other_ms: float         # of the gaps' time: other streams' work only (copies, FSDP's casts)
    gap_host_ms: float          # of the gaps' time: nothing ran on the device
    host_gap_ops: list[tuple[str, float, int]] = field(default_factory=list)  # (op, ms, gaps) by ms

    def lines(self) -> list[str]:
        head = (f"compute stream busy {self.busy_ms:.1f} of {self.window_ms:.1f} ms; idle gaps {self.gaps}: "
                f"{self.gap_comm_ms:.1f} ms while collectives ran, {self.gap_other_ms:.1f} ms other streams only, "
                f"{self.gap_host_ms:.1f} ms with nothing on the device (host); collectives {self.comm_ms:.1f} ms")
        ops = [f"  after host gaps, launched by {op}: {ms:.2f} ms in {n}" for op, ms, n in self.host_gap_ops]
        return [head, *ops]


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(start: float, end: float, merged: list[tuple[float, float]], starts: list[float]) -> float:
    """Length of [start, end) covered by the sorted, disjoint intervals `merged` (starts: their starts)."""
    total = 0.0
    i = max(bisect.bisect_right(starts, start) - 1, 0)
    while i < len(merged) and merged[i][0] < end:
        total += max(0.0, min(end, merged[i][1]) - max(start, merged[i][0]))
        i += 1
    return total


def _is_region(event: dict) -> bool:
    """A record_function region (FSDP's hooks, nccl:*) or an autograd node: what names a launch's context."""
    return event.get("cat") == "user_annotation" or event["name"].startswith("autograd::engine::evaluate_function")


class _Launchers:
    """The CPU op around each kernel launch (runtime API launches, and driver API ones: Triton's), by the launch's
    correlation id: the innermost op, after the nearest region around it (`_is_region`) when there is one."""

    def __init__(self, events: list[dict]):
        self.runtime = {e["args"]["correlation"]: e for e in events
                        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        by_thread = defaultdict(list)
        for e in events:
            if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e:
                by_thread[e["tid"]].append((e["ts"], -(e["ts"] + e["dur"]), e["name"], _is_region(e)))
        # per thread, sorted by start (enclosing first on ties): (start, end, name, region), each op's parent
        self.ops, self.parent, self.starts = {}, {}, {}
        for tid, ops in by_thread.items():
            ops.sort()
            self.ops[tid] = [(start, -neg_end, name, region) for start, neg_end, name, region in ops]
            self.parent[tid] = _parents(self.ops[tid])
            self.starts[tid] = [op[0] for op in self.ops[tid]]

    def op_of(self, kernel: dict) -> str:
        launch = self.runtime.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "(unknown launch)"
        tid, ts = launch["tid"], launch["ts"]
        ops, parent = self.ops.get(tid, []), self.parent.get(tid, [])
        # ops nest: the innermost op enclosing ts is the last op started before it, or one of its ancestors
        i = bisect.bisect_right(self.starts.get(tid, []), ts) - 1
        while i >= 0 and ops[i][1] < ts:
            i = parent[i]
        if i < 0:
            return "(no CPU op)"
        if ops[i][3]:  # the launch is a region's own (nccl:*): no op inside it
            return _region_label(ops[i][2])
        region = parent[i]
        while region >= 0 and not ops[region][3]:
            region = parent[region]
        return f"{_region_label(ops[region][2])} > {ops[i][2]}" if region >= 0 else ops[i][2]


def _region_label(name: str) -> str:
    """A region's name without what varies by layer: "FSDP::pre_forward (model.layers.N.mlp.experts)", an
    autograd node's class alone."""
    return re.sub(r"\.\d+(?=[.)])", ".N", name.removeprefix("autograd::engine::evaluate_function: "))


def _parents(ops: list[tuple[float, float, str, bool]]) -> list[int]:
    """The index of each op's innermost enclosing op (-1: none), ops sorted by start, enclosing ones first."""
    parent, open_ops = [], []
    for i, (start, _, _, _) in enumerate(ops):
        while open_ops and ops[open_ops[-1]][1] < start:
            open_ops.pop()
        parent.append(open_ops[-1] if open_ops else -1)
        open_ops.append(i)
    return parent


def analyze(events: list[dict], min_gap_us: float = 5.0, top: int = 12) -> Timeline:
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X" and "dur" in e]
    if not device:
        return Timeline(0.0, 0.0, 0.0, 0, 0.0, 0.0, 0.0)
    per_stream = defaultdict(float)
    for e in device:
        if not _is_collective(e["name"]):
            per_stream[e["args"].get("stream")] += e["dur"]
    compute_stream = max(per_stream, key=per_stream.get)
    compute = sorted((e for e in device if e["args"].get("stream") == compute_stream), key=lambda e: e["ts"])
    comm = _merge([(e["ts"], e["ts"] + e["dur"]) for e in device if _is_collective(e["name"])])
    everything = _merge([(e["ts"], e["ts"] + e["dur"]) for e in device])
    comm_starts, all_starts = [s for s, _ in comm], [s for s, _ in everything]
    window = (min(e["ts"] for e in device), max(e["ts"] + e["dur"] for e in device))

    launchers = _Launchers(events)
    busy, gaps, gap_comm, gap_other, gap_host = 0.0, 0, 0.0, 0.0, 0.0
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    covered_until = compute[0]["ts"]
    for e in compute:
        end = e["ts"] + e["dur"]
        busy += max(0.0, end - max(e["ts"], covered_until))
        gap = e["ts"] - covered_until
        if gap >= min_gap_us:
            gaps += 1
            on_comm = _overlap(covered_until, e["ts"], comm, comm_starts)
            on_device = _overlap(covered_until, e["ts"], everything, all_starts)
            gap_comm += on_comm
            gap_other += on_device - on_comm
            idle = gap - on_device
            gap_host += idle
            if idle > 0:
                entry = by_op[launchers.op_of(e)]
                entry[0] += idle
                entry[1] += 1
        covered_until = max(covered_until, end)
    ranked = sorted(by_op.items(), key=lambda item: -item[1][0])[:top]
    return Timeline(window_ms=(window[1] - window[0]) / 1e3, busy_ms=busy / 1e3,
                    comm_ms=sum(e - s for s, e in comm) / 1e3, gaps=gaps, gap_comm_ms=gap_comm / 1e3,
                    gap_other_ms=gap_other / 1e3, gap_host_ms=gap_host / 1e3,
                    host_gap_ops=[(op, ms / 1e3, int(n)) for op, (ms, n) in ranked])


@dataclass
class Skew:
    collectives: int           # collective kernels matched on every rank (by name and occurrence)
    wait_ms: list[float]       # per rank: time its collective kernels ran before the last rank arrived
    last: list[int]            # per rank: collectives it arrived at last

    def lines(self) -> list[str]:
        return [f"{self.collectives} collectives matched on {len(self.wait_ms)} ranks"] + [
            f"  rank {r}: waited {w:.1f} ms for other ranks, arrived last at {n}"
            for r, (w, n) in enumerate(zip(self.wait_ms, self.last))]


def skew(traces: list[list[dict]]) -> Skew:
    """Per rank, how long its collective kernels waited for the last rank to arrive: the k-th kernel of a name
    on every rank is the same collective (each communicator issues its collectives in one order on all
    ranks)."""
    starts = []
    for events in traces:
        by_name = defaultdict(list)
        for e in sorted((e for e in events if e.get("cat") == "kernel" and _is_collective(e.get("name", ""))),
                        key=lambda e: e["ts"]):
            by_name[e["name"]].append(e["ts"])
        starts.append(by_name)
    wait, last, matched = [0.0] * len(traces), [0] * len(traces), 0
    for name in set.intersection(*(set(s) for s in starts)):
        for ts in zip(*(s[name] for s in starts)):
            latest = max(ts)
            matched += 1
            last[ts.index(latest)] += 1
            for r, t in enumerate(ts):
                wait[r] += latest - t
    return Skew(matched, [w / 1e3 for w in wait], last)


def load_events(path: str | Path) -> list[dict]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="+", help="Chrome traces (.json or .json.gz) of runtime.observe.profiling")
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--skew", action="store_true", help="the traces are one step's on every rank, in rank order")
    args = parser.parse_args(argv)
    if args.skew:
        print("\n".join(skew([load_events(path) for path in args.trace]).lines()))
        return
    for path in args.trace:
        print(path)
        print("\n".join(analyze(load_events(path), args.min_gap_us, args.top).lines()))


if __name__ == "__main__":
    main()
