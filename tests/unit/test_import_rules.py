"""The import rules, checked on the source: services never import each other, and ``libs/`` never
imports upward (a service, the CLI or the simulator). Every import counts, at module level or inside
a function, relative ones resolved."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UPWARD = ("services", "gpuledger", "simulator")


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports (``from a import b`` counts as ``a`` and ``a.b``)."""
    me = _module(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}
    return found


def broken_rules(path: Path, root: Path = ROOT) -> list[str]:
    """The imports of ``path`` that break a rule, each with the rule."""
    me = _module(path, root)
    top = me.split(".")
    out = []
    for name in sorted(imports_of(path, root)):
        parts = name.split(".")
        if top[0] == "libs" and parts[0] in UPWARD:
            out.append(f"{me} imports {name}: libs/ never imports {parts[0]}/")
        elif top[0] == "services" and parts[0] == "services" and len(parts) > 1 and len(top) > 1 \
                and parts[1] != top[1]:
            out.append(f"{me} imports {name}: services/{top[1]} never imports services/{parts[1]}")
    return out


SOURCES = sorted(p for tree in ("libs", "services") for p in (ROOT / tree).rglob("*.py"))


def test_the_sources_are_found() -> None:
    assert any(p.parts[-3:] == ("services", "allocator", "app.py") for p in SOURCES)
    assert any(p.parts[-3:] == ("libs", "ledger", "state.py") for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_keep_the_rules(path: Path) -> None:
    assert broken_rules(path) == []


@pytest.mark.parametrize(("where", "source", "broken"), [
    ("libs/x/mod.py", "from services.allocator.handlers import Allocator", True),
    ("libs/x/mod.py", "def f():\n    import gpuledger.cli", True),
    ("libs/x/mod.py", "from simulator import api", True),
    ("libs/x/mod.py", "from libs.events import schema", False),
    ("services/allocator/mod.py", "from services.registrar import plugin", True),
    ("services/allocator/mod.py", "from services import registrar", True),
    ("services/allocator/mod.py", "from ..registrar import plugin", True),
    ("services/allocator/mod.py", "from services.allocator.handlers import Allocator", False),
    ("services/allocator/mod.py", "from . import handlers", False),
    ("services/allocator/mod.py", "from libs.placement import place", False),
])
def test_the_check_catches_a_broken_rule(tmp_path: Path, where: str, source: str, broken: bool) -> None:
    """The check itself can fail: a planted import that breaks a rule is reported."""
    path = tmp_path / where
    path.parent.mkdir(parents=True)
    path.write_text(source + "\n")
    assert bool(broken_rules(path, tmp_path)) is broken
