"""One writer per LangGraph graph across replicas, with pglockkit's sole_writer.

Every replica (pod, process) runs the same periodic tick: invoke the compiled graph. Through
``sole_writer`` exactly one replica runs it; the others skip at once (they never queue up behind
the winner to re-run a tick that already ran). The lock is a session lock on a dedicated,
unpooled connection, so it is released when the block ends, also when the graph raises, and by
the server when the replica dies.

    pip install 'pglockkit[langgraph]'
    python examples/langgraph_replicas.py setup DSN            # once: namespace and demo table
    python examples/langgraph_replicas.py tick DSN --replica a &
    python examples/langgraph_replicas.py tick DSN --replica b  # one runs, one skips

``--async`` invokes the graph with ``ainvoke`` under ``pglockkit.aio.sole_writer``;
``--feed-down`` makes the graph's node raise (the lock is released all the same);
``--start-file PATH`` holds the replica after start-up until PATH exists (a barrier for tests).
The node records each run in ``graph_runs``, the graph's only side effect.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import TypedDict

import psycopg
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

import pglockkit
import pglockkit.aio as aio

NAMESPACE = "graphs"
HOLD_S = 1.0  # widens the race window so the demo shows the skip; not a tuning value


class RestockState(TypedDict, total=False):
    feed_down: bool
    run_id: int


def setup(dsn: str) -> None:
    """Install pglockkit, register the namespace and create the node's table (idempotent)."""
    pglockkit.install(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        pglockkit.register_namespace(conn, NAMESPACE, description="one writer per LangGraph graph")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS graph_runs (id bigserial PRIMARY KEY, graph text NOT NULL,"
            " replica text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )


INSERT = "INSERT INTO graph_runs (graph, replica) VALUES (%s, %s) RETURNING id"


def _settings(config: RunnableConfig) -> tuple[str, str, str]:
    c = config["configurable"]
    return c["dsn"], c["graph"], c["replica"]


def plan(state: RestockState, config: RunnableConfig) -> RestockState:
    if state.get("feed_down"):
        raise RuntimeError("supplier feed down")
    dsn, graph, replica = _settings(config)
    with psycopg.connect(dsn, autocommit=True) as conn:
        run_id = conn.execute(INSERT, (graph, replica)).fetchone()[0]
    time.sleep(HOLD_S)
    return {"run_id": run_id}


async def aplan(state: RestockState, config: RunnableConfig) -> RestockState:
    if state.get("feed_down"):
        raise RuntimeError("supplier feed down")
    dsn, graph, replica = _settings(config)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        run_id = (await (await conn.execute(INSERT, (graph, replica))).fetchone())[0]
    await asyncio.sleep(HOLD_S)
    return {"run_id": run_id}


def build(node=plan):
    """The compiled graph: START -> plan -> END (a checkpointer would go in ``compile``)."""
    builder = StateGraph(RestockState)
    builder.add_node("plan", node)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", END)
    return builder.compile()


def _config(dsn: str, graph: str, replica: str) -> RunnableConfig:
    return {"configurable": {"dsn": dsn, "graph": graph, "replica": replica}}


def tick(dsn: str, graph: str, replica: str, feed_down: bool = False) -> str:
    """One replica's tick: run the graph if this replica wins ``graph``'s lock, else skip."""
    with pglockkit.sole_writer(dsn, NAMESPACE, graph) as mine:
        if not mine:
            return f"{replica}: skipped, another replica holds {graph}"
        try:
            out = build(plan).invoke({"feed_down": feed_down}, _config(dsn, graph, replica))
        except Exception as exc:
            return f"{replica}: {graph} failed with {type(exc).__name__}; lock still released"
        return f"{replica}: ran {graph} (run {out['run_id']})"


async def atick(dsn: str, graph: str, replica: str, feed_down: bool = False) -> str:
    """``tick`` for async code: ``ainvoke`` under ``aio.sole_writer``."""
    async with aio.sole_writer(dsn, NAMESPACE, graph) as mine:
        if not mine:
            return f"{replica}: skipped, another replica holds {graph}"
        try:
            out = await build(aplan).ainvoke({"feed_down": feed_down}, _config(dsn, graph, replica))
        except Exception as exc:
            return f"{replica}: {graph} failed with {type(exc).__name__}; lock still released"
        return f"{replica}: ran {graph} (run {out['run_id']})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["setup", "tick"])
    p.add_argument("dsn")
    p.add_argument("--replica", default="replica")
    p.add_argument("--graph", default="restock_plan")
    p.add_argument("--feed-down", action="store_true", help="the graph's node raises")
    p.add_argument("--async", dest="use_async", action="store_true", help="ainvoke under aio.sole_writer")
    p.add_argument("--start-file", type=Path, help="wait until this file exists before the tick")
    args = p.parse_args(argv)
    if args.command == "setup":
        setup(args.dsn)
        return 0
    if args.start_file is not None:
        print(f"{args.replica}: ready", flush=True)
        while not args.start_file.exists():
            time.sleep(0.005)
    if args.use_async:
        line = asyncio.run(atick(args.dsn, args.graph, args.replica, args.feed_down))
    else:
        line = tick(args.dsn, args.graph, args.replica, args.feed_down)
    print(line, flush=True)
    return 1 if " failed with " in line else 0


if __name__ == "__main__":
    sys.exit(main())
