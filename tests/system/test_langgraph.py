"""One writer per graph with the real LangGraph: replicas (separate processes, released together by a barrier)
invoke one compiled graph through sole_writer; one runs, the others skip, and a graph that raises
still releases the lock. Runs examples/langgraph_replicas.py, sync and async, on both servers.

langgraph is in the ``dev`` extra: without it these tests fail, they are never skipped.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_replicas.py"


@pytest.fixture(scope="module")
def example():
    if importlib.util.find_spec("langgraph") is None:
        pytest.fail("langgraph is not installed: pip install -e '.[dev]' (or the 'langgraph' extra)")
    spec = importlib.util.spec_from_file_location("langgraph_replicas", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replica(dsn: str, name: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), "tick", dsn, "--replica", name, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _runs(db) -> list[tuple[str, str]]:
    return db.conn.execute("SELECT graph, replica FROM graph_runs ORDER BY id").fetchall()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_replicas_one_runs_one_skips_and_a_failing_graph_releases(
    db, example, tmp_path, mode, advisory_locks
):
    example.setup(db.dsn)
    flags = ["--async"] if mode == "async" else []
    start = tmp_path / "start"
    # Two replicas of restock_plan and one of another graph, which must not be blocked by them.
    procs = {
        name: _replica(db.dsn, name, "--graph", graph, "--start-file", str(start), *flags)
        for name, graph in (
            ("replica-a", "restock_plan"),
            ("replica-b", "restock_plan"),
            ("audit", "pack_audit"),
        )
    }
    for name, proc in procs.items():  # the barrier: every replica has imported langgraph and waits
        assert proc.stdout.readline().strip() == f"{name}: ready", proc.stderr.read()
    start.touch()
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        out[name] = stdout.strip()

    ran = [n for n in ("replica-a", "replica-b") if out[n].startswith(f"{n}: ran restock_plan")]
    skipped = [
        n for n in ("replica-a", "replica-b") if out[n] == f"{n}: skipped, another replica holds restock_plan"
    ]
    assert len(ran) == 1 and len(skipped) == 1, out
    assert out["audit"].startswith("audit: ran pack_audit"), out
    assert sorted(_runs(db)) == sorted([("restock_plan", ran[0]), ("pack_audit", "audit")])

    # A node that raises: the tick reports the failure, writes nothing, and frees the lock ... (in
    # this process: the replica processes above already showed the cross-process contract)
    def tick(replica, feed_down=False):
        if mode == "async":
            return asyncio.run(example.atick(db.dsn, "restock_plan", replica, feed_down))
        return example.tick(db.dsn, "restock_plan", replica, feed_down)

    assert (
        tick("replica-a", feed_down=True)
        == "replica-a: restock_plan failed with RuntimeError; lock still released"
    )
    assert advisory_locks(db.conn) == 0
    # ... so a third invocation acquires it and runs the graph.
    assert tick("replica-b").startswith("replica-b: ran restock_plan")
    assert [r for r in _runs(db) if r[0] == "restock_plan"] == [
        ("restock_plan", ran[0]),
        ("restock_plan", "replica-b"),
    ]
    assert advisory_locks(db.conn) == 0


def test_a_replica_skips_while_another_holds_the_graph_in_process(db, example):
    """The same decision without processes: while one tick holds the lock, a concurrent tick of
    the same graph skips at once (it does not wait for the holder's HOLD_S)."""
    example.setup(db.dsn)
    import pglockkit

    with pglockkit.sole_writer(db.dsn, example.NAMESPACE, "restock_plan") as mine:
        assert mine
        started = time.monotonic()
        line = example.tick(db.dsn, "restock_plan", "replica-b")
        assert line == "replica-b: skipped, another replica holds restock_plan"
        assert time.monotonic() - started < example.HOLD_S
    assert example.tick(db.dsn, "restock_plan", "replica-b").startswith("replica-b: ran restock_plan")
    assert _runs(db) == [("restock_plan", "replica-b")]
