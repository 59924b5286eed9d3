"""Cheap eager launches of Triton kernels, shared by the moe and attention kernels.

    launch(kernel, grid, args, constexprs)    # == kernel[grid](*args, **constexprs)

`kernel` is a @triton.jit function, optionally behind @triton.heuristics and one @triton.autotune.
The first launch of each specialization goes through Triton (compiling, autotuning, returning the
compiled kernel); later launches call that compiled kernel's launcher directly. Triton's own per-call
work (binding and specializing every argument, the autotuner's key, the heuristics, the cache key,
launch-hook metadata) costs several times the launcher on the host, and an expert layer makes ~15
launches per step per layer. The direct call passes exactly what JITFunction.run passes (grid, stream,
function, packed metadata, no hooks, then every parameter including constexprs): a Triton internal, so
it is taken only on the Triton releases in DIRECT_LAUNCH_TRITON_VERSIONS.

Contract:
- `args` are the leading kernel parameters, positionally; `constexprs` the rest by name (plus launch
  options such as num_warps). A callable `grid` receives {**constexprs, autotuned config, heuristics}
  only, not the runtime arguments.
- The cache key holds everything a compiled kernel depends on, or finer: the kernel, the device, the
  constexprs, the autotuner's key values and each argument's specialization (tensor dtype and 16-byte
  alignment; int == 1, divisibility by 16 and 32-bit range; None). Heuristics are re-evaluated per call;
  when one yields another value than the cached kernel was compiled with (it read an argument outside
  the key), that call takes Triton's path.
- Launch hooks installed (profilers, proton), interpreted kernels (TRITON_INTERPRET=1), a Triton release
  outside DIRECT_LAUNCH_TRITON_VERSIONS or DIRECT_LAUNCH = False: always Triton's own path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    from triton.runtime import _allocation as _triton_allocation
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction
    try:
        from triton import knobs as _triton_knobs
    except ImportError:  # a Triton without knobs: never bypass its launch path
        _triton_knobs = None
except ImportError:  # no triton (CPU-only wheels): nothing here is called
    triton = None

DIRECT_LAUNCH = True

# (major, minor) releases whose JITFunction.run calls the compiled launcher as _launch_compiled does (from
# 3.3; run on GPUs with 3.6, 3.9 checked by its source). Any other release: Triton's own path, slower.
DIRECT_LAUNCH_TRITON_VERSIONS = frozenset((3, minor) for minor in range(3, 10))


def triton_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a Triton version string ("3.6.0", "3.5.0+git1a2b"); None if unreadable."""
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


TRITON_VERSION = triton_version(triton.__version__) if triton is not None else None


@dataclass(frozen=True)
class _Layers:
    """A decorated kernel taken apart: the autotuner (or None), heuristics outermost first, the JIT."""
    kernel: object  # held so that its id (the cache key) is never reused
    autotuner: object | None
    heuristics: tuple
    jit: object
    interpreted: bool
    autotune_key: tuple  # (parameter index, name) of each autotune key; () without autotune


@dataclass(frozen=True)
class _Compiled:
    kernel: object           # triton CompiledKernel
    config_kwargs: dict      # the autotuned constexprs ({} without autotune)
    tail_names: tuple        # kernel parameters after the positional args, in order
    heuristic_values: tuple  # what the heuristics gave when this kernel was compiled


_LAYERS: dict[int, _Layers] = {}
# (kernel id, device, constexprs, autotune key, argument specializations) -> _Compiled. One entry per
# specialization class and autotune key, not per shape.
_COMPILED: dict[tuple, _Compiled] = {}


def _layers(kernel) -> _Layers:
    found = _LAYERS.get(id(kernel))
    if found is None:
        autotuner, heuristics, fn = None, [], kernel
        while not isinstance(fn, JITFunction) and type(fn).__name__ != "InterpretedFunction":
            if isinstance(fn, Autotuner):
                autotuner = fn
            elif isinstance(fn, Heuristics):
                heuristics.append(fn)
            fn = fn.fn
        interpreted = type(fn).__name__ == "InterpretedFunction"
        key = ()
        if autotuner is not None and not interpreted:
            names = list(fn.arg_names)
            key = tuple((names.index(k), k) for k in autotuner.keys)
        found = _Layers(kernel, autotuner, tuple(heuristics), fn, interpreted, key)
        _LAYERS[id(kernel)] = found
    return found


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (triton.cdiv is a constexpr_function: several us per host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side triton.next_power_of_2 (also a constexpr_function)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_Tensor = torch.Tensor


def specialization_key(args: tuple) -> tuple:
    """What Triton specializes a compiled kernel on, or finer (equal keys: the same compiled kernel):
    tensor dtype and 16-byte alignment; int == 1, divisibility by 16 and 32-bit range; None and bools
    by value; other scalars by type. One comprehension, no call per argument: this runs per launch."""
    return tuple([(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, _Tensor)
                  else (a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF) if type(a) is int
                  else a if a is None or type(a) is bool
                  else type(a) for a in args])


def launch_hooks_active() -> bool:
    """A Triton launch hook is installed (Triton >= 3.6 keeps them in HookChains, older ones a callable)."""
    if _triton_knobs is None:
        return True
    runtime = _triton_knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or \
        (leave is not None and bool(getattr(leave, "calls", True)))


def current_device() -> int:
    return torch.cuda.current_device()  # Triton's JIT launches on the current device too


def current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)  # what Triton's CUDA driver uses


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # The caching allocator's blocks are 512-byte aligned, more than any descriptor asks for. On the CPU
    # (the interpreter builds descriptors too) a host buffer.
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_scratch_allocator() -> None:
    """Kernels that build TMA descriptors on the device need Triton's scratch allocator. Triton keeps it
    in a context variable, so each thread (the autograd engine runs the backward on its own) starts
    without one: set one backed by torch's caching allocator unless the caller already set theirs."""
    if isinstance(_triton_allocation._allocator.get(), _triton_allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _autotune_key(layers: _Layers, args: tuple, constexprs: dict) -> tuple:
    n = len(args)
    return tuple([args[i] if i < n else constexprs[name] for i, name in layers.autotune_key])


def _meta(layers: _Layers, args: tuple, constexprs: dict, config_kwargs: dict) -> tuple[dict, tuple]:
    """The constexprs of this launch (given, autotuned, heuristic) and the heuristic values alone."""
    meta = {**constexprs, **config_kwargs}
    values = []
    if layers.heuristics:
        named = {**dict(zip(layers.jit.arg_names, args)), **meta}
        for heur in reversed(layers.heuristics):  # the innermost decorator runs last in Triton too
            for name, fn in heur.values.items():
                named[name] = meta[name] = fn(named)
                values.append(meta[name])
    return meta, tuple(values)


def launch(kernel, grid, args: tuple, constexprs: dict) -> None:
    """kernel[grid](*args, **constexprs) by the cheapest route allowed here (see the module docstring)."""
    layers = _layers(kernel)
    if layers.interpreted or not DIRECT_LAUNCH or TRITON_VERSION not in DIRECT_LAUNCH_TRITON_VERSIONS:
        kernel[grid](*args, **constexprs)
        return
    device = current_device()
    key = (id(kernel), device, tuple(constexprs.items()), _autotune_key(layers, args, constexprs),
           specialization_key(args))
    entry = _COMPILED.get(key)
    if entry is not None and not launch_hooks_active():
        meta, heuristic_values = _meta(layers, args, constexprs, entry.config_kwargs)
        if heuristic_values == entry.heuristic_values:
            _launch_compiled(entry, grid, meta, args, device)
            return
    compiled = kernel[grid](*args, **constexprs)
    if entry is None and all(hasattr(compiled, n) for n in ("run", "function", "packed_metadata")):
        config = dict(layers.autotuner.best_config.kwargs) if layers.autotuner is not None else {}
        _, heuristic_values = _meta(layers, args, constexprs, config)
        _COMPILED[key] = _Compiled(compiled, config, tuple(layers.jit.arg_names[len(args):]), heuristic_values)


def _launch_compiled(entry: _Compiled, grid, meta: dict, args: tuple, device: int) -> None:
    g = grid(meta) if callable(grid) else grid
    compiled = entry.kernel
    compiled.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, current_stream(device),
                 compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *[meta[name] for name in entry.tail_names])
