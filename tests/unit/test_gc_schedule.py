"""runtime.observe.gc_schedule: automatic collection off inside the loop, collections only on the scheduled steps,
the collector restored afterwards (also when the loop raises); 0 leaves it alone."""

import gc

import pytest

from runtime.observe.gc_schedule import scheduled_gc


def _collections(monkeypatch) -> list:
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or real(generation))
    return calls


def test_collects_only_on_scheduled_steps_with_automatic_collection_off(monkeypatch):
    calls = _collections(monkeypatch)
    assert gc.isenabled()
    with scheduled_gc(3) as collect:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        calls.clear()  # the full collection before freezing
        collected = [step for step in range(1, 8) if collect(step)]
        assert calls == [2, 2, 2] and collected == [1, 3, 6]  # after the first step, then steps 3 and 6
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_what_the_first_step_builds_is_frozen_out_of_later_passes():
    with scheduled_gc(50) as collect:
        frozen_before = gc.get_freeze_count()
        compiled_code = [[i] for i in range(10_000)]  # long-lived containers the first step makes
        collect(4)  # a resumed run's first step
        assert gc.get_freeze_count() >= frozen_before + len(compiled_code)
        per_step = [[i] for i in range(10)]
        walked = {id(o) for o in gc.get_objects()}  # what a collection passes over: the frozen ones are not there
        assert id(per_step[0]) in walked and id(compiled_code[0]) not in walked
    assert gc.get_freeze_count() == 0


def test_restores_the_collector_when_the_loop_raises():
    with pytest.raises(RuntimeError), scheduled_gc(5):
        raise RuntimeError("a failed step")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_zero_leaves_automatic_collection_on(monkeypatch):
    calls = _collections(monkeypatch)
    with scheduled_gc(0) as collect:
        assert gc.isenabled()
        assert not collect(50)
    assert calls == []
