"""libs/gpu keeps its ports apart from its factories: ``inventory`` and ``monitor`` import no backend,
``backends`` is the one module that knows them all, and no import circle runs through the package
(imports inside functions count: they were how the circles were hidden)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import libs.gpu

PACKAGE = Path(libs.gpu.__file__).parent
ROOT = PACKAGE.parent.parent


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The libs.gpu modules ``path`` imports, anywhere in it (a package's ``__init__`` as ``libs.gpu``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m == "libs.gpu" or m.startswith("libs.gpu.")}


GRAPH = {_name(p): _imports(p) for p in sorted(PACKAGE.glob("*.py"))}


def _cycle_from(start: str) -> list[str] | None:
    """An import path from ``start`` back to itself, if any."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        module, path = stack.pop()
        for target in GRAPH.get(module, ()):
            if target == start:
                return [*path, target]
            if target not in seen:
                seen.add(target)
                stack.append((target, [*path, target]))
    return None


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_circle_runs_through(module: str) -> None:
    assert _cycle_from(module) is None, " -> ".join(_cycle_from(module) or [])


def test_the_ports_import_no_backend() -> None:
    backends = {"libs.gpu.fake", "libs.gpu.nvml", "libs.gpu.nvml_monitor", "libs.gpu.backends"}
    assert not GRAPH["libs.gpu.inventory"] & backends
    assert not GRAPH["libs.gpu.monitor"] & backends
    assert {"libs.gpu.fake", "libs.gpu.nvml", "libs.gpu.nvml_monitor"} <= GRAPH["libs.gpu.backends"]


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_each_module_imports_alone(module: str) -> None:
    """Imported first, in a fresh interpreter: a hidden circle fails here on a partly built module."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
