"""The bounded critical section: slow work outside the lock, a short locked re-check and write.

A swarm that holds one advisory lock across a slow step (a model call, an HTTP request, a heavy
query) runs one agent at a time: throughput tracks the slowest holder, not the number of agents.
This recipe keeps the slow step out of the lock:

1. read the shared row and its ``version`` (no lock, no open transaction);
2. compute the new value from what was read: the slow part, outside any lock and transaction;
3. open a short transaction, take ``pglockkit.xact_lock(ns, name, timeout)`` with a short timeout,
   read the version again, and write (version + 1) only if it is still the one step 1 read;
   otherwise another agent wrote meanwhile and this result is stale: recompute or give up.

The lock is held for the re-check and the write: milliseconds, whatever the computation costs.

    python3 examples/bounded_critical_section.py DSN

creates its demo tables if missing (``recipe_reports``, ``recipe_report_log``), registers the
namespace ``reports``, runs the demo with threads and prints what happened. The same statements in
plain SQL: ``sql/examples/bounded_critical_section.sql``; the explanation: ``docs/recipes.md``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

import pglockkit

NAMESPACE = "reports"

SETUP = """
CREATE TABLE IF NOT EXISTS recipe_reports (
    name       text PRIMARY KEY,
    version    bigint NOT NULL,
    body       jsonb NOT NULL,
    updated_by text NOT NULL,
    updated_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS recipe_report_log (
    name      text NOT NULL,
    version   bigint NOT NULL,
    based_on  bigint NOT NULL,
    writer    text NOT NULL,
    locked_at timestamptz NOT NULL,
    PRIMARY KEY (name, version)
)
"""

# Step 1: what the computation starts from. A missing row is version 0.
READ = "SELECT version, body FROM recipe_reports WHERE name = %s"
# Step 3, under the lock: the version again, and the server's clock (the log records when the
# lock was taken).
RECHECK = "SELECT (SELECT version FROM recipe_reports WHERE name = %s), clock_timestamp()"
WRITE = """
INSERT INTO recipe_reports (name, version, body, updated_by, updated_at)
VALUES (%(name)s, %(version)s, %(body)s, %(writer)s, clock_timestamp())
ON CONFLICT (name) DO UPDATE
   SET version = excluded.version, body = excluded.body,
       updated_by = excluded.updated_by, updated_at = excluded.updated_at
"""
LOG = """
INSERT INTO recipe_report_log (name, version, based_on, writer, locked_at)
VALUES (%(name)s, %(version)s, %(based_on)s, %(writer)s, %(locked_at)s)
"""


@dataclass
class Outcome:
    """What one ``bounded_update`` call did."""

    writer: str
    written: bool  # False: every try found the version changed, and the caller gave up
    version: int  # the version written, or the newer one that made the last try give up
    tries: int  # computations run (1 + recomputations)
    compute_s: float  # time spent computing, outside the lock, over all tries
    hold_s: list[float]  # per try: lock acquired -> transaction ended (an upper bound on the hold)


def setup(dsn: str) -> None:
    """Install pglockkit if missing, create the demo tables, register the namespace (idempotent)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("SELECT to_regnamespace('pglockkit') IS NULL").fetchone()[0]:
            pglockkit.install(dsn)
        conn.execute(SETUP)
        pglockkit.register_namespace(
            conn, NAMESPACE, description="shared reports: re-check a version under a short lock"
        )


def bounded_update(
    conn: psycopg.Connection,
    name: str,
    compute: Callable[[Any], Any],
    *,
    writer: str,
    timeout: float = 0.5,
    tries: int = 3,
    race_window: float = 0.0,
) -> Outcome:
    """Replace report ``name`` by ``compute(current body)``, computed outside any lock.

    ``conn`` is in autocommit mode. ``compute`` gets the body read in step 1 (None if the report
    does not exist yet) and returns the new body. If another writer wrote meanwhile, the result
    was computed from a stale body and is not written: with ``tries`` > 1 it is recomputed from
    the new body, after the last try the call gives up (``written`` False). ``timeout`` bounds the
    wait for the lock (``pglockkit.LockTimeout`` after it): the holders only re-check and write,
    so a wait longer than a few milliseconds means something is wrong.

    ``race_window`` (seconds, 0 in real use) sleeps between the re-check and the write, with the
    lock held: tests widen the window in which a writer without the lock would lose an update.
    """
    spent = 0.0
    holds: list[float] = []
    version = 0
    for attempt in range(1, tries + 1):
        row = conn.execute(READ, (name,)).fetchone()  # 1. read (autocommit: no lock, no transaction)
        read_version, body = row if row else (0, None)
        started = time.monotonic()
        new_body = compute(body)  # 2. the slow part: no lock held, no transaction open
        spent += time.monotonic() - started
        with conn.transaction():  # 3. the bounded critical section
            pglockkit.xact_lock(conn, NAMESPACE, name, timeout=timeout)
            locked = time.monotonic()
            version, locked_at = conn.execute(RECHECK, (name,)).fetchone()
            version = version or 0
            unchanged = version == read_version
            if unchanged:
                time.sleep(race_window)
                version = read_version + 1
                args = {"name": name, "version": version, "body": Jsonb(new_body), "writer": writer}
                conn.execute(WRITE, args)
                conn.execute(LOG, {**args, "based_on": read_version, "locked_at": locked_at})
        holds.append(time.monotonic() - locked)  # after COMMIT: the lock is released
        if unchanged:
            return Outcome(writer, True, version, attempt, spent, holds)
    return Outcome(writer, False, version, tries, spent, holds)


# --- the demo -----------------------------------------------------------------------------------

COMPUTE_S = 0.5  # stands for a model or API call


def _run_agents(dsn: str, n: int, work: Callable[[psycopg.Connection, str], Outcome]) -> list[Outcome]:
    """``n`` agents, each on its own connection, released together; their outcomes in order."""
    barrier = threading.Barrier(n)
    outcomes: list[Outcome | BaseException] = [RuntimeError("no outcome")] * n

    def agent(i: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                barrier.wait()
                outcomes[i] = work(conn, f"agent-{i + 1}")
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o
    return outcomes  # type: ignore[return-value]


def _slow_total(body: Any) -> dict:
    time.sleep(COMPUTE_S)  # the expensive call; its result does not depend on who else runs it
    return {"total": 1234}


def _slow_append(who: str) -> Callable[[Any], dict]:
    def compute(body: Any) -> dict:
        time.sleep(COMPUTE_S / 5)
        items = (body or {}).get("items", [])
        return {"items": [*items, who]}

    return compute


def _line(o: Outcome) -> str:
    hold = max(o.hold_s) * 1000
    if o.written:
        return (
            f"{o.writer}: wrote version {o.version} after {o.tries} computation(s) of "
            f"{o.compute_s / o.tries:.2f} s; lock held {hold:.1f} ms at most"
        )
    return (
        f"{o.writer}: version moved to {o.version} while computing: its result is stale, not written"
        f" (computed {o.compute_s:.2f} s outside the lock, lock held {hold:.1f} ms)"
    )


def demo(dsn: str, agents: int = 4) -> int:
    setup(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM recipe_report_log WHERE name IN ('daily-totals', 'team-list')")
        conn.execute("DELETE FROM recipe_reports WHERE name IN ('daily-totals', 'team-list')")

    print(f"1. {agents} agents refresh report daily-totals; each computation takes {COMPUTE_S} s")
    started = time.monotonic()
    refresh = _run_agents(
        dsn, agents, lambda c, who: bounded_update(c, "daily-totals", _slow_total, writer=who, tries=1)
    )
    wall = time.monotonic() - started
    for o in refresh:
        print("   " + _line(o))
    print(
        f"   wall time {wall:.2f} s for {agents} computations of {COMPUTE_S} s: they ran in parallel"
        f" (a lock held across them would take {agents * COMPUTE_S:.1f} s)"
    )

    print(f"2. {agents} agents each append their name to report team-list (recompute on conflict)")
    append = _run_agents(
        dsn,
        agents,
        lambda c, who: bounded_update(c, "team-list", _slow_append(who), writer=who, tries=agents),
    )
    for o in append:
        print("   " + _line(o))
    with psycopg.connect(dsn, autocommit=True) as conn:
        version, body = conn.execute(READ, ("team-list",)).fetchone()
    print(f"   team-list is at version {version} with {len(body['items'])} names: no update was lost")

    ok = sum(o.written for o in refresh) == 1 and version == agents == len(set(body["items"]))
    print("OK" if ok else "UNEXPECTED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dsn", help="a libpq connection string or URI")
    p.add_argument("--agents", type=int, default=4)
    args = p.parse_args(argv)
    return demo(args.dsn, args.agents)


if __name__ == "__main__":
    sys.exit(main())
