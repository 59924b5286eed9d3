"""tuning.faster: a kernel choice is timed once, inside the warm-up window by rank 0 of its group alone, and
every rank adopts it (two ranks timing on their own could pick different kernels); it is logged. Outside the
window a process with a process group up never communicates: the first candidate, untimed. And the
Triton autotuners cache their results on disk where this Triton can."""

from __future__ import annotations

import inspect
import logging

import pytest
import triton

from moe.kernels import tuning


def _timed_by_rank(rank: int):
    """A bench whose timings make "a" win on rank 0 and "b" on every other rank."""
    def fake_bench(call, quantiles):
        return {"a": 1.0, "b": 2.0}[call()] if rank == 0 else {"a": 2.0, "b": 1.0}[call()]
    return fake_bench


def _candidates(counter: list):
    def make():
        counter.append(1)
        return {"a": lambda: "a", "b": lambda: "b"}
    return make


def test_single_process_times_once_and_logs(monkeypatch, caplog):
    monkeypatch.setattr(tuning, "bench", _timed_by_rank(0))
    monkeypatch.setattr(tuning, "_FASTER", {})
    timed = []
    with caplog.at_level(logging.INFO, logger="moe.kernels.tuning"):
        assert tuning.faster(("op", 1), _candidates(timed)) == "a"
        assert tuning.faster(("op", 1), _candidates(timed)) == "a"
    assert len(timed) == 1
    assert "kernel choice for ('op', 1): a" in caplog.text


def test_nothing_to_time_is_undecided(monkeypatch):
    monkeypatch.setattr(tuning, "_FASTER", {})
    assert tuning.faster(("op", 2), dict) is None
    assert ("op", 2) not in tuning._FASTER


def _agree(rank: int, world_size: int):
    import torch.distributed as dist

    tuning.bench = _timed_by_rank(rank)
    timed = []
    outside = tuning.faster(("op", 5), _candidates(timed))  # no warm-up: untimed, no collective
    with tuning.warm_up(dist.group.WORLD):
        first = tuning.faster(("op", 3), _candidates(timed))
        # rank 0 finds nothing to time on this call: every rank stays undecided, then decides on the next
        undecided = tuning.faster(("op", 4), dict if rank == 0 else _candidates(timed))
        second = tuning.faster(("op", 4), _candidates(timed))
    return first, undecided, second, len(timed) - 1, outside


@pytest.mark.dist
def test_every_rank_adopts_rank_0s_choice(run_dist):
    results = run_dist(_agree, 2)
    assert results[0] == ("a", None, "a", 2, "a")  # rank 0 timed twice (in the window)
    assert results[1] == ("a", None, "a", 0, "a")  # rank 1 never timed, and would have picked "b"


def test_autotuners_cache_results_where_triton_can():
    supported = "cache_results" in inspect.signature(triton.autotune).parameters
    assert tuning._AUTOTUNE_CACHE == ({"cache_results": True} if supported else {})
    from moe.kernels import grouped_linear, grouped_xty

    tuners = [k for k in (*vars(grouped_linear).values(), *vars(grouped_xty).values())
              if isinstance(k, triton.runtime.autotuner.Autotuner)]
    # Triton itself turns the cache off in the interpreter
    assert len(tuners) == 3 and all(t.cache_results == (supported and not tuning.INTERPRET) for t in tuners)
