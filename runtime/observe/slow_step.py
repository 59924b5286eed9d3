"""A word when a training step runs long: the first steps compile and autotune kernels, minutes at real sizes,
and a run that prints nothing for that long looks hung. A daemon thread logs, once a step has run
FIRST_NOTICE_S seconds and again each time that doubles, the step and where the main thread is:

    step 1 still running after 60 s: compiling (torch._inductor), under runtime/optim.py:195 _step_group

    with SlowStepNotice() as notice:
        for step in ...:
            with notice.step(step):
                ...

Only the main thread's stack is read (sys._current_frames); the step is never interrupted. Rank 0 logs at
INFO (the other ranks log errors only, runtime.launch.setup_logging).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Self

log = logging.getLogger("runtime")

FIRST_NOTICE_S = 60.0
_PROJECT = Path(__file__).resolve().parents[2]
_OUR_PACKAGES = ("runtime", "moe", "attention", "quant", "gpu")
# What a library frame says the step is doing; the innermost frame that matches decides.
_ACTIVITIES = (("torch/_inductor", "compiling"), ("torch/_dynamo", "compiling"),
               ("triton/runtime/autotuner", "autotuning kernels"), ("triton/compiler", "compiling a kernel"),
               ("torch/distributed", "in torch.distributed"), ("safetensors", "reading weights"))


def _ours(filename: str) -> str | None:
    """The path of `filename` inside our packages, or None."""
    try:
        relative = Path(filename).resolve().relative_to(_PROJECT)
    except ValueError:
        return None
    return str(relative) if relative.parts[0] in _OUR_PACKAGES else None


def where(frame) -> str:
    """Where a thread stands, from its innermost frame: what a library frame says it is doing (with the
    library's package) and the innermost frame of our code."""
    stack = traceback.extract_stack(frame)
    parts = []
    for summary in reversed(stack):
        match = next(((key, what) for key, what in _ACTIVITIES if f"/{key}" in summary.filename), None)
        if match:
            parts.append(f"{match[1]} ({match[0].replace('/', '.')})")
            break
    for summary in reversed(stack):
        if path := _ours(summary.filename):
            parts.append(f"under {path}:{summary.lineno} {summary.name}")
            break
    return ", ".join(parts) or f"in {stack[-1].filename}:{stack[-1].lineno}"


class SlowStepNotice:
    """The notice thread of one training loop (module docstring). `first_after_s` and `poll_s` are for tests."""

    def __init__(self, first_after_s: float = FIRST_NOTICE_S, poll_s: float = 1.0):
        self.first_after_s, self.poll_s = first_after_s, poll_s
        self._current: tuple[int, float] | None = None  # (step, its start), published whole
        self._stop = threading.Event()
        self._main = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="slow-step-notice", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @contextmanager
    def step(self, step: int):
        self._current = (step, time.monotonic())
        try:
            yield
        finally:
            self._current = None

    def _watch(self) -> None:
        noticed, next_after = None, self.first_after_s
        while not self._stop.wait(self.poll_s):
            current = self._current
            if current is None:
                continue
            if current != noticed:
                noticed, next_after = current, self.first_after_s
            step, start = current
            elapsed = time.monotonic() - start
            if elapsed >= next_after:
                frame = sys._current_frames().get(self._main)
                log.info("step %d still running after %.0f s: %s", step, elapsed,
                         where(frame) if frame is not None else "the main thread is gone")
                next_after *= 2
