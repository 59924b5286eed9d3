"""Python's garbage collector on a schedule: an automatic collection pauses a rank at a random point of a step
(tens of ms for a full pass over a large model's objects), and under any parallelism the other ranks wait for
it at their next collective. The training loop collects at step boundaries instead, every
train.gc_every_n_steps steps, the same steps on every rank (0 leaves Python's automatic collection on).
What the first step builds for the whole run (compiled graphs, dynamo's guards, kernel caches) is frozen after it,
so the scheduled passes walk only what later steps allocate.

    with scheduled_gc(every) as collect:
        for step in ...:
            ...
            collect(step)
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def scheduled_gc(every: int) -> Iterator[Callable[[int], None]]:
    """Automatic collection off and the objects alive now (the model, the optimizer) frozen out of every later
    pass; yields `collect(step) -> bool` (whether it collected), called after every step: after the first one
    it collects and freezes what survived (the step's compiled code and caches), then it collects on multiples of
    `every` (a full pass, cheap over what is not frozen: an EP step leaves a few thousand cyclic objects, no
    tensors). Restores the collector's state on exit, raised or not."""
    if every == 0:
        yield lambda step: False
        return
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()

    warmed_up = False

    def collect(step: int) -> bool:
        nonlocal warmed_up
        if not warmed_up:
            gc.collect()
            gc.freeze()
            warmed_up = True
            return True
        if step % every == 0:
            gc.collect()
            return True
        return False
    try:
        yield collect
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
