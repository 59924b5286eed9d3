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
        for step in range(1, 8):
            collect(step)
        assert calls == [2, 2]  # steps 3 and 6
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_restores_the_collector_when_the_loop_raises():
    with pytest.raises(RuntimeError), scheduled_gc(5):
        raise RuntimeError("a failed step")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_zero_leaves_automatic_collection_on(monkeypatch):
    calls = _collections(monkeypatch)
    with scheduled_gc(0) as collect:
        assert gc.isenabled()
        collect(50)
    assert calls == []
