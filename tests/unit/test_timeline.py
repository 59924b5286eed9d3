"""runtime.timeline on a hand-built Chrome trace whose gaps are known: a gap covered by a collective on another
stream, a gap with nothing on the device (attributed to the CPU op that launched the next kernel), a gap
covered by another stream's copy, and a gap shorter than the threshold."""

import gzip
import json

import pytest

from runtime.observe import timeline


def _kernel(name, ts, dur, stream, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"stream": stream, "correlation": corr}}


def _launch(ts, corr, tid=1, api="cuda_runtime"):
    return {"ph": "X", "cat": api, "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "pid": 1,
            "tid": tid, "args": {"correlation": corr}}


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _trace():
    # compute stream 7: [0,100) [150,250) [400,500) [520,600) [603,700); stream 9: nccl [100,160), memcpy [500,520)
    return [
        _kernel("gemm_a", 0, 100, 7, 1), _kernel("ncclDevKernel_AllToAll", 100, 60, 9, 2),
        _kernel("gemm_b", 150, 100, 7, 3),      # gap 100..150: all on the collective
        _kernel("gemm_c", 400, 100, 7, 4),      # gap 250..400: nothing ran (host), launched by aten::index_select
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 500, "dur": 20, "pid": 0, "tid": 9,
         "args": {"stream": 9, "correlation": 5}},
        _kernel("gemm_d", 520, 80, 7, 6),       # gap 500..520: another stream's copy
        _kernel("gemm_e", 603, 97, 7, 7),       # gap 600..603: under the threshold
        _op("aten::linear", 380, 30), _op("aten::index_select", 390, 10), _launch(395, 4, api="cuda_driver"),
        _op("aten::mm", 0, 5), _launch(1, 1), _launch(2, 3), _launch(3, 6), _launch(4, 7),
    ]


def test_gaps_split_by_what_ran_and_host_gaps_name_their_launcher():
    t = timeline.analyze(_trace(), min_gap_us=5.0)
    assert t.window_ms == pytest.approx(0.7)
    assert t.busy_ms == pytest.approx((100 + 100 + 100 + 80 + 97) / 1e3)
    assert t.gaps == 3
    assert t.gap_comm_ms == pytest.approx(0.05)
    assert t.gap_other_ms == pytest.approx(0.02)
    assert t.gap_host_ms == pytest.approx(0.15)
    assert t.comm_ms == pytest.approx(0.06)
    # the innermost op around the launch (a driver API launch, as Triton's), not its enclosing aten::linear
    assert t.host_gap_ops == [("aten::index_select", pytest.approx(0.15), 1)]
    assert "busy 0.5 of 0.7 ms" in t.lines()[0]


def test_collectives_never_count_as_the_compute_stream():
    events = [_kernel("ncclDevKernel_AllReduce", 0, 1000, 3, 1), _kernel("gemm", 0, 10, 7, 2),
              _kernel("gemm", 50, 10, 7, 3)]
    t = timeline.analyze(events)
    assert t.busy_ms == pytest.approx(0.02)
    assert t.gap_comm_ms == pytest.approx(0.04)


def test_cli_reads_a_gzipped_trace(tmp_path, capsys):
    path = tmp_path / "step1_rank0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    timeline.main([str(path)])
    out = capsys.readouterr().out
    assert "idle gaps 3" in out and "aten::index_select" in out


def test_a_trace_without_device_events():
    assert timeline.analyze([_op("aten::mm", 0, 5)]).lines()[0].startswith("compute stream busy 0.0 of 0.0 ms")


def test_skew_names_the_rank_that_arrives_last():
    # two all_to_alls and an all_reduce; rank 1 reaches the first all_to_all 300 us late, rank 0 the all_reduce
    rank0 = [_kernel("ncclAllToAll", 0, 400, 9, 1), _kernel("ncclAllToAll", 1000, 100, 9, 2),
             _kernel("ncclAllReduce", 2050, 50, 9, 3), _kernel("gemm", 500, 100, 7, 4)]
    rank1 = [_kernel("ncclAllToAll", 300, 100, 9, 1), _kernel("ncclAllToAll", 1000, 100, 9, 2),
             _kernel("ncclAllReduce", 2000, 100, 9, 3)]
    s = timeline.skew([rank0, rank1])
    assert s.collectives == 3
    assert s.wait_ms == [pytest.approx(0.3), pytest.approx(0.05)]
    assert s.last == [2, 1]  # a tie counts for the first rank
    assert s.lines()[1] == "  rank 0: waited 0.3 ms for other ranks, arrived last at 2"


def _region(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_host_gaps_name_the_region_around_their_launcher_across_layers():
    """A launch inside FSDP's record_function region (per layer) or an autograd node is named after that region,
    layer numbers folded, so the same hook in every layer adds up; a launch outside any stays its op alone."""
    events = [_kernel("k0", 0, 10, 7, 1)]
    for layer, ts in ((3, 100), (12, 300)):  # host gaps of 90 and 190 us before the copies
        events += [_region(f"FSDP::post_backward_reduce (model.layers.{layer}.mlp.experts)", ts - 50, 60),
                   _op("aten::_chunk_cat", ts - 40, 40), _op("aten::copy_", ts - 30, 20),
                   _launch(ts - 25, 10 + layer), _kernel("copy", ts, 10, 7, 10 + layer)]
    events += [_op("autograd::engine::evaluate_function: IndexAddBackward0", 380, 40), _op("aten::add", 390, 10),
               _launch(395, 50), _kernel("add", 400, 10, 7, 50),
               _op("aten::mm", 480, 10), _launch(485, 51), _kernel("mm", 500, 10, 7, 51)]
    ops = {op: (ms, n) for op, ms, n in timeline.analyze(events).host_gap_ops}
    assert ops == {"FSDP::post_backward_reduce (model.layers.N.mlp.experts) > aten::copy_": (pytest.approx(0.28), 2),
                   "IndexAddBackward0 > aten::add": (pytest.approx(0.09), 1), "aten::mm": (pytest.approx(0.09), 1)}
