"""Faults that adversarial passes and newcomers' runs found, each as a user met it: a test per
fault, named for what it survives, that failed on the code before its fix. Each runs on both
servers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import pglockkit
import pglockkit.aio as aio
from pglockkit import queue as q
from pglockkit.leases import Lease, acquire_lease

# --- idle_in_transaction_session_timeout ------------------------------------------------------

IDLE_IN_TRANSACTION_MS = 250  # what a DBA sets against bloat (managed services ship one too)
WAIT = 0.6  # a handler's wait on an API, outside the database: longer than the timeout


@pytest.fixture
def timed_out_idle(db):
    """A database whose sessions are ended when idle in a transaction for 250 ms, and a table for
    the handlers' effects."""
    db.conn.execute("CREATE TABLE effects (job_id bigint, n int)")
    db.conn.execute(
        f'ALTER DATABASE "{db.conn.info.dbname}" '
        f"SET idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_MS}"
    )
    return db


def _handlers(grouped: bool):
    """A sync and an async handler. ``grouped``: every sixth job waits before its one write, in a
    group whose transaction is open (the server sees it idle in transaction meanwhile). Else
    each job writes, waits, writes again: alone, its transaction began with the first write."""

    def sync(job, conn):
        if not grouped:
            conn.execute("INSERT INTO effects VALUES (%s, 1)", (job.id,))
        if job.payload["slow"]:
            time.sleep(WAIT)
        conn.execute("INSERT INTO effects VALUES (%s, 2)", (job.id,))

    async def asynchronous(job, conn):
        if not grouped:
            await conn.execute("INSERT INTO effects VALUES (%s, 1)", (job.id,))
        if job.payload["slow"]:
            await asyncio.sleep(WAIT)
        await conn.execute("INSERT INTO effects VALUES (%s, 2)", (job.id,))

    return sync, asynchronous


@pytest.mark.parametrize("grouped", [True, False], ids=["in-a-group", "alone"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_slow_job_survives_the_servers_idle_in_transaction_timeout_and_so_does_its_group(
    timed_out_idle, caplog, asynchronous, grouped
):
    """With the database's idle_in_transaction_session_timeout at 250 ms, a handler that waited
    600 ms on an API got its lane's session ended: the group rolled back ("lane error, group
    rolled back (terminating connection due to idle-in-transaction timeout)"), its jobs came back
    only by their lease, each losing an attempt, and fast jobs that never failed ended dead. The
    worker's own transactions now turn the timeout off for themselves: every job is done at its
    first attempt, its effects written once, with no lane error."""
    db = timed_out_idle
    caplog.set_level("WARNING", "pglockkit.queue")
    ids = q.enqueue_many(db.conn, "w", [{"slow": i % 6 == 5} for i in range(24)])
    sync, async_handler = _handlers(grouped)
    # group_time: grouped, every job after the first runs in a group; else each runs alone.
    options = {"concurrency": 2, "group_time": 30.0 if grouped else 0.0}
    if asynchronous:
        worker = aio.Worker(db.dsn, "w", async_handler, **options)
        runner = threading.Thread(target=lambda: asyncio.run(worker.run(exit_when_idle=True)))
    else:
        worker = pglockkit.Worker(db.dsn, "w", sync, **options)
        runner = threading.Thread(target=lambda: worker.run(exit_when_idle=True))
    runner.start()
    runner.join(60)
    assert not runner.is_alive()
    rows = db.conn.execute(
        "SELECT status, attempt, count(*) FROM pglockkit.jobs WHERE id = ANY(%s) GROUP BY 1, 2", (ids,)
    ).fetchall()
    assert rows == [("done", 1, 24)], [r.getMessage() for r in caplog.records]
    writes = db.conn.execute("SELECT count(*), count(DISTINCT (job_id, n)) FROM effects").fetchone()
    assert writes == ((24, 24) if grouped else (48, 48))
    assert worker.reconnects == 0
    assert not [r.getMessage() for r in caplog.records if "lane error" in r.getMessage()]
    # The timeout was off for the worker's transactions only: a session of the worker's role
    # still gets the database's value.
    with db.connect() as other:
        assert other.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0] == "250ms"


def test_session_lock_and_lease_holders_hold_no_transaction_the_timeout_could_end(timed_out_idle, ns):
    """sole_writer, run_once and a session-bound lease keep what they hold on connections of
    their own that are idle between calls, never idle in a transaction: the database's
    idle_in_transaction_session_timeout does not end them while their blocks run."""
    db = timed_out_idle
    holders = ("pglockkit sole_writer%", "pglockkit run %", "pglockkit lease %")
    states = (
        "SELECT state FROM pg_stat_activity WHERE application_name LIKE %s AND pid <> pg_backend_pid()"
    )
    with (
        pglockkit.sole_writer(db.dsn, ns, "tick") as mine,
        pglockkit.run_once(db.dsn, "nightly", "2026-12-07") as run,
        Lease(db.dsn, "bound", ttl=60, holder="holder", bind_session=True) as lease,
    ):
        assert mine and run is not None and lease.acquired
        time.sleep(3 * IDLE_IN_TRANSACTION_MS / 1000)
        for pattern in holders:
            assert db.conn.execute(states, (pattern,)).fetchall() == [("idle",)], pattern
        assert acquire_lease(db.conn, "bound", "rival", 60) is None
        with pglockkit.sole_writer(db.dsn, ns, "tick") as rival:
            assert not rival
        assert not lease.lost.is_set()
