"""Dependencies point one way: runtime -> moe, attention -> quant -> gpu (ARCHITECTURE.md), and no two runtime
modules import each other, not even through a function-level import."""

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


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "runtime") -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports anywhere in its body (function-level imports too). A
    module imported from outside its package also imports that package's __init__."""
    paths = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    here = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                    base = ".".join(here + ([base] if base else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names}
        edges = set()
        for target in targets:
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                prefix = ".".join(parts[:i])
                inside = name == prefix or name.startswith(prefix + ".")
                if prefix in paths and prefix != name and (i == len(parts) or not inside):
                    edges.add(prefix)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycle_among_runtime_modules():
    cycle = find_cycle(import_graph(ROOT))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_function_level_import(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "__init__.py").write_text("")
    (tmp_path / "runtime" / "a.py").write_text("from runtime.b import f\n")
    (tmp_path / "runtime" / "b.py").write_text("def f():\n    from runtime import a\n")
    (tmp_path / "runtime" / "c.py").write_text("import runtime.a\n")
    assert find_cycle(import_graph(tmp_path)) == ["runtime.a", "runtime.b", "runtime.a"]
