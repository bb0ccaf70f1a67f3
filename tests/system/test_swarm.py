"""A swarm: many jobs in flight per worker process on a few pool connections, under faults
(docs/queue.md, "Many jobs in flight"): SIGKILLed workers, terminated pool connections, a server
restart. Every effect exactly once, none lost."""

from __future__ import annotations

import threading

import psycopg
import pytest
from private import wait_for
from scenarios import assert_done_once, exactly_once_under_sigkill, stop_workers, worker_proc

from pglockkit import queue as q


def _count(conn, sql, params=()):
    return conn.execute(sql, params).fetchone()[0]


def _swarm(server_name: str) -> tuple[str, str]:
    """The handler and jobs in flight of a swarm worker process: asyncio with 500 in flight on
    PostgreSQL 18, threads with 200 (a thread per job in flight) on 15."""
    if server_name == "pg18":
        return "queue_handlers:record_async", "500"
    return "queue_handlers:record", "200"


@pytest.mark.slow
def test_two_swarm_workers_lose_nothing_while_one_is_sigkilled_about_every_second(server, db):
    """Two worker processes with 500 jobs in flight each (asyncio; 200 on threads) on a pool of 8
    connections drain 5,000 jobs of 0.3 s while one of them is SIGKILLed about every second and
    replaced: every job done, its handler's row written exactly once with its final claim's
    token, none lost (a job killed often enough would go dead, and the drain never end)."""
    db.conn.execute("CREATE TABLE done_log (job_id bigint, token bigint, pid int)")
    handler, in_flight = _swarm(server.name)
    stats = exactly_once_under_sigkill(
        db.conn,
        db.dsn,
        total=5000,
        workers=2,
        job_s=0.3,
        kill_every=(0.8, 1.2),
        max_attempts=50,
        extra=("--handler", handler, "--concurrency", in_flight, "--connections", "8", "--lease", "2s"),
    )
    assert stats["crashes"] == []
    assert stats["kills"] >= 3, stats
    assert stats["reclaimed"] > 0, stats  # the kills landed on jobs in flight
    assert_done_once(db.conn, 5000)


@pytest.mark.slow
def test_a_swarm_worker_goes_on_through_terminated_pool_connections_and_a_restart(server, private_server):
    """One worker process with 500 jobs in flight (asyncio; 200 on threads) on a pool of 6 drains
    2,000 jobs of 0.3 s while its pool connections are ended with pg_terminate_backend, one every
    0.3 s, and the server is restarted midway: every job done exactly once, the process never
    exits and never holds more than its 6 + 2 connections, and it stops cleanly."""
    dsn = private_server.dsn()
    total = 2000
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE done_log (job_id bigint, token bigint, pid int)")
        q.enqueue_many(conn, "w", [{"sleep": 0.3}] * total, max_attempts=50)
    handler, in_flight = _swarm(server.name)
    worker = worker_proc(
        dsn, "--handler", handler, "--concurrency", in_flight, "--connections", "6",
        "--lease", "2s", "--poll", "0.2",
    )  # fmt: skip
    # Its stderr read as it comes: 500 jobs in flight log a line per lost connection, and a pipe
    # left unread fills up (64 KB) and blocks the worker's writes, and with them its loop.
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(worker.stderr), daemon=True)
    reader.start()
    peak, terminated = 0, 0
    stop = threading.Event()

    def terminate() -> None:
        nonlocal peak, terminated
        while not stop.wait(0.3):
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as conn:
                    while not stop.wait(0.3):
                        n = conn.execute(
                            "SELECT count(*) FROM pg_stat_activity"
                            " WHERE application_name LIKE 'pglockkit worker w%'"
                        ).fetchone()[0]
                        peak = max(peak, n)
                        ended = conn.execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE application_name = 'pglockkit worker w' ORDER BY random() LIMIT 1"
                        ).fetchall()
                        terminated += len(ended)
            except psycopg.OperationalError:
                continue  # the server is restarting

    killer = threading.Thread(target=terminate)
    killer.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_for(
                "a third of the jobs done",
                lambda: _count(conn, "SELECT count(*) FROM done_log") > total // 3,
                60,
            )
        private_server.stop("fast")
        private_server.start()
        with psycopg.connect(dsn, autocommit=True) as conn:

            def drained() -> bool:
                assert worker.poll() is None, "the worker exited"
                return _count(conn, "SELECT count(*) FROM pglockkit.jobs WHERE status <> 'done'") == 0

            wait_for("the queue drained", drained, 120)
            assert_done_once(conn, total)
    finally:
        stop.set()
        killer.join(10)
        [(code, _)] = stop_workers([worker])
        reader.join(10)
    err = "".join(lines)
    assert code == 0, err[-3000:]
    assert "connection lost" in err and "Traceback" not in err, err[-3000:]
    assert terminated >= 5, terminated
    assert peak <= 6 + 2, peak


@pytest.mark.slow
def test_stop_returns_while_jobs_in_flight_wait_for_a_pool_the_server_does_not_answer(server, private_server):
    """30 jobs in flight on a pool of 2, the server frozen (a SIGSTOPped postmaster: connects
    hang until their 3 s timeout) and the pool's connections ended: the jobs queue for the pool
    while both of its places are taken by connects that hang. stop() must still return: a connect
    that failed did not wake the jobs queued behind it, and once the worker stopped they waited
    for ever. Asyncio on PostgreSQL 18, threads on 15."""
    import pglockkit

    dsn = private_server.dsn()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE done_log (job_id bigint, token bigint, pid int)")
        q.enqueue_many(conn, "w", [{"sleep": 1.0}] * 60)
    from queue_handlers import record, record_async

    handler = record_async if server.name == "pg18" else record
    worker = pglockkit.Worker(dsn, "w", handler, concurrency=30, connections=2, poll_interval=0.2)
    runner = threading.Thread(target=worker.run, daemon=True)
    pool = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pglockkit worker w'"
    with psycopg.connect(dsn, autocommit=True) as watch:
        runner.start()
        wait_for("30 jobs running", lambda: _count(watch, "SELECT count(*) FROM pglockkit.jobs"
                                                   " WHERE status = 'running'") >= 30, 20)  # fmt: skip
        # The handlers wake and want connections: two connects hang, the rest queue.
        terminate = pool.replace("count(*)", "pg_terminate_backend(pid)")
        alive, took = private_server.stop_worker_frozen(worker, runner, watch, terminate, 2.0, 15)
    assert not alive, f"run() had not returned {took:.1f} s after stop()"
