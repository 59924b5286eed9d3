"""The registries a config chooses from, by config key. Each is owned by its package (a
gpu.registry.Registry filled where the implementations live), so the names are never repeated here.
Importing them imports no implementation (no Triton, no kernel module): runtime.plan resolves "auto" and
checks the choices against their declared capabilities.

    check_choice("model.expert_backend", "scattermoe")   # None, or the message naming the choices
"""

from __future__ import annotations

from attention.attention import ATTN_BACKENDS
from attention.gdn import GDN_OP_SETS
from attention.norm_rope import NORM_ROPE_IMPLS
from gpu.registry import Registry
from moe.backends import EXPERT_BACKENDS
from moe.dispatch import DISPATCHERS
from runtime.loss import LOSS_IMPLS

REGISTRIES: dict[str, Registry] = {r.config_key: r for r in (
    EXPERT_BACKENDS, ATTN_BACKENDS, NORM_ROPE_IMPLS, GDN_OP_SETS, DISPATCHERS, LOSS_IMPLS)}


def check_choice(config_key: str, name: str) -> str | None:
    """None when `name` is one of the key's registry's names (available here or not: a config may be
    checked on a machine other than the one it runs on), else why not."""
    registry = REGISTRIES[config_key]
    if name in registry.names():
        return None
    return f"unknown {registry.kind} {name!r}; choose one of {registry.names()}"
