"""runtime.observe.slow_step: a long step is announced, with what the main thread is doing; a short one is not."""

from __future__ import annotations

import logging
import sys
import time
import types
from pathlib import Path

from runtime.observe.slow_step import SlowStepNotice, where

ROOT = Path(__file__).resolve().parents[2]


def _inner(box):
    box.append(sys._getframe())


def _outer(inner, box):
    inner(box)


def _frame_inside(library_file: str, our_file: str):
    """A frame of a function of `library_file` called from a function of `our_file` (their code objects renamed:
    the frames read as those files')."""
    inner = types.FunctionType(_inner.__code__.replace(co_filename=library_file), globals())
    outer = types.FunctionType(_outer.__code__.replace(co_filename=our_file), globals())
    box: list = []
    outer(inner, box)
    return box[0]


OUTER_LINE = _outer.__code__.co_firstlineno + 1
INNER_LINE = _inner.__code__.co_firstlineno + 1


def test_where_names_the_activity_and_our_innermost_frame():
    frame = _frame_inside("/venv/site-packages/torch/_inductor/graph.py", str(ROOT / "runtime" / "optim.py"))
    assert where(frame) == f"compiling (torch._inductor), under runtime/optim.py:{OUTER_LINE} _outer"
    frame = _frame_inside("/venv/site-packages/triton/runtime/autotuner.py", str(ROOT / "moe" / "layer.py"))
    assert where(frame) == f"autotuning kernels (triton.runtime.autotuner), under moe/layer.py:{OUTER_LINE} _outer"
    frame = _frame_inside("/elsewhere/lib.py", "/elsewhere/main.py")
    assert where(frame) == f"in /elsewhere/lib.py:{INNER_LINE}"


def test_a_long_step_is_noticed_with_doubling_intervals_and_a_short_one_is_not(caplog):
    caplog.set_level(logging.INFO, logger="runtime")
    with SlowStepNotice(first_after_s=0.05, poll_s=0.005) as notice:
        with notice.step(7):
            time.sleep(0.35)
        time.sleep(0.1)  # between steps: nothing to say
        with notice.step(8):
            time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    # at 0.05, 0.1 and 0.2 s (the thread may come late under load, never early)
    assert 1 <= len(lines) <= 3, lines
    assert all(line.startswith("step 7 still running after") for line in lines)
    assert f"{Path(__file__).name}:" in lines[0]  # the main thread was sleeping in this test
