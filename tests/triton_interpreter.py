"""The Triton interpreter without its redundant re-patching: a launch patches triton.language for the kernel
(GridExecutor), and then every call of a @triton.jit helper inside it patches the language again
(InterpretedFunction.__call__ -> _patch_lang: a walk over every member of triton.language, ~2 ms), although
nothing changed since the launch patched it. Here a helper call patches only the language modules that its
own globals see and the launch has not patched yet (tl.core for triton.language's own helpers such as
tl.zeros), as Triton's call would; what the kernels compute is untouched. The CPU tests spend about a fifth
of their interpreter time less. Applied only where Triton's interpreter has the attributes it replaces."""

from __future__ import annotations

import inspect


def install() -> bool:
    """Patches triton.runtime.interpreter in this process; False where its layout is not the one known."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    needed = ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang")
    if not all(hasattr(interp, name) for name in needed) or not hasattr(interp.InterpretedFunction, "rewrite"):
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

    helper._skips_repatching = True
    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = helper
    return True
