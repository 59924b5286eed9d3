"""Two shortcuts in the Triton interpreter, neither of which changes what a kernel computes:

- No redundant re-patching: a launch patches triton.language for the kernel (GridExecutor), and then every
  call of a @triton.jit helper inside it patches the language again (InterpretedFunction.__call__ ->
  _patch_lang: a walk over every member of triton.language, ~2 ms), although nothing changed since the launch
  patched it. Here a helper call patches only the language modules that its own globals see and the launch
  has not patched yet (tl.core for triton.language's own helpers such as tl.zeros), as Triton's call would.
- tl.sort's xor reductions in numpy: the bitonic network's compare-and-swap reduces with _xor_combine along an
  axis, which the interpreter folds element by element in Python (its fast paths cover sum, min and max
  only); numpy's bitwise_xor.reduce folds the same integers to the same bits.

The CPU tests spend about a third of their interpreter time less. Applied only where Triton's interpreter
has the attributes these replace."""

from __future__ import annotations

import inspect

import numpy as np


def install() -> bool:
    """Patches triton.runtime.interpreter in this process; False where its layout is not the one known."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    needed = ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang", "ReduceOps")
    if (not all(hasattr(interp, name) for name in needed)
            or not hasattr(interp.InterpretedFunction, "rewrite")
            or not hasattr(interp.ReduceOps, "apply_impl") or not hasattr(tl.standard, "_xor_combine")):
        return False
    if getattr(interp.InterpretedFunction.__call__, "_skips_repatching", False):
        return True
    launch_call, helper_call = interp.GridExecutor.__call__, interp.InterpretedFunction.__call__
    patched: list[set[int]] = []  # per running launch: the language modules patched so far
    langs: dict = {}

    def langs_of(fn) -> frozenset[int]:
        if fn not in langs:  # what _patch_lang patches for fn
            langs[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and v in (tl, tl.core))
        return langs[fn]

    def launch(self, *args, **kwargs):
        patched.append(set(langs_of(self.fn)))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def helper(self, *args, **kwargs):
        if patched and langs_of(self.fn) <= patched[-1]:
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise interp.InterpreterError(repr(e)) from e
        if patched:
            patched[-1] |= langs_of(self.fn)
        return helper_call(self, *args, **kwargs)

    reduce_impl, xor = interp.ReduceOps.apply_impl, tl.standard._xor_combine

    def reduce(self, input):
        if self.combine_fn is xor and len(input) == 1 and self.axis is not None:
            data = input[0].handle.data
            return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims),
                                  input[0].dtype)
        return reduce_impl(self, input)

    helper._skips_repatching = True
    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = helper
    interp.ReduceOps.apply_impl = reduce
    return True
