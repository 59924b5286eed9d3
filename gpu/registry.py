"""Named implementations of one kind (expert backends, attention backends, norm/RoPE impls, GDN op
sets, dispatchers): the one registry helper, so every choice is made the same way.

    EXPERT_BACKENDS = Registry("expert backend", "model.expert_backend")
    @EXPERT_BACKENDS.register("eager")
    def eager(...): ...
    EXPERT_BACKENDS.get("eager")          # the implementation; unknown names raise, naming the key
    EXPERT_BACKENDS.resolve("auto")       # "auto" -> a name, decided by the owner's `auto` function

The owning package creates its registry, registers its implementations when it is imported and, if
it offers "auto", passes the function that resolves it. A lookup is a dict read, so it traces inside
torch.compile. An implementation that cannot run here (a missing package) is registered as
unavailable with the reason, which `get` reports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, config_key: str, auto: Callable[[], str] | None = None):
        self.kind = kind
        self.config_key = config_key
        self._auto = auto
        self._items: dict[str, T] = {}
        self._unavailable: dict[str, str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = item
            return item
        return add

    def unavailable(self, name: str, reason: str) -> None:
        """`name` exists but cannot run here; `reason` says why and how to install what it needs."""
        self._unavailable[name] = reason

    def is_available(self, name: str) -> bool:
        """Whether `name` is registered and can run here (not merely known)."""
        return name in self._items

    def names(self) -> list[str]:
        """Every name a config may use: registered, unavailable here, and "auto" when offered."""
        return sorted({*self._items, *self._unavailable, *(["auto"] if self._auto else [])})

    def resolve(self, name: str) -> str:
        if name == "auto" and self._auto is not None:
            return self._auto()
        if name in self._items:
            return name
        if name in self._unavailable:
            raise RuntimeError(f"{self.kind} {name!r} cannot be used here: {self._unavailable[name]} "
                               f"(config key {self.config_key})")
        raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()} "
                         f"(config key {self.config_key})")

    def get(self, name: str) -> T:
        return self._items[self.resolve(name)]
