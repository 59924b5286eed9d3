"""Shortcuts in the Triton interpreter, none of which changes what a kernel computes (its outputs are
bit-identical with and without them):

- No redundant re-patching: a launch patches triton.language for the kernel (GridExecutor), and then every
  call of a @triton.jit helper inside it patches the language again (InterpretedFunction.__call__ ->
  _patch_lang: a walk over every member of triton.language, ~2 ms), although nothing changed since the launch
  patched it. Here a helper call patches only the language modules that its own globals see and the launch
  has not patched yet (tl.core for triton.language's own helpers such as tl.zeros), as Triton's call would.
- tl.sort's xor reductions in numpy: the bitonic network's compare-and-swap reduces with _xor_combine along an
  axis, which the interpreter folds element by element in Python (its fast paths cover sum, min and max
  only); numpy's bitwise_xor.reduce folds the same integers to the same bits.
- No overflow check whose assert is off: every integer add, sub and mul is first recomputed in int64 and
  compared with its type's range (semantic.binary_op_sanitize_overflow_impl), only to feed a device_assert that
  returns at once without options.debug, which the interpreter's options never set. Skipped where debug is off.
- One numpy dtype table: _get_np_dtype builds its dict of Triton -> numpy dtypes on every call (once per op
  result); here each dtype's entry is computed once and looked up.
- Block types and tensor shapes built once per (element type, shape): every op result makes a tl.block_type
  (its shape unwrapped into tl.tuples, validated, named) and a tl.tensor (its shape wrapped again); here the
  attributes of the first of each kind are copied, and each tensor still gets a tuple of its own.

The first two take about a third of the CPU tests' interpreter time off, the next two about a quarter of
what remained, the last about a third of what remained then. Applied only where Triton's interpreter has the
attributes these replace (and debug off)."""

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
    from triton.language.semantic import TritonSemantic

    needed = ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang", "ReduceOps",
              "_get_np_dtype", "InterpreterOptions")
    if (not all(hasattr(interp, name) for name in needed)
            or not hasattr(interp.InterpretedFunction, "rewrite")
            or not hasattr(interp.ReduceOps, "apply_impl") or not hasattr(tl.standard, "_xor_combine")
            or not hasattr(TritonSemantic, "binary_op_sanitize_overflow_impl")
            or interp.InterpreterOptions().debug):
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

    sanitize = TritonSemantic.binary_op_sanitize_overflow_impl

    def sanitize_if_asserted(self, lhs, rhs, binary_op):
        if self.builder.options.debug:  # else device_assert drops the check: nothing to compute
            return sanitize(self, lhs, rhs, binary_op)
        return None

    np_dtype, np_dtypes, address = interp._get_np_dtype, {}, np.dtype(np.uint64)

    def np_dtype_once(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):  # unhashable (__eq__ without __hash__), and always an address
            return address
        if scalar not in np_dtypes:
            np_dtypes[scalar] = np_dtype(scalar)
        return np_dtypes[scalar]

    block_init, tensor_init, blocks = tl.block_type.__init__, tl.core.tensor.__init__, {}

    def type_key(t):
        if isinstance(t, tl.pointer_type):  # equal by pointee, address space and constness
            return ("pointer", type_key(t.element_ty), t.address_space, t.const)
        return type(t), t.name  # any other dtype: equal by name

    def block_type_once(self, element_ty, shape):
        dims = [s.value if isinstance(s, tl.constexpr) else s for s in shape] \
            if isinstance(shape, (list, tuple, tl.tuple)) else None
        if dims is None or not all(type(d) is int for d in dims):  # bools are no block dims
            return block_init(self, element_ty, shape)  # Triton's own checks and errors
        key = (type_key(element_ty), tuple(dims))
        if key not in blocks:
            block_init(self, element_ty, shape)
            blocks[key] = {**vars(self), "_key": key}
        else:
            vars(self).update(blocks[key])

    def tensor_once(self, handle, type):
        shape = vars(type).get("_tensor_shape")
        if shape is None:
            tensor_init(self, handle, type)
            if "_key" in vars(type):
                blocks[type._key]["_tensor_shape"] = (list(self.shape.values), self.shape.type, self.numel)
            return
        values, shape_type, self.numel = shape
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.shape = tl.tuple(list(values), shape_type)  # its own tuple, as tensor() makes one

    helper._skips_repatching = True
    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = helper
    interp.ReduceOps.apply_impl = reduce
    TritonSemantic.binary_op_sanitize_overflow_impl = sanitize_if_asserted
    interp._get_np_dtype = np_dtype_once
    tl.block_type.__init__ = block_type_once
    tl.core.tensor.__init__ = tensor_once
    return True
