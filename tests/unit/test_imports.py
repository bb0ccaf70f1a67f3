"""No module of the package imports, even lazily inside a function, a module that imports it back
(``_calls`` and ``connection`` once did: a cycle that only a function-level import kept from
failing at import time). The package's ``__init__`` modules are left out: they re-export."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pglockkit"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        if path.name == "__init__.py":
            continue
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pglockkit import _calls` imports the module pglockkit._calls
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [n for n in names if n in paths] or [node.module]
            else:
                continue
            edges.update(t for t in targets if t in paths and t != name and paths[t].name != "__init__.py")
    return graph


def test_the_package_has_no_import_cycle():
    graph = _graph()
    assert "pglockkit.worker.driver_async" in graph["pglockkit.worker.driver"]  # the graph sees lazy imports
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, cycles[:5]
