"""Named implementations of one kind (expert backends, attention backends, norm/RoPE impls, GDN op
sets, losses, dispatchers): the one registry helper, so every choice is made the same way.

    EXPERT_BACKENDS = Registry("expert backend", "model.expert_backend", auto=True)
    EXPERT_BACKENDS.declare("scattermoe", Capabilities(devices=("cuda",), auto_on=("cuda",), priority=2),
                            load=lambda: import_module("moe.backends.scattermoe").scattermoe_backend)
    @EXPERT_BACKENDS.register("eager", Capabilities(reference=True))
    def eager(...): ...
    EXPERT_BACKENDS.get("eager")          # the implementation (a declared one is imported on first get)

Every implementation declares what it can do (`Capabilities`) when it registers; runtime.plan matches a
config against these flags, resolves "auto" once and reports what cannot run here, before any process
group. Declaring a name imports nothing: a config names implementations whose packages (Triton, a kernel
library) are imported only when one is built. A lookup of a loaded name is a dict read, so it traces
inside torch.compile; the first `get` (at layer construction) does the import.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# Where a Triton kernel runs: TRITON_INTERPRET=1 (tests) runs it on the CPU, in fp32 at tiny shapes.
TRITON_DEVICES = ("cpu", "cuda") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)


def triton_missing() -> str | None:
    """Capabilities.unavailable of a Triton implementation."""
    return None if importlib.util.find_spec("triton") else "the triton package is not installed (pip install triton)"


@dataclass(frozen=True)
class Capabilities:
    """What an implementation can do; runtime.plan reads these flags, never the implementation's name."""
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types it runs on
    # Why it cannot run on this install (a missing package, a kernel that refuses this GPU), None when it
    # can; asked only at plan time (it may import the package).
    unavailable: Callable[[], str | None] | None = None
    auto_on: tuple[str, ...] = ()  # device types on which "auto" may pick it
    priority: int = 0  # "auto" takes the available candidate of highest priority
    compile: bool = True  # runs inside torch.compile(fullgraph=True)
    compile_quantized: tuple[str, ...] = ("mxfp4", "nvfp4", "fp8")  # ... also on these quantized base weights
    compile_cpu_dtypes: tuple[str, ...] = ("float32", "bfloat16")  # model.dtype it compiles in on the CPU
    ep: bool = True  # under expert parallelism (ep > 1)
    cp: bool = True  # under context parallelism (cp > 1)
    lora: bool = True  # with LoRA adapters
    quantized_base: tuple[str, ...] = ("mxfp4", "nvfp4", "fp8")  # frozen base weight formats it reads
    train_fp8: bool = False  # trains its expert GEMMs in FP8 (quant.train_fp8)
    compile_train_fp8: bool = True  # ... also inside torch.compile (where train_fp8)
    reference: bool = False  # the plainest implementation, the numerical reference (runtime.verify --exact)


class Registry(Generic[T]):
    def __init__(self, kind: str, config_key: str, auto: bool = False):
        self.kind = kind
        self.config_key = config_key
        self.offers_auto = auto  # runtime.plan resolves "auto"; the registry itself never does
        self._items: dict[str, T] = {}
        self._caps: dict[str, Capabilities] = {}
        self._loaders: dict[str, Callable[[], T]] = {}

    def declare(self, name: str, caps: Capabilities, load: Callable[[], T] | None = None) -> None:
        """Makes `name` known with its capabilities; `load` returns the implementation on first use (or the
        implementation registers itself under `name` when its module is imported by `load`)."""
        if name in self._caps:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._caps[name] = caps
        if load is not None:
            self._loaders[name] = load

    def register(self, name: str, caps: Capabilities | None = None) -> Callable[[T], T]:
        """Decorator: `item` is the implementation of `name` (declared now unless it was before)."""
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if name not in self._caps:
                self.declare(name, caps or Capabilities())
            self._items[name] = item
            return item
        return add

    def names(self) -> list[str]:
        """Every name a config may use (available here or not), and "auto" when offered."""
        return sorted({*self._caps, *(["auto"] if self.offers_auto else [])})

    def capabilities(self, name: str) -> Capabilities:
        self._check_known(name)
        return self._caps[name]

    def unavailable_reason(self, name: str, device_type: str) -> str | None:
        """Why `name` cannot run on `device_type` on this install, None when it can."""
        caps = self.capabilities(name)
        if device_type not in caps.devices:
            return f"it runs on {' or '.join(caps.devices)} only, and this machine has {device_type}"
        return caps.unavailable() if caps.unavailable is not None else None

    def candidates(self, device_type: str) -> list[str]:
        """The names "auto" may pick on `device_type`, best first (availability not yet checked)."""
        eligible = [n for n, c in self._caps.items() if device_type in c.auto_on]
        return sorted(eligible, key=lambda n: -self._caps[n].priority)

    def reference(self) -> str:
        """The registry's numerical reference (Capabilities.reference)."""
        return next(n for n, c in self._caps.items() if c.reference)

    def get(self, name: str) -> T:
        """The implementation of `name`, imported on first use. "auto" is refused: runtime.plan resolves it."""
        item = self._items.get(name)
        if item is not None:
            return item
        self._check_known(name)
        if name in self._loaders:
            loaded = self._loaders[name]()
            self._items.setdefault(name, loaded)
            return self._items[name]
        raise ValueError(f"{self.kind} {name!r} has no implementation loaded (config key {self.config_key})")

    def _check_known(self, name: str) -> None:
        if name == "auto" and self.offers_auto:
            raise ValueError(f"{self.kind} 'auto' is resolved by runtime.plan before anything is built; pass a "
                             f"concrete name, one of {sorted(self._caps)} (config key {self.config_key})")
        if name not in self._caps:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()} "
                             f"(config key {self.config_key})")
