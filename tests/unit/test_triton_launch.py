"""The direct-launch cache of gpu/launch.py, on real (uncompiled) Triton JIT / heuristics /
autotune objects whose GPU side is replaced: JITFunction.run records the call and returns a stand-in
compiled kernel, as it would after compiling (there is no GPU here)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction

from gpu import launch as gpu_launch


def _kernel_source(x_ptr, n, eps, BLOCK, EVEN):  # the signature is what the launcher reads
    pass


class _Compiled:
    function, packed_metadata = "function-handle", "packed-metadata"

    def __init__(self, calls):
        self.calls = calls

    def run(self, *args):
        self.calls.append(("direct", args))


def _jit(calls):
    """A real JITFunction whose run (Triton's compile + launch) is recorded instead."""
    jit = JITFunction(_kernel_source)

    def run(*args, grid, warmup, **kwargs):
        calls.append(("jit", grid, args, kwargs))
        return _Compiled(calls)

    jit.run = run
    return jit


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(gpu_launch, "current_device", lambda: 0)
    monkeypatch.setattr(gpu_launch, "current_stream", lambda device: 1234)
    monkeypatch.setattr(gpu_launch, "launch_hooks_active", lambda: False)
    monkeypatch.setattr(gpu_launch, "_COMPILED", {})
    monkeypatch.setattr(gpu_launch, "DIRECT_LAUNCH", True)


def test_plain_kernel_reuses_the_compiled_kernel_per_specialization(fake_gpu, monkeypatch):
    calls = []
    kernel = _jit(calls)
    x = torch.zeros(64)

    def launch(grid, tensor, n, meta):
        calls.clear()
        gpu_launch.launch(kernel, grid, (tensor, n, 1e-6), meta)
        return calls

    meta = {"BLOCK": 32, "EVEN": True, "num_warps": 4}
    # First launch of a specialization: Triton's path, which hands back the compiled kernel.
    assert [c[0] for c in launch((3, 1, 1), x, 64, meta)] == ["jit"]
    # Same specialization (other values, other grid): the launcher, with exactly what JITFunction.run
    # passes it (no hooks: metadata and hooks None), constexprs in parameter order (num_warps is none).
    (kind, args), = launch((5, 2), x, 128, meta)
    assert kind == "direct"
    assert args[:9] == (5, 2, 1, 1234, "function-handle", "packed-metadata", None, None, None)
    assert args[9] is x and args[10:] == (128, 1e-6, 32, True)
    # What Triton specializes on differs: back to Triton once each, then direct.
    for tensor, n in ((x[1:], 128), (x, 1), (x, 100), (x, 2**31), (x.double(), 128)):
        assert launch((5,), tensor, n, meta)[0][0] == "jit", (tensor.dtype, tensor.storage_offset(), n)
        assert launch((5,), tensor, n, meta)[0][0] == "direct", (tensor.dtype, tensor.storage_offset(), n)
    # Other constexprs or launch options: another compiled kernel.
    assert launch((5,), x, 128, {**meta, "BLOCK": 64})[0][0] == "jit"
    assert launch((5,), x, 128, {**meta, "num_warps": 8})[0][0] == "jit"
    # Launch hooks installed (a profiler) or DIRECT_LAUNCH off: always Triton's path.
    monkeypatch.setattr(gpu_launch, "launch_hooks_active", lambda: True)
    assert launch((5,), x, 128, meta)[0][0] == "jit"
    monkeypatch.setattr(gpu_launch, "launch_hooks_active", lambda: False)
    monkeypatch.setattr(gpu_launch, "DIRECT_LAUNCH", False)
    assert launch((5,), x, 128, meta)[0][0] == "jit"


def test_autotuned_kernel_gets_its_config_heuristics_and_grid(fake_gpu):
    calls = []
    configs = [triton.Config({"BLOCK": 16}, num_warps=4)]
    kernel = triton.autotune(configs=configs, key=["n"])(
        triton.heuristics({"EVEN": lambda a: a["n"] % a["BLOCK"] == 0})(_jit(calls)))
    x = torch.zeros(64)

    def grid(meta):
        return (triton.cdiv(100, meta["BLOCK"]),)

    def launch(n):
        calls.clear()
        gpu_launch.launch(kernel, grid, (x, n, 0.5), {})
        return calls

    (kind, _, args, kwargs), = launch(64)
    assert kind == "jit" and kwargs["BLOCK"] == 16 and kwargs["EVEN"] is True
    (kind, args), = launch(64)
    assert kind == "direct" and args[:3] == (7, 1, 1) and args[10:] == (64, 0.5, 16, True)
    # A new autotune key value goes through the autotuner once (it may pick another config).
    assert launch(48)[0][0] == "jit"
    (kind, args), = launch(48)
    assert kind == "direct" and args[10:] == (48, 0.5, 16, True)
    assert launch(40)[0][0] == "jit"
    (kind, args), = launch(40)
    assert args[10:] == (40, 0.5, 16, False)  # the heuristic, evaluated per call


def test_heuristic_reading_an_argument_outside_the_key_falls_back_to_triton(fake_gpu):
    """EVEN here reads eps, which no key holds: a launch whose heuristic value differs from the cached
    kernel's must not run that kernel (it was compiled for the other constexpr value)."""
    calls = []
    kernel = triton.heuristics({"EVEN": lambda a: a["eps"] > 0})(_jit(calls))
    x = torch.zeros(64)

    def launch(eps):
        calls.clear()
        gpu_launch.launch(kernel, (1,), (x, 64, eps), {"BLOCK": 16})
        return calls

    assert launch(0.5)[0][0] == "jit"
    assert launch(0.25)[0][0] == "direct"  # same heuristic value: the cached kernel
    (kind, _, _, kwargs), = launch(-0.5)
    assert kind == "jit" and kwargs["EVEN"] is False
    assert launch(0.5)[0][0] == "direct"


def test_interpreted_kernels_take_tritons_path(monkeypatch):
    calls = []

    class Interpreted:  # what triton.jit returns under TRITON_INTERPRET=1
        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append((grid, args, meta))

    Interpreted.__name__ = "InterpretedFunction"
    kernel = Interpreted()
    gpu_launch.launch(kernel, (2,), (1, 2), {"BLOCK": 4})
    gpu_launch.launch(kernel, (2,), (1, 2), {"BLOCK": 4})
    assert calls == [((2,), (1, 2), {"BLOCK": 4})] * 2


def test_launch_hooks_detected():
    """No hooks by default; an installed enter hook sends launches to Triton's path."""
    knobs = gpu_launch._triton_knobs
    if knobs is None or not hasattr(knobs.runtime.launch_enter_hook, "add"):
        pytest.skip("this Triton keeps launch hooks differently")
    assert not gpu_launch.launch_hooks_active()

    def hook(metadata):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert gpu_launch.launch_hooks_active()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not gpu_launch.launch_hooks_active()


def test_version_parsing():
    assert gpu_launch.triton_version("3.6.0") == (3, 6)
    assert gpu_launch.triton_version("3.5.0+git1a2b3c") == (3, 5)
    assert gpu_launch.triton_version("nightly") is None


def _computing_jit(calls):
    """A JITFunction whose Triton path and whose compiled launcher both compute out = x * a + BLOCK from
    the arguments they receive, as a compiled kernel would: the two paths give comparable results."""
    def kernel_source(x_ptr, out_ptr, a, BLOCK):
        pass

    class Compiled:
        function, packed_metadata = "function-handle", "packed-metadata"

        def run(self, *args):
            calls.append("direct")
            x, out, a, block = args[9:]
            out.copy_(x * a + block)

    jit = JITFunction(kernel_source)

    def run(x, out, a, *, grid, warmup, BLOCK, **options):
        calls.append("jit")
        out.copy_(x * a + BLOCK)
        return Compiled()

    jit.run = run
    return jit


@pytest.mark.parametrize("version", [(3, 99), (4, 0), None])
def test_unknown_triton_version_takes_tritons_path(fake_gpu, monkeypatch, version):
    """On a Triton release the direct path was not written for (or an unreadable version) every launch
    goes through kernel[grid](...), with the same results as the direct path on a known release."""
    x = torch.arange(8.0)

    def run_launches(calls):
        kernel = _computing_jit(calls)
        outs = []
        for a, block in ((2.0, 16), (3.0, 16), (0.5, 16), (2.0, 32), (-1.0, 32)):
            out = torch.empty(8)
            gpu_launch.launch(kernel, (1,), (x, out, a), {"BLOCK": block})
            outs.append(out)
        return outs

    known_calls, unknown_calls = [], []
    known = run_launches(known_calls)
    assert "direct" in known_calls
    monkeypatch.setattr(gpu_launch, "_COMPILED", {})
    monkeypatch.setattr(gpu_launch, "TRITON_VERSION", version)
    unknown = run_launches(unknown_calls)
    assert unknown_calls == ["jit"] * 5 and not gpu_launch._COMPILED
    for got, want in zip(unknown, known):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
