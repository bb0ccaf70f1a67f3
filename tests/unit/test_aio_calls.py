"""The async layer cannot drift from the sync one, checked without a server: same names and
signatures, and every operation built from the same call description in ``pglockkit._calls``.
(The async operations against real servers: tests/sql/test_aio.py.)"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pglockkit
import pglockkit.aio as aio
from pglockkit import leases, locks, queue, runs, scheduling

PACKAGE = Path(pglockkit.__file__).parent
# Not database operations: the async module reuses them as they are.
NOT_DB = {"today_utc", "default_holder", "load_handler"}


def _public(module) -> dict[str, object]:
    return {
        name: obj
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
        and name not in NOT_DB
    }


def _shape(obj) -> list[tuple[str, object, object]]:
    target = obj.__init__ if inspect.isclass(obj) else inspect.unwrap(obj)
    return [(p.name, p.kind, p.default) for p in inspect.signature(target).parameters.values()]


def test_every_sync_operation_has_an_async_twin_with_the_same_signature():
    checked = []
    for module in (locks, leases, queue, runs, scheduling):
        for name, sync_obj in _public(module).items():
            if name == "Worker":
                continue  # the async API has no worker loop (yet): run the sync Worker in a thread
            assert hasattr(aio, name), f"pglockkit.aio has no {name} (from {module.__name__})"
            assert name in aio.__all__
            async_obj = getattr(aio, name)
            assert _shape(async_obj) == _shape(sync_obj), name
            if inspect.isfunction(sync_obj):
                wrapped = inspect.unwrap(async_obj)
                is_async = inspect.iscoroutinefunction(wrapped) or inspect.isasyncgenfunction(wrapped)
                assert is_async or name == "singleton", f"aio.{name} is not async"
            checked.append(name)
    assert {"xact_lock", "sole_writer", "Lease", "claim", "cancel", "run_once"} <= set(checked)
    assert aio.Job is queue.Job
    assert _shape(aio.retry)[1:4] == _shape(pglockkit.retry)[1:4]  # attempts, base, cap
    assert _shape(aio.set_server_keepalives) == _shape(pglockkit.connection.set_server_keepalives)
    assert _shape(aio.connect) == _shape(pglockkit.connect)


def _calls_used(path: Path) -> dict[str, set[str]]:
    """For each function and method in ``path`` (``Class.method``, ``__aenter__`` named
    ``__enter__``): the ``_calls`` builders and events it uses (not the runners, whose sync and
    async twins have two names: ``run``/``arun``, and ``try_key``/``atry_key`` and
    ``try_keys``/``atry_keys`` of the lock helpers' fast path)."""
    same = {"__aenter__": "__enter__", "__aexit__": "__exit__"}
    functions = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            functions += [
                (f"{node.name}.{same.get(f.name, f.name)}", f) for f in node.body if hasattr(f, "name")
            ]
        else:
            functions.append((getattr(node, "name", ""), node))
    return {
        name: {
            n.attr
            for n in ast.walk(node)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "_calls"
            and n.attr not in {"run", "arun", "try_key", "atry_key", "try_keys", "atry_keys"}
        }
        for name, node in functions
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def test_sync_and_async_operations_are_built_from_the_same_call_descriptions():
    # The async sources: aio.py, and the modules the sync ones are generated from (the same calls
    # by construction: tests/unit/test_generated.py).
    async_used = {**_calls_used(PACKAGE / "aio.py"), **_calls_used(PACKAGE / "locks_async.py")}
    async_used.update(_calls_used(PACKAGE / "queue_async.py"))
    async_used.update(_calls_used(PACKAGE / "runs_async.py"))
    compared = 0
    for module in ("locks", "leases", "queue", "runs", "connection"):
        for name, builders in _calls_used(PACKAGE / f"{module}.py").items():
            if not builders or name not in async_used:
                continue
            assert async_used[name] == builders, f"{module}.{name}"
            compared += 1
    assert compared >= 25
    # Neither layer holds SQL of its own: every statement is in _calls (the worker's LISTEN aside).
    for module in ("locks", "leases", "queue", "runs", "aio", "locks_async", "queue_async", "runs_async"):
        tree = ast.parse((PACKAGE / f"{module}.py").read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                assert "SELECT" not in node.value, f"{module}: {node.value!r}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                receiver = getattr(node.func.value, "id", None)
                assert node.func.attr != "execute" or receiver == "listener", f"{module}: execute"
