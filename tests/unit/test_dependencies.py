"""Every package pyproject.toml installs for everyone is imported by the library: no dead dependency."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "moe", "attention", "quant", "gpu")
IMPORT_NAME = {"pyyaml": "yaml"}  # distributions whose import name differs


def _imported_modules() -> set[str]:
    pattern = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", re.MULTILINE)
    return {m for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py") for m in pattern.findall(f.read_text())}


def test_every_dependency_is_imported():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() for d in deps]
    imported = _imported_modules()
    unused = [n for n in names if IMPORT_NAME.get(n, n.replace("-", "_")) not in imported]
    assert not unused, f"pyproject.toml dependencies no library module imports: {unused}"
