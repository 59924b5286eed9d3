"""Dependencies point one way: runtime -> moe, attention -> quant -> gpu (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"moe": {"runtime"}, "attention": {"runtime", "moe"}, "quant": {"runtime", "moe", "attention"},
             "gpu": {"runtime", "moe", "attention", "quant"}}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_upward(package):
    offenders = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & FORBIDDEN[package])
                 for p in (ROOT / package).rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}
