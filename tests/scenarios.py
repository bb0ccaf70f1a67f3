"""Concurrency scenarios shared by tests that run them directly and through PgBouncer.

Each takes a DSN (or a connect function) to drive the load through, and a direct connection to
check the result on; it returns what it measured, and the test asserts. ``cli`` runs the
command-line tool as a user would.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from pglockkit import acquire_lease, check_fence, release_lease
from pglockkit import queue as q

HERE = Path(__file__).resolve().parent

# Worker processes started for a test; tests/conftest.py kills those still running when the test
# ends. A test that fails before it stops its worker would otherwise leave it claiming jobs, and
# reconnecting, in the databases of the tests after it (each test's database has the same name).
_spawned: list[subprocess.Popen] = []


# Fencing tokens carry the server's timeline less 1 in bits 47-62, above a sequence's value
# (docs/leases.md, "Tokens across a failover"); the tests' servers are fresh clusters, on
# timeline 1, whose epoch is 0. A promoted standby's first timeline is 2: epoch 1 << 47.
EPOCH = 0
PROMOTED_EPOCH = 1 << 47


def nth_token(n: int) -> int:
    """The ``n``-th token a fresh test server hands out for leases (or claims)."""
    return EPOCH | n


def track(proc: subprocess.Popen) -> subprocess.Popen:
    """Have ``proc`` killed when the current test ends, if it is still running then."""
    _spawned.append(proc)
    return proc


def reap() -> list[int]:
    """Kill the tracked processes still running; returns their pids."""
    killed = []
    while _spawned:
        proc = _spawned.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
            killed.append(proc.pid)
    return killed


def worker_proc(dsn: str, *extra: str) -> subprocess.Popen:
    """A ``pglockkit work`` process on queue ``w`` that records each job in ``done_log``."""
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    return track(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pglockkit.cli",
                "work",
                "--dsn",
                dsn,
                "--queue",
                "w",
                "--handler",
                "queue_handlers:record",
                *extra,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    )


def exactly_once_under_sigkill(
    conn: psycopg.Connection,
    worker_dsn: str,
    *,
    total: int,
    workers: int,
    seed: int = 7,
    timeout: float = 240,
    extra: tuple[str, ...] = (),
    job_s: float = 0.002,
    kill_every: tuple[float, float] = (0.2, 0.5),
    max_attempts: int = 5,
) -> dict[str, object]:
    """Enqueue ``total`` jobs on queue ``w`` (``conn`` needs table ``done_log``), drain them with
    ``workers`` worker processes (``pglockkit work`` with ``extra`` arguments) on ``worker_dsn``
    while a random one is SIGKILLed every ``kill_every`` seconds (0.2-0.5) and replaced. Returns
    kills, the stderr of workers that exited by themselves (``crashes``), recorded and distinct
    done_log rows, rows
    whose token is not the job's final one, and jobs that were reclaimed. Each job sleeps
    ``job_s`` in its handler."""
    # Each job takes ``job_s``: the drain lasts long enough that kills land on workers holding
    # claims (no-op jobs drain in a few tenths of a second, and a kill could find only workers
    # still starting, leaving nothing to reclaim).
    q.enqueue_many(conn, "w", [{"sleep": job_s}] * total, max_attempts=max_attempts)
    rng = random.Random(seed)
    args = ("--batch", "5", "--lease", "1s", "--poll", "0.2", *extra)
    procs = [worker_proc(worker_dsn, *args) for _ in range(workers)]
    kills = 0
    crashes: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE status <> 'done'").fetchone()[0]:
            if time.monotonic() > deadline:
                raise AssertionError("queue not drained in time")
            time.sleep(rng.uniform(*kill_every))
            for i, p in enumerate(procs):
                if p.poll() is not None:  # exited by itself: a worker bug, not a kill
                    crashes.append(f"exit {p.returncode}: {p.stderr.read()[-2000:]}")
                    p.stderr.close()
                    procs[i] = worker_proc(worker_dsn, *args)
            victim = rng.randrange(len(procs))
            procs[victim].kill()  # SIGKILL: no cleanup, claims left behind
            procs[victim].wait()
            kills += 1
            procs[victim] = worker_proc(worker_dsn, *args)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stderr.close()
    recorded, distinct = conn.execute("SELECT count(*), count(DISTINCT job_id) FROM done_log").fetchone()
    mismatched = conn.execute(
        "SELECT count(*) FROM done_log d JOIN pglockkit.jobs j ON j.id = d.job_id WHERE j.token <> d.token"
    ).fetchone()[0]
    reclaimed = conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE attempt > 1").fetchone()[0]
    return {
        "kills": kills,
        "crashes": crashes,
        "recorded": recorded,
        "distinct": distinct,
        "mismatched": mismatched,
        "reclaimed": reclaimed,
    }


def lease_contenders(
    connect: Callable[[], psycopg.Connection], conn: psycopg.Connection, *, contenders: int, seconds: float
) -> dict[str, object]:
    """``contenders`` threads, each on a connection from ``connect()``, take lease ``exclusive``
    in turn for ``seconds`` and record their holding intervals (fenced writes) in table
    ``intervals``, created here on ``conn``. Returns the thread errors, the number of intervals,
    open ones, distinct holders, overlapping pairs (checked in SQL), and whether tokens were handed
    out in time order, each larger than the one before (they may skip values: an acquirer that
    finds the row changed under it draws again)."""
    conn.execute("CREATE TABLE intervals (token bigint, holder text, s timestamptz, e timestamptz)")
    stop_at = time.monotonic() + seconds
    errors: list[BaseException] = []

    def contender(i: int) -> None:
        rng = random.Random(i)
        holder = f"c{i}"
        try:
            with connect() as c:
                while time.monotonic() < stop_at:
                    token = acquire_lease(c, "exclusive", holder, 5)
                    if token is None:
                        time.sleep(rng.uniform(0, 0.003))
                        continue
                    with c.transaction():
                        check_fence(c, "exclusive", token)
                        c.execute(
                            "INSERT INTO intervals VALUES (%s, %s, clock_timestamp(), NULL)", (token, holder)
                        )
                    time.sleep(rng.uniform(0, 0.005))
                    with c.transaction():
                        check_fence(c, "exclusive", token)
                        c.execute("UPDATE intervals SET e = clock_timestamp() WHERE token = %s", (token,))
                    if not release_lease(c, "exclusive", holder, token):
                        raise AssertionError(f"{holder} could not release token {token}")
        except Exception as exc:  # reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n, open_, holders = conn.execute(
        "SELECT count(*), count(*) FILTER (WHERE e IS NULL), count(DISTINCT holder) FROM intervals"
    ).fetchone()
    overlaps = conn.execute(
        """SELECT count(*) FROM intervals a JOIN intervals b
             ON a.token < b.token AND tstzrange(a.s, a.e) && tstzrange(b.s, b.e)"""
    ).fetchone()[0]
    tokens = [r[0] for r in conn.execute("SELECT token FROM intervals ORDER BY s")]
    return {
        "errors": errors,
        "intervals": n,
        "open": open_,
        "holders": holders,
        "overlaps": overlaps,
        "tokens_in_order": tokens == sorted(set(tokens)),
    }


def backwards_interval(conn: psycopg.Connection) -> str:
    """An interval that compares as positive (a month is 30 days there) but, added to the server's
    clock now, moves it backwards (calendar months are 28 to 31 days)."""
    for k in range(1, 13):
        for ttl in (f"{k} mon {-(30 * k - 1)} days -1 hour", f"{-k} mon {30 * k + 1} days -1 hour"):
            positive, forward = conn.execute(
                "SELECT %s::interval > '0', clock_timestamp() + %s::interval > clock_timestamp()", (ttl, ttl)
            ).fetchone()
            if positive and not forward:
                return ttl
    raise AssertionError("no interval found that is positive but moves today's clock backwards")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``pglockkit ARGS...`` in a subprocess, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "pglockkit.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def assert_done_once(conn: psycopg.Connection, total: int) -> None:
    """Every one of ``total`` jobs wrote its ``done_log`` row exactly once, with the token of its
    final claim."""
    recorded, distinct = conn.execute("SELECT count(*), count(DISTINCT job_id) FROM done_log").fetchone()
    assert recorded == distinct == total, (recorded, distinct, total)
    mismatched = conn.execute(
        "SELECT count(*) FROM done_log d JOIN pglockkit.jobs j ON j.id = d.job_id WHERE j.token <> d.token"
    ).fetchone()[0]
    assert mismatched == 0, f"{mismatched} rows written under a claim that was not the job's last"


def stop_workers(workers: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """SIGTERM each worker process (SIGKILL after 20 s); each one's exit status and stderr, also
    printed (pytest shows them when the test fails)."""
    for w in workers:
        w.send_signal(signal.SIGTERM)
    outputs = []
    for w in workers:
        try:
            outputs.append((w.wait(20), w.stderr.read()))
        except subprocess.TimeoutExpired:
            w.kill()
            outputs.append((w.wait(), w.stderr.read()))
    for code, err in outputs:
        print(f"worker exit {code}:\n{err[-3000:]}")
    return outputs
