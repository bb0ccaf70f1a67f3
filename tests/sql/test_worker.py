"""The worker: many jobs in flight per process, group commit, at-least-once handlers, the async
twin, and what it does when handlers, other sessions and signals get in the way. Each test runs
on both servers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from queue_handlers import record, span, span_async
from scenarios import exactly_once_under_sigkill, worker_proc

import pglockkit
import pglockkit.aio as aio
from pglockkit import queue as q


@pytest.fixture
def tables(db):
    db.conn.execute("CREATE TABLE done_log (job_id bigint, token bigint, pid int)")
    db.conn.execute("CREATE TABLE spans (job_id bigint, key text, s timestamptz, e timestamptz)")
    return db


def _max_overlap(conn, key: str | None = None) -> int:
    """The most handlers that ran at the same instant (checked at every start)."""
    return conn.execute(
        """SELECT coalesce(max(n), 0) FROM (
             SELECT (SELECT count(*) FROM spans b
                      WHERE b.s <= a.s AND a.s < b.e AND (%(k)s::text IS NULL OR b.key = %(k)s)) AS n
               FROM spans a WHERE %(k)s::text IS NULL OR a.key = %(k)s) x""",
        {"k": key},
    ).fetchone()[0]


@pytest.mark.parametrize("handler", [span, span_async], ids=["threads", "asyncio"])
def test_concurrency_keeps_n_jobs_in_flight_and_never_more(tables, handler):
    db = tables
    q.enqueue_many(db.conn, "w", [{"sleep": 0.15}] * 24)
    started = time.monotonic()
    assert pglockkit.Worker(db.dsn, "w", handler, concurrency=4).run(exit_when_idle=True) == 24
    elapsed = time.monotonic() - started
    assert db.conn.execute("SELECT count(DISTINCT job_id) FROM spans").fetchone()[0] == 24
    assert _max_overlap(db.conn) == 4
    assert elapsed < 24 * 0.15 / 2  # one at a time would take 3.6 s; four at a time about 0.9


@pytest.mark.parametrize("handler", [span, span_async], ids=["threads", "asyncio"])
def test_concurrency_respects_per_key_limits(tables, handler):
    db = tables
    for i in range(12):
        q.enqueue(
            db.conn, "w", {"sleep": 0.1, "key": "tenant:1"}, concurrency_key="tenant:1", concurrency_limit=2
        )
        q.enqueue(db.conn, "w", {"sleep": 0.1, "key": f"other:{i}"})
    assert pglockkit.Worker(db.dsn, "w", handler, concurrency=6).run(exit_when_idle=True) == 24
    assert _max_overlap(db.conn, "tenant:1") == 2  # the key's limit, reached and never passed
    assert _max_overlap(db.conn) > 2  # other keys ran beside it


@pytest.mark.parametrize("handler", [span, span_async], ids=["threads", "asyncio"])
def test_jobs_in_flight_share_a_pool_of_connections_plus_two(tables, handler):
    """docs/queue.md: a job holds a connection only while it uses one. 12 jobs in flight that each
    wait 0.2 s and then write, on a pool of 3: all 12 run at once (a lane per connection ran 3 at
    a time), and the process never holds more than its 3 plus LISTEN and the heartbeat, sampled
    from pg_stat_activity while it drains. Once it returns, all of them are closed."""
    db = tables
    q.enqueue_many(db.conn, "w", [{"sleep": 0.2}] * 36)
    worker = pglockkit.Worker(db.dsn, "w", handler, concurrency=12, connections=3)
    peak: dict[str, int] = {}
    sampling = threading.Event()

    def sample() -> None:
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            while not sampling.is_set():
                for app, n in conn.execute(
                    "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = "
                    "current_database() AND application_name LIKE 'pglockkit worker w%' GROUP BY 1"
                ):
                    peak[app] = max(peak.get(app, 0), n)
                time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.monotonic()
    try:
        assert worker.run(exit_when_idle=True) == 36
    finally:
        elapsed = time.monotonic() - started
        sampling.set()
        sampler.join(10)
    assert db.conn.execute("SELECT count(DISTINCT job_id) FROM spans").fetchone()[0] == 36
    assert _max_overlap(db.conn) == 12
    assert elapsed < 36 * 0.2 / 3 * 0.75, elapsed  # 3 at a time: 2.4 s; 12 at a time about 0.6
    assert peak == {
        "pglockkit worker w": 3,
        "pglockkit worker w listen": 1,
        "pglockkit worker w heartbeat": 1,
    }
    deadline = time.monotonic() + 10  # and all of them closed once it returned
    while db.conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'pglockkit worker w%%'"
    ).fetchone()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_group_commits_once_and_a_failing_handler_loses_only_its_own_writes(tables):
    db = tables
    ids = q.enqueue_many(db.conn, "w", [{"n": i} for i in range(6)])

    def handler(job, conn):
        conn.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))
        if job.payload["n"] == 2:
            raise RuntimeError("no luck")

    worker = pglockkit.Worker(db.dsn, "w", handler, batch=6, group=32, group_time=30)
    assert worker.run(max_jobs=6) == 6
    logged = [r[0] for r in db.conn.execute("SELECT job_id FROM done_log ORDER BY job_id")]
    assert logged == [i for i in ids if i != ids[2]]  # the failed job's own insert rolled back
    # The jobs after the first (claimed alone, before the lane had timed a job) completed in one
    # transaction (each handler's insert ran in a subtransaction of it: an xmin of its own).
    xmins = db.conn.execute(
        "SELECT count(DISTINCT xmin::text) FROM pglockkit.jobs WHERE id = ANY(%s)", (ids[1:],)
    ).fetchone()[0]
    assert xmins == 1
    status, attempt, error, later = db.conn.execute(
        "SELECT status, attempt, last_error, run_at > clock_timestamp() FROM pglockkit.jobs WHERE id = %s",
        (ids[2],),
    ).fetchone()
    assert (status, attempt, later) == ("queued", 1, True) and "RuntimeError: no luck" in error


def _children(db) -> None:
    db.conn.execute("CREATE TABLE parents (id int PRIMARY KEY)")
    db.conn.execute(
        "CREATE TABLE children (job_id bigint, parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED)"
    )


def _adopt(job, conn):
    conn.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))
    if job.payload["parent"] is not None:
        conn.execute("INSERT INTO children VALUES (%s, %s)", (job.id, job.payload["parent"]))


async def _adopt_async(job, conn):
    await conn.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))
    if job.payload["parent"] is not None:
        await conn.execute("INSERT INTO children VALUES (%s, %s)", (job.id, job.payload["parent"]))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_deferred_constraint_a_handler_breaks_fails_its_job_not_its_group(tables, asynchronous):
    """A deferred constraint (Django makes every foreign key DEFERRABLE INITIALLY DEFERRED) is
    checked at COMMIT, not when the handler's savepoint is released: one handler that breaks one
    rolled the whole group back at its commit ("lane error, group rolled back"). The group's other
    jobs, whose handlers had succeeded, went back by their lease, an attempt burned each time they
    met the bad job in a group again; in 5 s none was done and all were on their 5th attempt, to
    die as 'lease expired'. The bad job's own error was never recorded."""
    db = tables
    _children(db)
    ids = q.enqueue_many(db.conn, "w", [{"parent": 7 if i == 3 else None} for i in range(6)])
    bad = ids[3]
    cls, h = (aio.Worker, _adopt_async) if asynchronous else (pglockkit.Worker, _adopt)
    worker = cls(db.dsn, "w", h, batch=6, group=32, group_time=30, lease=1)
    if asynchronous:
        thread = threading.Thread(target=lambda: asyncio.run(worker.run()))
    else:
        thread = threading.Thread(target=worker.run)
    thread.start()
    others = [i for i in ids if i != bad]
    try:
        deadline = time.monotonic() + 6
        while (
            time.monotonic() < deadline
            and db.conn.execute(
                "SELECT count(*) FROM pglockkit.jobs WHERE id = ANY(%s) AND status <> 'done'", (others,)
            ).fetchone()[0]
        ):
            time.sleep(0.1)
    finally:
        worker.stop()
        thread.join(20)
    rows = db.conn.execute(
        "SELECT id, status, attempt FROM pglockkit.jobs WHERE id = ANY(%s) ORDER BY id", (others,)
    ).fetchall()
    assert [r[1:] for r in rows] == [("done", 1)] * 5, rows
    assert sorted(r[0] for r in db.conn.execute("SELECT job_id FROM done_log")) == others
    error = db.conn.execute("SELECT last_error FROM pglockkit.jobs WHERE id = %s", (bad,)).fetchone()[0]
    assert error is not None and "children" in error, error  # the foreign key's violation, recorded


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_job_alone_whose_commit_fails_records_the_commits_error(tables, asynchronous):
    """A job that runs alone (the only one in hand) and breaks a deferred constraint fails at its
    own COMMIT: that was taken for a failed claim ("claim failed, retried later"), then a lane
    error, and the job came back by its lease until it died as 'lease expired'. It is a failed
    attempt now, with the COMMIT's error, retried with backoff like any handler's failure."""
    db = tables
    _children(db)
    (bad,) = q.enqueue_many(db.conn, "w", [{"parent": 7}], max_attempts=2)
    cls, h = (aio.Worker, _adopt_async) if asynchronous else (pglockkit.Worker, _adopt)
    worker = cls(db.dsn, "w", h, lease=30)
    run = worker.run(exit_when_idle=True)
    assert (asyncio.run(run) if asynchronous else run) == 1
    assert worker.reconnects == 0  # no lane error
    status, attempt, error, later = db.conn.execute(
        "SELECT status, attempt, last_error, run_at > clock_timestamp() FROM pglockkit.jobs WHERE id = %s",
        (bad,),
    ).fetchone()
    assert (status, attempt, later) == ("queued", 1, True), (status, attempt, error)
    assert "ForeignKeyViolation" in error and "children" in error, error
    assert db.conn.execute("SELECT count(*) FROM done_log").fetchone()[0] == 0  # its writes rolled back


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_group_failing_at_commit_keeps_raised_failures_and_runs_the_rest_alone(tables, asynchronous):
    """After a group's COMMIT fails, the failures its handlers raised are recorded as they were
    (their writes were undone with their savepoints), and its other jobs run again, one per
    transaction: each is done once, only the job whose writes cannot commit fails, and no lane
    error is logged."""
    db = tables
    _children(db)
    payloads = [{"parent": None}, {"parent": None}, {"parent": None, "raise": True}, {"parent": 7}]
    first, ok, raised, bad = q.enqueue_many(db.conn, "w", [*payloads, {"parent": None}])[:4]

    def handler(job, conn):
        _adopt(job, conn)
        if job.payload.get("raise"):
            raise RuntimeError("no luck")

    async def ahandler(job, conn):
        await _adopt_async(job, conn)
        if job.payload.get("raise"):
            raise RuntimeError("no luck")

    worker = (aio.Worker if asynchronous else pglockkit.Worker)(
        db.dsn, "w", ahandler if asynchronous else handler, batch=6, group=32, group_time=30
    )
    run = worker.run(exit_when_idle=True)  # the failed jobs' retries are not due yet
    assert (asyncio.run(run) if asynchronous else run) == 5
    assert worker.reconnects == 0
    rows = dict(
        (r[0], r[1:]) for r in db.conn.execute("SELECT id, status, attempt, last_error FROM pglockkit.jobs")
    )
    assert [rows[i][:2] for i in (raised, bad)] == [("queued", 1)] * 2, rows
    assert "RuntimeError: no luck" in rows[raised][2] and "children" in rows[bad][2], rows
    done = sorted(i for i, r in rows.items() if r[:2] == ("done", 1))
    assert len(done) == 3 and first in done and ok in done, rows
    assert sorted(r[0] for r in db.conn.execute("SELECT job_id FROM done_log")) == done  # once each


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_handler_that_exits_or_meets_a_cancelled_task_fails_its_job_not_its_lane(tables, asynchronous):
    """sys.exit() in a handler (SystemExit) ended its lane's thread without a word: run() returned
    with jobs left, the job running until its lease. An async handler awaiting a task someone
    cancelled got CancelledError, which ended the whole async worker, and the next worker to run
    the job too. Each is the job's failure now, like any exception."""
    db = tables
    bad, *rest = q.enqueue_many(db.conn, "w", [{"bad": True}] + [{}] * 4)

    def handler(job, conn):
        if job.payload.get("bad"):
            raise SystemExit(3)
        conn.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))

    async def ahandler(job, conn):
        if job.payload.get("bad"):
            sub = asyncio.ensure_future(asyncio.sleep(10))
            sub.cancel()
            await sub
        await conn.execute(
            "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token)
        )

    if asynchronous:
        done = asyncio.run(aio.Worker(db.dsn, "w", ahandler, lease=30).run(exit_when_idle=True))
    else:
        done = pglockkit.Worker(db.dsn, "w", handler, lease=30).run(exit_when_idle=True)
    assert done == 5
    assert sorted(r[0] for r in db.conn.execute("SELECT job_id FROM done_log")) == sorted(rest)
    status, attempt, error = db.conn.execute(
        "SELECT status, attempt, last_error FROM pglockkit.jobs WHERE id = %s", (bad,)
    ).fetchone()
    assert (status, attempt) == ("queued", 1) and (
        "CancelledError" if asynchronous else "SystemExit"
    ) in error


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
@pytest.mark.parametrize(
    ("message", "recorded"),
    [
        ("unexpected bytes b'\x00\x01' in row 7\x00", "unexpected bytes b'\\x00\x01' in row 7\\x00"),
        ("cannot parse report-\udcff.csv", "cannot parse report-\\udcff.csv"),
    ],
    ids=["nul", "lone-surrogate"],
)
def test_a_handler_error_the_server_cannot_store_as_is_is_recorded_escaped(
    tables, asynchronous, message, recorded
):
    """PostgreSQL text cannot hold a NUL byte, and psycopg cannot encode a lone surrogate (a file
    name read from a non-UTF-8 directory, os.fsdecode's surrogateescape): fail_job raised, the
    lane's group rolled back, and the job ran again after its lease without an error recorded.
    Both are recorded escaped, and the other jobs are done once."""
    db = tables
    bad, *rest = q.enqueue_many(db.conn, "w", [{"bad": True}] + [{}] * 4)

    def handler(job, conn):
        if job.payload.get("bad"):
            raise ValueError(message)
        conn.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))

    async def ahandler(job, conn):
        if job.payload.get("bad"):
            raise ValueError(message)
        await conn.execute(
            "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token)
        )

    if asynchronous:
        done = asyncio.run(aio.Worker(db.dsn, "w", ahandler, lease=30, group=4).run(exit_when_idle=True))
    else:
        done = pglockkit.Worker(db.dsn, "w", handler, lease=30, group=4).run(exit_when_idle=True)
    assert done == 5
    assert sorted(r[0] for r in db.conn.execute("SELECT job_id FROM done_log")) == sorted(rest)
    status, attempt, error = db.conn.execute(
        "SELECT status, attempt, last_error FROM pglockkit.jobs WHERE id = %s", (bad,)
    ).fetchone()
    assert (status, attempt, error) == ("queued", 1, f"ValueError: {recorded}")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_stop_during_an_outage_returns_at_once(tables, asynchronous):
    """stop() (SIGTERM) while the database refuses connections: the lanes went on retrying, each
    try waiting out the pool's timeout, and the listener reconnected in a tight loop (its pause
    is 0 once stopping), so the worker never returned."""
    db = tables
    app = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pglockkit worker w%%'"

    def handler(job, conn):
        conn.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))

    async def ahandler(job, conn):
        await conn.execute(
            "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token)
        )

    worker = pglockkit.Worker(db.dsn, "w", ahandler if asynchronous else handler, concurrency=2)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while db.conn.execute(app).fetchone()[0] < 3:  # the pool's claims, the heartbeat, the listener
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with psycopg.connect(db.server.dsn(), autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{db.conn.info.dbname}" ALLOW_CONNECTIONS false')
        try:
            db.conn.execute(app.replace("count(*)", "pg_terminate_backend(pid)"))
            time.sleep(1.0)
            before = worker.reconnects
            worker.stop()
            thread.join(10)
            alive, attempts = thread.is_alive(), worker.reconnects - before
        finally:
            admin.execute(f'ALTER DATABASE "{db.conn.info.dbname}" ALLOW_CONNECTIONS true')
            thread.join(90)
    assert not alive and attempts < 50, (alive, attempts)


def test_jobs_left_in_hand_by_a_slow_group_keep_their_lease(tables):
    """A group locks every job in hand, and the heartbeat skips locked rows: while a slow job ran,
    the unstarted jobs' leases ran out, and once the group committed another worker reclaimed
    them (here, with max_attempts 1, buried them dead) while this worker went on to run them.
    The group's commit renews them now."""
    db = tables
    ids = q.enqueue_many(db.conn, "w", [{}, {"sleep": 1.5}, {"sleep": 0.3}, {}], max_attempts=1)
    ran: list[int] = []

    def handler(job, conn):
        ran.append(job.id)
        time.sleep(job.payload.get("sleep", 0))
        conn.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))

    worker = pglockkit.Worker(db.dsn, "w", handler, batch=3, group_time=0.2, lease=0.6)
    thread = threading.Thread(target=worker.run, kwargs={"exit_when_idle": True})
    thread.start()
    deadline = time.monotonic() + 15
    while db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE status = 'running'").fetchone()[0] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with db.connect() as other:  # another worker's claims: nothing is queued, so only reclaims
        while thread.is_alive():
            assert q.claim(other, "w", "other", lease=30) == []
            time.sleep(0.005)
    thread.join(20)
    assert sorted(ran) == ids
    rows = db.conn.execute(
        "SELECT id, status, attempt, last_error FROM pglockkit.jobs ORDER BY id"
    ).fetchall()
    assert rows == [(i, "done", 1, None) for i in ids]


def test_no_other_session_can_take_a_job_of_an_open_group_even_after_its_lease(tables):
    """The group locks its jobs' rows until it commits: with a lease of 0.3 s and a handler of 1 s,
    the leases run out, yet a claimer gets none of them and a cancel waits, then finds them done."""
    db = tables
    ids = q.enqueue_many(db.conn, "w", [{"sleep": 0}, {"sleep": 1.0}, {"sleep": 0}])
    worker = pglockkit.Worker(db.dsn, "w", record, batch=3, group_time=30, lease=0.3)
    thread = threading.Thread(target=worker.run, kwargs={"max_jobs": 3})
    thread.start()
    time.sleep(0.6)  # the group holds all three; the leases have expired
    expired = db.conn.execute(
        "SELECT count(*) FROM pglockkit.jobs "
        "WHERE status = 'running' AND lease_expires_at < clock_timestamp()"
    ).fetchone()[0]
    stolen = q.claim(db.conn, "w", "thief", batch=10)
    cancelled = q.cancel(db.conn, ids[2])  # waits for the group's commit
    thread.join(20)
    assert expired >= 2 and stolen == [] and cancelled is False
    assert [r[0] for r in db.conn.execute("SELECT job_id FROM done_log ORDER BY job_id")] == ids
    assert db.conn.execute("SELECT DISTINCT status, attempt FROM pglockkit.jobs").fetchall() == [("done", 1)]


ENDINGS = {  # how a handler tries to end the worker's transaction -> (the job's error, first insert kept)
    "commit()": ("must not commit or roll back", False),  # refused: rolled back with its savepoint
    "rollback()": ("must not commit or roll back", False),
    "COMMIT": ("ended the worker's transaction", True),  # sent as SQL: already committed
    "ROLLBACK": ("ended the worker's transaction", False),
    "ROLLBACK; BEGIN": ("ended the worker's transaction", False),  # a transaction of its own
}


async def _end_async(conn, how: str) -> None:
    if how in ("commit()", "rollback()"):
        await (conn.commit() if how == "commit()" else conn.rollback())
    for statement in how.split("; "):
        await conn.execute(statement)


def _hiding(how: str):
    """After COMMIT or ROLLBACK as SQL, a handler that swallows the refusal of its next statement."""
    return contextlib.nullcontext() if how.endswith("()") else contextlib.suppress(psycopg.ProgrammingError)


def _end(conn, how: str) -> None:
    if how in ("commit()", "rollback()"):
        return conn.commit() if how == "commit()" else conn.rollback()
    for statement in how.split("; "):
        conn.execute(statement)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
@pytest.mark.parametrize("how", list(ENDINGS))
def test_a_handler_that_ends_the_transaction_fails_its_job_and_the_worker_goes_on(tables, how, asynchronous):
    """conn.commit() and conn.rollback() are refused inside a handler, so its writes roll back
    with its savepoint; COMMIT or ROLLBACK sent as SQL is found by the handler's next statement,
    which is refused (in autocommit it would be written at once), and the job fails. A BEGIN of
    the handler's own after its ROLLBACK is rolled back too."""
    db = tables
    error, kept = ENDINGS[how]
    bad, good = q.enqueue_many(db.conn, "w", [{"end": True}, {}])
    insert = "INSERT INTO done_log (job_id, token) VALUES (%s, %s)"

    def handler(job, conn):
        conn.execute(insert, (job.id, 1))
        if job.payload.get("end"):
            with _hiding(how):
                _end(conn, how)
            conn.execute(insert, (job.id, 2))

    async def ahandler(job, conn):
        await conn.execute(insert, (job.id, 1))
        if job.payload.get("end"):
            with _hiding(how):
                await _end_async(conn, how)
            await conn.execute(insert, (job.id, 2))

    if asynchronous:
        assert asyncio.run(aio.Worker(db.dsn, "w", ahandler, batch=1).run(max_jobs=2)) == 2
    else:
        assert pglockkit.Worker(db.dsn, "w", handler, batch=1).run(max_jobs=2) == 2
    row = db.conn.execute("SELECT status, last_error FROM pglockkit.jobs WHERE id = %s", (bad,)).fetchone()
    assert row[0] == "queued" and error in row[1]
    assert db.conn.execute("SELECT status FROM pglockkit.jobs WHERE id = %s", (good,)).fetchone() == ("done",)
    logged = set(db.conn.execute("SELECT job_id, token FROM done_log").fetchall())
    assert logged == {(good, 1)} | ({(bad, 1)} if kept else set())
    idle_in_transaction = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in%'"
    )
    assert db.conn.execute(idle_in_transaction).fetchone()[0] == 0


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
@pytest.mark.parametrize("how", ["COMMIT", "ROLLBACK"])
def test_a_handler_that_ends_its_group_leaves_the_jobs_before_it_done_once(tables, how, asynchronous):
    """A handler in a group sends COMMIT: the writes of the group's jobs before it committed with
    it. They were given up with the group and ran again after their lease (written twice); now
    the worker asks whether the group's transaction committed and records them done. After a
    ROLLBACK their writes are gone, and they run again, once."""
    db = tables
    first, before, bad, after = q.enqueue_many(db.conn, "w", [{}, {}, {"end": True}, {}])
    insert = "INSERT INTO done_log (job_id, token) VALUES (%s, %s)"

    def handler(job, conn):
        conn.execute(insert, (job.id, job.attempt))
        if job.payload.get("end") and job.attempt == 1:
            with _hiding(how):
                _end(conn, how)

    async def ahandler(job, conn):
        await conn.execute(insert, (job.id, job.attempt))
        if job.payload.get("end") and job.attempt == 1:
            with _hiding(how):
                await _end_async(conn, how)

    def drain() -> None:  # the first job alone, then the other three in one group
        options = {"batch": 10, "group": 32, "group_time": 30, "lease": 1}
        if asynchronous:
            asyncio.run(aio.Worker(db.dsn, "w", ahandler, **options).run(exit_when_idle=True))
        else:
            pglockkit.Worker(db.dsn, "w", handler, **options).run(exit_when_idle=True)

    drain()
    time.sleep(1.3)  # past the lease of anything given up
    db.conn.execute("UPDATE pglockkit.jobs SET run_at = now() WHERE status = 'queued'")  # the retry
    drain()
    logged = db.conn.execute(
        "SELECT job_id, count(*) FROM done_log GROUP BY job_id ORDER BY job_id"
    ).fetchall()
    committed = how == "COMMIT"
    # `before` once either way: committed with the COMMIT and recorded, or rolled back and run again
    assert logged == [(first, 1), (before, 1), (bad, 2 if committed else 1), (after, 1)]
    states = db.conn.execute("SELECT id, status, attempt FROM pglockkit.jobs ORDER BY id").fetchall()
    assert states == [
        (first, "done", 1),
        (before, "done", 1 if committed else 2),
        (bad, "done", 2),
        (after, "done", 1),
    ]


def test_a_handler_that_swallows_a_database_error_fails_its_job(tables):
    db = tables
    [job_id] = q.enqueue_many(db.conn, "w", [{}])

    def handler(job, conn):
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")  # caught: the transaction is aborted now

    assert pglockkit.Worker(db.dsn, "w", handler).run(max_jobs=1) == 1
    row = db.conn.execute("SELECT status, last_error FROM pglockkit.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row[0] == "queued" and "aborted by an error it caught" in row[1]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_at_least_once_handlers_complete_in_batches(tables, asynchronous):
    db = tables
    ids = q.enqueue_many(db.conn, "w", [{"n": i} for i in range(40)])
    seen: list[int] = []

    def handler(job):
        seen.append(job.id)
        if job.payload["n"] == 7:
            raise ValueError("bad payload")

    async def ahandler(job):
        handler(job)

    worker = pglockkit.Worker(db.dsn, "w", ahandler if asynchronous else handler, batch=10, group_time=30)
    assert worker.run(max_jobs=40) == 40
    assert sorted(seen) == ids
    statuses = dict(db.conn.execute("SELECT status, count(*) FROM pglockkit.jobs GROUP BY 1").fetchall())
    assert statuses == {"done": 39, "queued": 1}
    # Completions were recorded a group at a time, not one transaction per job.
    groups = db.conn.execute(
        "SELECT count(DISTINCT xmin::text) FROM pglockkit.jobs WHERE status = 'done'"
    ).fetchone()[0]
    assert groups <= 8, groups


def test_aio_worker_has_the_sync_workers_signature_and_refuses_a_plain_function(db):
    def params(cls):
        import inspect

        return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]

    assert params(aio.Worker) == params(pglockkit.Worker)
    with pytest.raises(TypeError, match="async def"):
        aio.Worker(db.dsn, "w", record)
    with pytest.raises(ValueError, match="group must be between 1 and 64"):
        pglockkit.Worker(db.dsn, "w", record, group=65)
    with pytest.raises(ValueError, match="concurrency"):
        pglockkit.Worker(db.dsn, "w", record, concurrency=0)


def test_aio_worker_runs_on_the_callers_loop_and_stops(tables):
    db = tables
    q.enqueue_many(db.conn, "w", [{"sleep": 0.05}] * 8)

    async def main() -> int:
        worker = aio.Worker(db.dsn, "w", span_async, concurrency=4)
        task = asyncio.create_task(worker.run())
        while db.conn.execute("SELECT count(*) FROM spans").fetchone()[0] < 8:
            await asyncio.sleep(0.02)
        worker.stop()
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 8


def test_sigterm_with_jobs_in_flight_finishes_them_and_gives_back_the_rest(tables):
    db = tables
    q.enqueue_many(db.conn, "w", [{"sleep": 0.5}] * 12)
    proc = worker_proc(db.dsn, "--concurrency", "4", "--lease", "60s")
    deadline = time.monotonic() + 20
    running = "SELECT count(*) FROM pglockkit.jobs WHERE status = 'running'"
    while db.conn.execute(running).fetchone()[0] < 4:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    time.sleep(0.1)  # inside the four handlers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    statuses = dict(db.conn.execute("SELECT status, count(*) FROM pglockkit.jobs GROUP BY status").fetchall())
    assert statuses == {"done": 4, "queued": 8}  # the four in flight finished; the rest given back
    assert {r[0] for r in db.conn.execute("SELECT attempt FROM pglockkit.jobs WHERE status = 'queued'")} == {
        0
    }
    assert db.conn.execute("SELECT count(*) FROM done_log").fetchone()[0] == 4


@pytest.mark.parametrize(
    "args, error",
    [
        (("--group", "0"), "group must be between 1 and 64"),
        (("--concurrency", "0"), "concurrency must be a positive integer, got 0"),
        (("--connections", "0"), "connections must be a positive integer, got 0"),
        (("--connections", "-3", "--concurrency", "500"), "connections must be a positive integer, got -3"),
        (("--connections", "ten"), "argument --connections: invalid int value: 'ten'"),
    ],
)
def test_cli_refuses_bad_worker_settings(db, args, error, capsys):
    """Exit 2 with the reason, before connecting; nothing claimed (in process: the command line's
    own exit is ``test_a_worker_that_needs_more_connections_than_the_server_allows_refuses_to_start``)."""
    from pglockkit import cli

    job = q.enqueue(db.conn, "w", {})
    try:
        code = cli.main(["work", "--dsn", db.dsn, "--queue", "w", "--handler", "json:dumps", *args])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and error in err, err
    assert "Traceback" not in err
    assert db.conn.execute("SELECT status FROM pglockkit.jobs WHERE id = %s", (job,)).fetchone() == (
        "queued",
    )


@pytest.mark.parametrize("connections", [0, -1, True, 2.5, "4"])
def test_a_worker_refuses_a_pool_that_is_not_a_positive_integer(connections):
    with pytest.raises(ValueError, match=f"connections must be a positive integer, got {connections!r}"):
        pglockkit.Worker("dbname=unused", "w", record, concurrency=8, connections=connections)
    with pytest.raises(ValueError, match="connections must be a positive integer"):
        aio.Worker("dbname=unused", "w", span_async, concurrency=8, connections=connections)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_handler_that_keeps_its_transaction_open_holds_only_its_own_connection(tables, asynchronous):
    """docs/queue.md: a handler that writes first and then waits holds its connection for the
    whole wait, and only that one. On a pool of 2 with 8 jobs in flight, one job writes and then
    waits 3 s inside its transaction; the other 40 jobs (a short wait, then a write) are all done
    on the other connection before it commits, and its own write commits with it, once."""
    db = tables
    hog = q.enqueue(db.conn, "w", {"hog": True})
    others = q.enqueue_many(db.conn, "w", [{"sleep": 0.02}] * 40)
    insert = "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)"

    def handler(job, conn):
        if job.payload.get("hog"):
            conn.execute(insert, (job.id, job.token))
            time.sleep(3)
            return
        span(job, conn)

    async def ahandler(job, conn):
        if job.payload.get("hog"):
            await conn.execute(insert, (job.id, job.token))
            await asyncio.sleep(3)
            return
        await span_async(job, conn)

    worker = pglockkit.Worker(
        db.dsn, "w", ahandler if asynchronous else handler, concurrency=8, connections=2
    )
    started = time.monotonic()
    assert worker.run(exit_when_idle=True) == 41
    assert time.monotonic() - started < 8
    hog_done = db.conn.execute("SELECT finished_at FROM pglockkit.jobs WHERE id = %s", (hog,)).fetchone()[0]
    last_other = db.conn.execute(
        "SELECT max(finished_at) FROM pglockkit.jobs WHERE id = ANY(%s)", (others,)
    ).fetchone()[0]
    assert last_other < hog_done - timedelta(seconds=1), (last_other, hog_done)
    assert db.conn.execute("SELECT count(DISTINCT job_id) FROM spans").fetchone()[0] == 40
    assert db.conn.execute("SELECT job_id FROM done_log").fetchall() == [(hog,)]


def test_a_worker_that_needs_more_connections_than_the_server_allows_refuses_to_start(db):
    """A pool of ``connections`` plus LISTEN and the heartbeat, over what the server lets the
    role hold at all (the test servers' ``max_connections`` is 300): the worker refuses before
    its pool connects, from the command line (exit 2) and from Python (threads and asyncio), and
    claims nothing. A worker of 500 lanes took all 100 connections of a small server. Many more
    jobs in flight than that (``concurrency``) on a small pool are fine."""
    from scenarios import cli

    q.enqueue(db.conn, "w", {})
    allowed = db.conn.execute("SELECT current_setting('max_connections')::int").fetchone()[0]  # a superuser
    too_many = allowed - 1  # needs allowed + 1

    def workers_connected() -> int:
        """This database's worker backends, once those of the closed connections have gone: a
        backend leaves pg_stat_activity a moment after its client closes, and other tests' workers
        share the server."""
        deadline = time.monotonic() + 5
        while True:
            n = db.conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name LIKE 'pglockkit worker %'"
            ).fetchone()[0]
            if n == 0 or time.monotonic() > deadline:
                return n
            time.sleep(0.05)

    out = cli("work", "--dsn", db.dsn, "--queue", "w", "--handler", "json:dumps",
              "--concurrency", "1000", "--connections", str(too_many))  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"connections {too_many} needs {too_many + 2} connections" in out.stderr
    assert f"lets this role hold {allowed} in all (max_connections {allowed})" in out.stderr
    assert "Traceback" not in out.stderr
    with pytest.raises(pglockkit.LimitExceeded, match="lower connections to at most"):
        pglockkit.Worker(db.dsn, "w", record, concurrency=too_many, connections=too_many).run()

    async def main() -> None:
        with pytest.raises(pglockkit.LimitExceeded, match=f"connections {too_many} needs"):
            await aio.Worker(db.dsn, "w", span_async, concurrency=too_many, connections=too_many).run()

    asyncio.run(main())
    assert db.conn.execute("SELECT status, attempt FROM pglockkit.jobs").fetchall() == [("queued", 0)]
    assert workers_connected() == 0  # the LISTEN connection that asked was closed


@pytest.mark.slow
def test_exactly_once_with_concurrency_and_groups_while_workers_are_sigkilled(tables):
    """8 processes x concurrency 4 x groups of 10 drain 5,000 jobs while a random one is
    SIGKILLed every few hundred ms: every job done, its handler's row written exactly once."""
    db = tables
    stats = exactly_once_under_sigkill(
        db.conn, db.dsn, total=5000, workers=8, extra=("--concurrency", "4", "--group", "10")
    )
    assert stats["kills"] >= 5
    assert stats["crashes"] == []
    assert stats["recorded"] == stats["distinct"] == 5000
    assert stats["mismatched"] == 0
    assert stats["reclaimed"] > 0


def test_a_job_cancelled_while_it_runs_alone_has_its_writes_rolled_back(tables):
    """A job alone in hand runs unlocked (the heartbeat renews its lease); its completion checks
    the claim, and a claim gone stale meanwhile rolls the handler's writes back."""
    db = tables
    [job_id] = q.enqueue_many(db.conn, "w", [{"sleep": 0.6}])
    worker = pglockkit.Worker(db.dsn, "w", record, lease=0.3)
    thread = threading.Thread(target=worker.run, kwargs={"exit_when_idle": True})
    thread.start()
    time.sleep(0.4)  # past the first lease: the heartbeat has renewed it, the row is not locked
    assert q.claim(db.conn, "w", "thief") == []
    assert q.cancel(db.conn, job_id) is True  # not waited for: nothing holds the row
    thread.join(20)
    assert not thread.is_alive()
    assert db.conn.execute("SELECT count(*) FROM done_log").fetchone()[0] == 0
    assert db.conn.execute("SELECT status FROM pglockkit.jobs WHERE id = %s", (job_id,)).fetchone() == (
        "cancelled",
    )


@pytest.mark.parametrize("handler", [record, span_async], ids=["threads", "asyncio"])
def test_lanes_whose_backends_are_terminated_reconnect_and_every_job_is_done_once(tables, handler):
    """pg_terminate_backend on every lane's backend, twice, while 4 lanes drain 300 jobs: the
    open groups are lost and their jobs run again after their (short) lease; each is done once."""
    db = tables
    q.enqueue_many(db.conn, "w", [{"sleep": 0.01}] * 300)
    worker = pglockkit.Worker(db.dsn, "w", handler, concurrency=4, lease=1.0, reconnect_cap=0.2)
    thread = threading.Thread(target=worker.run)  # until stopped: lost jobs come back after their lease
    thread.start()
    terminated = 0
    for _ in range(2):
        time.sleep(0.4)
        terminated += db.conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'pglockkit worker w'"
        ).fetchone()[0]
    deadline = time.monotonic() + 60
    while db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE status <> 'done'").fetchone()[0]:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    worker.stop()
    thread.join(20)
    assert not thread.is_alive()
    assert terminated >= 4 and worker.reconnects >= 1
    table = "done_log" if handler is record else "spans"
    assert db.conn.execute(f"SELECT count(*), count(DISTINCT job_id) FROM {table}").fetchone() == (300, 300)
    assert db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE attempt > 1").fetchone()[0] > 0


@pytest.mark.parametrize("mode", ["exactly-once", "at-least-once", "asyncio"])
def test_a_worker_survives_its_running_job_being_cancelled_and_pruned(tables, mode):
    """Another session cancels a running job and prunes it (its row is gone): completing or
    failing it then finds no such job. The worker logs that and goes on with the others; nothing
    it ran for the pruned job is kept (exactly once) and every other job is done once."""
    db = tables
    gone, *rest = q.enqueue_many(db.conn, "w", [{"sleep": 0.8, "fail": True}] + [{}] * 5)

    def failing(job, conn):  # the pruned job fails: its fail_job finds no row either
        record(job, conn)
        if job.payload.get("fail"):
            raise RuntimeError("boom")

    def at_least_once(job):
        time.sleep(job.payload.get("sleep", 0))
        if job.payload.get("fail"):
            raise RuntimeError("boom")
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO done_log (job_id) VALUES (%s)", (job.id,))

    async def failing_async(job, conn):
        await asyncio.sleep(job.payload.get("sleep", 0))
        await conn.execute("INSERT INTO done_log (job_id) VALUES (%s)", (job.id,))
        if job.payload.get("fail"):
            raise RuntimeError("boom")

    handler = {"exactly-once": failing, "at-least-once": at_least_once, "asyncio": failing_async}[mode]
    worker = pglockkit.Worker(db.dsn, "w", handler, concurrency=2, lease=0.3, reconnect_cap=0.2)
    errors: list[BaseException] = []

    def run():
        try:
            worker.run(exit_when_idle=True)
        except BaseException as exc:  # the test reports it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 10
    status = "SELECT status, attempt FROM pglockkit.jobs WHERE id = %s"
    while db.conn.execute(status, (gone,)).fetchone() != ("running", 1):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert q.cancel(db.conn, gone) is True
    assert db.conn.execute("SELECT pglockkit.prune_jobs('0 seconds', 'w')").fetchone()[0] >= 1
    assert db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE id = %s", (gone,)).fetchone()[0] == 0
    # A long job after it: done on its first attempt only if the heartbeat still renews leases.
    slow = q.enqueue(db.conn, "w", {"sleep": 1.2})
    thread.join(30)
    assert not thread.is_alive() and errors == []
    logged = [r[0] for r in db.conn.execute("SELECT job_id FROM done_log ORDER BY job_id")]
    assert logged == [*rest, slow]
    assert db.conn.execute(status, (slow,)).fetchone() == ("done", 1)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_an_at_least_once_failure_of_a_pruned_job_does_not_undo_the_groups_completions(tables, asynchronous):
    """At least once: outcomes are recorded together. One failed job was cancelled and pruned
    while it ran, so its fail_job finds no row (UnknownJob): the other jobs' completions are still
    recorded at once (they do not come back after their lease) and the worker goes on."""
    db = tables
    gone, *rest = q.enqueue_many(db.conn, "w", [{"fail": True}] + [{}] * 4)
    cancelled = threading.Event()

    def prune(job_id):
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            assert q.cancel(conn, job_id) is True
            conn.execute("SELECT pglockkit.prune_jobs('0 seconds', 'w')")
        cancelled.set()

    def handler(job):
        if job.payload.get("fail"):
            prune(job.id)
            raise RuntimeError("boom")
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO done_log (job_id) VALUES (%s)", (job.id,))

    async def ahandler(job):
        await asyncio.to_thread(handler, job)

    # Claims of 5 at once (the lane has timed no job yet: batch is the cap after the first).
    kwargs = {"batch": 5, "group": 5, "group_time": 5.0, "lease": 30}
    if asynchronous:
        processed = asyncio.run(aio.Worker(db.dsn, "w", ahandler, **kwargs).run(exit_when_idle=True))
    else:
        processed = pglockkit.Worker(db.dsn, "w", handler, **kwargs).run(exit_when_idle=True)
    assert cancelled.is_set() and processed == 5
    assert sorted(r[0] for r in db.conn.execute("SELECT job_id FROM done_log")) == rest
    statuses = db.conn.execute("SELECT id, status FROM pglockkit.jobs ORDER BY id").fetchall()
    assert [s for i, s in statuses if i in rest] == ["done"] * 4  # recorded, not left to their lease
    assert gone not in [i for i, _ in statuses]


def _drain_under_repeatable_read(db, caplog, total: int, **options) -> list[str]:
    """4 workers of 2 lanes drain ``total`` jobs with REPEATABLE READ as the database's default;
    returns the pglockkit.queue log, after checking that the workers ended with every job run
    exactly once. A 10-minute lease: its heartbeat (every lease / 3) would extend jobs a group is
    about to complete, and under REPEATABLE READ that completion then fails (40001) and the group
    is rolled back: a limit of the worker under REPEATABLE READ (docs/queue.md), not tested here."""
    db.conn.execute(
        f"ALTER DATABASE \"{db.conn.info.dbname}\" SET default_transaction_isolation = 'repeatable read'"
    )
    q.enqueue_many(db.conn, "w", [{}] * total)
    caplog.set_level("INFO", "pglockkit.queue")
    workers = [pglockkit.Worker(db.dsn, "w", record, concurrency=2, lease=600, **options) for _ in range(4)]
    threads = [threading.Thread(target=w.run, kwargs={"exit_when_idle": True}) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert db.conn.execute("SELECT count(*), count(DISTINCT job_id) FROM done_log").fetchone() == (
        total,
        total,
    )
    return [r.getMessage() for r in caplog.records if r.name == "pglockkit.queue"]


def test_claims_that_conflict_under_repeatable_read_neither_end_the_worker_nor_undo_its_jobs(tables, caplog):
    """With REPEATABLE READ as the database's default, claims fail with 40001 when another worker
    claimed a row after their snapshot. A claim of its own is sent again; a claim-ahead at the end
    of a group is undone alone (its savepoint), so the group's handlers keep their work and no job
    runs twice. 4 workers of 2 lanes drain 2,000 jobs."""
    messages = _drain_under_repeatable_read(tables, caplog, 2000, batch=8, group=8)
    assert any("claim failed, retried later: could not serialize" in m for m in messages)  # the path ran
    assert not [m for m in messages if "lane error" in m]
    # attempt 1 everywhere: no group was rolled back to come back after its lease
    assert tables.conn.execute(
        "SELECT status, attempt, count(*) FROM pglockkit.jobs GROUP BY 1, 2"
    ).fetchall() == [("done", 1, 2000)]


def test_claims_that_keep_conflicting_pause_the_lane_without_a_lane_error(tables, caplog, monkeypatch):
    """A claim into an empty hand that conflicts CLAIM_TRIES times in a row (here 1, so that it
    happens) held nothing: the lane pauses and claims again, logged as such, not as a lane error
    whose group was rolled back; every job still runs once."""
    import pglockkit.worker.lane

    monkeypatch.setattr(pglockkit.worker.lane, "CLAIM_TRIES", 1)
    messages = _drain_under_repeatable_read(tables, caplog, 1000, batch=1, group=1)
    assert any("1 claims in a row conflicted (could not serialize" in m for m in messages)  # the path ran
    assert not [m for m in messages if "lane error" in m]


def _deadlocks(conn) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return conn.execute(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()[0]


def test_groups_recording_completions_and_failures_of_shared_keys_do_not_deadlock(tables, caplog):
    """Two workers each end a group that completes a job of one concurrency key and fails a job
    of the other, in opposite pairings. Recorded as complete_jobs then fail_job, each group held
    one key row and waited for the other's: a deadlock (40P01), which rolled one group back (its
    jobs to run again after their lease). The worker records a group's outcomes in key order, so
    both wait in one order. A session holding both key rows makes the groups get there together."""
    conn = tables.conn
    conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET deadlock_timeout = '50ms'")
    caplog.set_level("INFO", "pglockkit.queue")

    def enqueue(jobs):
        # A keyless first job times the lane's handler, after which it claims two at a time.
        conn.execute("SELECT pglockkit.enqueue_job('w', '{\"fail\": false}', priority => 100)")
        for priority, key, fails in jobs:
            conn.execute(
                "SELECT pglockkit.enqueue_job('w', jsonb_build_object('fail', %s, 'key_job', true),"
                " priority => %s, max_attempts => 1, concurrency_key => %s, concurrency_limit => 10)",
                (fails, priority, key),
            )

    def handler(job):
        if job.payload.get("key_job"):
            time.sleep(1)  # meanwhile the other worker claims, and the blocker takes the key rows
        if job.payload["fail"]:
            raise RuntimeError("fails on purpose")

    def wait_for(query, count):
        deadline = time.monotonic() + 10
        while conn.execute(query).fetchone()[0] < count:
            assert time.monotonic() < deadline, query
            time.sleep(0.005)

    before = _deadlocks(conn)
    threads = []
    # A: completes k1's job, fails k2's; B: completes k2's job, fails k1's.
    for jobs, running in ([(9, "k1", False), (8, "k2", True)], 2), ([(9, "k2", False), (8, "k1", True)], 4):
        enqueue(jobs)
        worker = pglockkit.Worker(
            tables.dsn, "w", handler, concurrency=1, batch=2, group=2, group_time=10, lease=600
        )
        threads.append(threading.Thread(target=worker.run, kwargs={"exit_when_idle": True}))
        threads[-1].start()
        wait_for(
            "SELECT count(*) FROM pglockkit.jobs WHERE status = 'running' AND concurrency_key IS NOT NULL",
            running,
        )
    with tables.connect() as blocker:
        blocker.execute("BEGIN")
        blocker.execute("SELECT * FROM pglockkit.job_keys WHERE queue = 'w' FOR UPDATE")
        # Both groups end, their first outcome waiting for a key row the blocker holds.
        wait_for(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'",
            2,
        )
        blocker.execute("COMMIT")
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    messages = [r.getMessage() for r in caplog.records if r.name == "pglockkit.queue"]
    assert not [m for m in messages if "deadlock" in m], messages
    assert _deadlocks(conn) == before
    assert conn.execute(
        "SELECT concurrency_key, status, attempt FROM pglockkit.jobs"
        " WHERE concurrency_key IS NOT NULL ORDER BY id"
    ).fetchall() == [("k1", "done", 1), ("k2", "dead", 1), ("k2", "done", 1), ("k1", "dead", 1)]


@pytest.mark.slow
def test_a_database_refusing_writes_does_not_get_a_tick_failure_logged_every_second(db, caplog):
    """A database that refuses writes (default_transaction_read_only, as a standby refuses them)
    fails every claim and every tick. The lanes back off up to reconnect_cap; the schedule ticker
    tried again, and logged a five-line warning, every second for as long as it lasted (3,600 an
    hour per worker process). Its ticks back off too (1, 2, 4 s ... up to 30 s), a line each."""
    db.conn.execute(f'ALTER DATABASE "{db.conn.info.dbname}" SET default_transaction_read_only = on')
    caplog.set_level("WARNING", "pglockkit.queue")
    worker = pglockkit.Worker(db.dsn, "w", record)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        time.sleep(7)
    finally:
        worker.stop()
        runner.join(30)
    ticks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tick_schedules failed")]
    lanes = [r.getMessage() for r in caplog.records if "lane error" in r.getMessage()]
    assert lanes and "read-only transaction" in lanes[0]  # the outage was seen
    assert 1 <= len(ticks) <= 3, ticks  # at 0, 2 and 6 s; it was one a second
    assert all("\n" not in t and "read-only transaction" in t for t in ticks), ticks
    assert "(1 in a row, next in 2 s)" in ticks[0]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_run_restores_the_signal_handlers_it_found(tables, asynchronous):
    """The thread worker puts back the SIGTERM/SIGINT handlers it found; the asyncio worker
    (loop.remove_signal_handler) left SIGTERM at SIG_DFL and SIGINT at default_int_handler, so the
    application's own SIGTERM handler was gone: its next SIGTERM killed the process outright."""
    db = tables
    q.enqueue(db.conn, "w", {})

    def on_term(*_):
        pass

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        if asynchronous:
            done = asyncio.run(aio.Worker(db.dsn, "w", span_async).run(exit_when_idle=True))
        else:
            done = pglockkit.Worker(db.dsn, "w", span).run(exit_when_idle=True)
        assert done == 1
        assert signal.getsignal(signal.SIGTERM) is on_term
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_cancelled_aio_worker_gives_back_the_jobs_it_had_not_started(tables):
    """``stop()`` (and SIGTERM) give back the jobs in hand unstarted, their attempt not counted.
    Cancelling the task that runs ``aio.Worker.run()`` (a TaskGroup whose sibling failed, an app's
    shutdown) left them claimed: they waited out the lease and their reclaim counted an attempt,
    so a job with max_attempts=1 went dead ("lease expired") without ever running."""
    db = tables
    q.enqueue(db.conn, "w", {"sleep": 0}, max_attempts=1)  # timed first: the next claim is a batch
    q.enqueue_many(db.conn, "w", [{"sleep": 30}, *[{"sleep": 0}] * 4], max_attempts=1)

    async def main() -> None:
        worker = aio.Worker(db.dsn, "w", span_async, lease=1, batch=8, group=8, group_time=5)
        task = asyncio.create_task(worker.run())
        while (
            db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE status = 'running'").fetchone()[0] < 5
        ):
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # inside the 30 s handler, four jobs unstarted in hand
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)

    asyncio.run(main())
    time.sleep(1.2)  # past the lease
    q.claim(db.conn, "w", "next", batch=10)  # a later worker's claim reclaims the expired leases
    never_ran = db.conn.execute(
        "SELECT count(*) FROM pglockkit.jobs j WHERE j.status = 'dead' AND j.payload->>'sleep' = '0' "
        "AND NOT EXISTS (SELECT FROM spans s WHERE s.job_id = j.id)"
    ).fetchone()[0]
    assert never_ran == 0, f"{never_ran} jobs went dead without ever running"


def test_a_cancelled_aio_worker_records_the_at_least_once_jobs_it_finished(tables):
    """An at-least-once handler's completion waits in the lane's buffer for the group's record.
    ``stop()`` records it; cancelling the worker's task dropped it, so a job whose handler had
    returned (its outside effect done) stayed claimed and ran again after its lease."""
    db = tables
    q.enqueue(db.conn, "w", {"sleep": 0})  # timed first: the next claim is a batch
    first_of_batch = q.enqueue(db.conn, "w", {"sleep": 0})
    q.enqueue(db.conn, "w", {"sleep": 30})
    finished: list[int] = []

    async def call_out(job):  # at least once: no connection
        await asyncio.sleep(job.payload["sleep"])
        finished.append(job.id)

    async def main() -> None:
        worker = aio.Worker(db.dsn, "w", call_out, lease=30, batch=8, group=8, group_time=5)
        task = asyncio.create_task(worker.run())
        while first_of_batch not in finished:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # inside the 30 s handler
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)

    asyncio.run(main())
    status = db.conn.execute("SELECT status FROM pglockkit.jobs WHERE id = %s", (first_of_batch,)).fetchone()[
        0
    ]
    assert status == "done", f"job {first_of_batch} ran and is left {status}: it will run again"


def test_a_cancelled_aio_worker_fails_the_job_it_interrupted_and_commits_the_group_before_it(tables):
    """Cancelling ``run()`` cancels the handler in flight instead of awaiting it: its job fails
    (an attempt counted, its writes rolled back to its savepoint), the group's jobs that finished
    before it commit with their writes, the unstarted ones are given back, and the task ends
    cancelled."""
    db = tables
    q.enqueue(db.conn, "w", {})  # timed first: the next claim is a batch
    before = q.enqueue_many(db.conn, "w", [{}, {}])
    (slow,) = q.enqueue_many(db.conn, "w", [{"sleep": 30}])
    after = q.enqueue_many(db.conn, "w", [{}, {}])
    started: list[int] = []

    async def handler(job, conn):
        started.append(job.id)
        await conn.execute(
            "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token)
        )
        await asyncio.sleep(job.payload.get("sleep", 0))

    async def main() -> asyncio.Task[int]:
        worker = aio.Worker(db.dsn, "w", handler, lease=30, batch=8, group=8, group_time=5)
        task = asyncio.create_task(worker.run())
        while slow not in started:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # inside the 30 s handler, in a group after two finished jobs
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        return task

    assert asyncio.run(main()).cancelled()
    jobs = dict(
        (r[0], r[1:]) for r in db.conn.execute("SELECT id, status, attempt, last_error FROM pglockkit.jobs")
    )
    assert [jobs[i][:2] for i in before] == [("done", 1)] * 2
    assert (
        jobs[slow][:2] == ("queued", 1) and "the worker was cancelled while the handler ran" in jobs[slow][2]
    )
    assert [jobs[i][:2] for i in after] == [("queued", 0)] * 2
    logged = {r[0] for r in db.conn.execute("SELECT job_id FROM done_log")}
    assert slow not in logged and set(before) <= logged


def test_aio_run_puts_back_a_handler_the_loop_had(tables, tmp_path):
    """An asyncio application installs its SIGTERM handler with ``loop.add_signal_handler`` (the
    asyncio way). aio.Worker.run() then reads ``signal.getsignal``, which is the loop's no-op
    trampoline, and on return removes the loop's entry (the application's callback is gone) and
    puts the no-op back: the next SIGTERM is ignored outright, neither the application's handler
    nor the default runs. Run in a child process: a process that dies of SIGTERM must not be pytest."""
    db = tables
    q.enqueue(db.conn, "w", {})
    script = tmp_path / "app.py"
    script.write_text(
        f"""
import asyncio, os, signal, sys
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
from queue_handlers import span_async
import pglockkit.aio as aio

async def main():
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, got.set)  # the application's own shutdown
    assert await aio.Worker({db.dsn!r}, "w", span_async).run(exit_when_idle=True) == 1
    os.kill(os.getpid(), signal.SIGTERM)
    try:
        await asyncio.wait_for(got.wait(), 5)
    except TimeoutError:
        print("SIGTERM ignored: handler now", signal.getsignal(signal.SIGTERM))
        sys.exit(3)
    print("application handler ran")

asyncio.run(main())
"""
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "application handler ran" in done.stdout


@pytest.mark.parametrize("flavour", ["threads", "asyncio"])
def test_a_lane_connects_with_the_connect_timeout_of_the_dsn_service(tables, tmp_path, monkeypatch, flavour):
    """docs/queue.md: a lane's connect gives up after 3 s "unless the DSN or PGCONNECT_TIMEOUT
    says otherwise". A DSN naming a service (service=NAME, pg_service.conf) whose entry sets
    connect_timeout does say otherwise, but lane_params only looks at the DSN's own keywords and
    passes connect_timeout=3 explicitly, which libpq puts before the service file's: a lane to a
    far database whose service gives connects 30 s gave up after 3 s, and so again and again."""
    db = tables
    info = psycopg.conninfo.conninfo_to_dict(db.dsn)
    service = tmp_path / "pg_service.conf"
    service.write_text(
        f"[far]\nhost={info['host']}\nport={info['port']}\nuser={info['user']}\n"
        f"dbname={info['dbname']}\nconnect_timeout=30\n"
    )
    monkeypatch.setenv("PGSERVICEFILE", str(service))
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    q.enqueue(db.conn, "w", {})
    seen: list[str | None] = []

    def handler(job, conn):
        seen.append(conn.info.get_parameters().get("connect_timeout"))

    async def ahandler(job, conn):
        seen.append(conn.info.get_parameters().get("connect_timeout"))

    if flavour == "threads":
        assert pglockkit.Worker("service=far", "w", handler).run(exit_when_idle=True) == 1
    else:
        assert asyncio.run(aio.Worker("service=far", "w", ahandler).run(exit_when_idle=True)) == 1
    assert seen == ["30"], seen


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_claims_blocked_by_a_table_lock_give_up_without_errors_or_reconnects(tables, caplog, asynchronous):
    """A table lock held as DDL holds it (EXCLUSIVE on pglockkit.jobs) made every claim wait until
    the role's statement_timeout cancelled it (57014), which the lanes then had to survive. A claim
    now waits 10 ms at most (claim_job's lock_timeout) and returns nothing: under a 300 ms
    statement_timeout the worker logs no timeout and no error, opens no new connection, and the
    job runs once the table is free."""
    db = tables
    dsn = psycopg.conninfo.make_conninfo(db.dsn, options="-c statement_timeout=300")
    caplog.set_level("WARNING", "pglockkit.queue")
    q.enqueue(db.conn, "w", {})
    worker = aio.Worker(dsn, "w", span_async) if asynchronous else pglockkit.Worker(dsn, "w", span)
    with psycopg.connect(db.dsn) as blocker:
        blocker.execute("LOCK TABLE pglockkit.jobs IN EXCLUSIVE MODE")
        runner = _run_in_thread(worker)
        time.sleep(1.5)  # five statement timeouts' worth of blocked claims
        assert db.conn.execute("SELECT count(*) FROM spans").fetchone()[0] == 0
    deadline = time.monotonic() + 20
    while db.conn.execute("SELECT count(*) FROM spans").fetchone()[0] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    worker.stop()
    runner.join(30)
    assert not runner.is_alive()
    assert db.conn.execute("SELECT count(*) FROM spans").fetchone()[0] == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert worker.reconnects == 0


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_lane_statement_the_server_cancels_rolls_back_and_keeps_the_connection(
    tables, caplog, asynchronous
):
    """A slow job's completion waits for its row, which another session holds FOR UPDATE, until
    the role's statement_timeout cancels it (57014). The lane rolls the job's transaction back
    (its write with it), logs one lane error, keeps its connection (a pool of one: both runs of
    the job are on the same backend) and runs the job again once its lease is over: its write
    is there once."""
    db = tables
    dsn = psycopg.conninfo.make_conninfo(db.dsn, options="-c statement_timeout=300")
    caplog.set_level("WARNING", "pglockkit.queue")
    runs: list[tuple[int, int, int]] = []  # (job id, token, backend pid) of every run
    started, go = threading.Event(), threading.Event()
    insert = "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, pg_backend_pid())"

    def handler(job, conn):
        conn.execute(insert, (job.id, job.token))
        runs.append((job.id, job.token, conn.info.backend_pid))
        if job.payload.get("hold"):
            started.set()
            go.wait(10)
        else:
            time.sleep(0.1)  # slower than group_time: the next job runs in a transaction of its own

    async def ahandler(job, conn):
        await conn.execute(insert, (job.id, job.token))
        runs.append((job.id, job.token, conn.info.backend_pid))
        if job.payload.get("hold"):
            started.set()
            await asyncio.to_thread(go.wait, 10)
        else:
            await asyncio.sleep(0.1)

    worker = (
        aio.Worker(dsn, "w", ahandler, lease=1)
        if asynchronous
        else pglockkit.Worker(dsn, "w", handler, lease=1)
    )
    slow = q.enqueue(db.conn, "w", {})
    runner = _run_in_thread(worker)
    try:
        deadline = time.monotonic() + 10
        while q.jobs(db.conn, "w", status="done") == []:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        held = q.enqueue(db.conn, "w", {"hold": True})
        assert started.wait(10)
        with psycopg.connect(db.dsn) as blocker:
            blocker.execute("SELECT FROM pglockkit.jobs WHERE id = %s FOR UPDATE", (held,))
            go.set()
            time.sleep(1.0)  # the completion waits and is cancelled after 300 ms
        deadline = time.monotonic() + 15
        while (
            db.conn.execute("SELECT status FROM pglockkit.jobs WHERE id = %s", (held,)).fetchone()[0]
            != "done"
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        go.set()
        worker.stop()
        runner.join(30)
    assert not runner.is_alive()
    mine = [r for r in runs if r[0] == held]
    assert len(mine) == 2 and mine[0][1] != mine[1][1], runs  # run again, under a new claim
    assert mine[0][2] == mine[1][2], runs  # on the same connection: it was not given up
    written = db.conn.execute("SELECT job_id, token FROM done_log ORDER BY job_id").fetchall()
    assert written == [(slow, runs[0][1]), (held, mine[1][1])]  # the cancelled run's write is gone
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([m for m in messages if "lane error" in m and "statement timeout" in m]) == 1, messages
    assert not [m for m in messages if "connection lost" in m], messages
    assert worker.reconnects == 1


def _run_in_thread(worker) -> threading.Thread:
    """Run ``worker`` (sync or aio) until ``worker.stop()``."""
    if isinstance(worker, aio.Worker):
        thread = threading.Thread(target=lambda: asyncio.run(worker.run()))
    else:
        thread = threading.Thread(target=worker.run)
    thread.start()
    return thread


async def _record_async(job, conn):
    await conn.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_payload_python_cannot_decode_fails_its_job_not_the_batch_claimed_with_it(tables, asynchronous):
    """A payload that PostgreSQL stores but Python's json cannot load (an integer of 5,000 digits:
    over int's 4,300-digit limit for str conversion; another client enqueued it) made the claim's
    result raise after the claim had committed. Every job of that batch was left running, in no
    lane's hand: each came back only by its lease, burned an attempt, was claimed in a batch with
    the bad one again, and died with 'lease expired' without ever running."""
    db = tables
    good = q.enqueue_many(db.conn, "w", [{}] * 4)
    bad = db.conn.execute(
        "SELECT pglockkit.enqueue_job('w', ('{\"n\": 1' || repeat('0', 5000) || '}')::jsonb)"
    ).fetchone()[0]
    good += q.enqueue_many(db.conn, "w", [{}] * 4)
    handler = _record_async if asynchronous else record
    worker = (aio.Worker if asynchronous else pglockkit.Worker)(db.dsn, "w", handler, lease=1, batch=32)
    thread = _run_in_thread(worker)
    try:
        deadline = time.monotonic() + 8  # the bad batch's 5 attempts are spent in about 5 s
        while (
            time.monotonic() < deadline
            and db.conn.execute(
                "SELECT count(*) FROM pglockkit.jobs WHERE id = ANY(%s) AND status <> 'done'", (good,)
            ).fetchone()[0]
        ):
            time.sleep(0.1)
    finally:
        worker.stop()
        thread.join(20)
    rows = db.conn.execute(
        "SELECT id, status, attempt, last_error FROM pglockkit.jobs WHERE id = ANY(%s) ORDER BY id", (good,)
    ).fetchall()
    assert [r[1:3] for r in rows] == [("done", 1)] * 8, rows  # was ('dead', 5, 'lease expired')
    assert db.conn.execute("SELECT count(*), count(DISTINCT job_id) FROM done_log").fetchone() == (8, 8)
    status, error = db.conn.execute(
        "SELECT status, last_error FROM pglockkit.jobs WHERE id = %s", (bad,)
    ).fetchone()
    assert error is not None and error != "lease expired", (status, error)  # says why it cannot run


class _Abort(BaseException):
    """What some libraries raise to unwind a call (gevent.Timeout, trio.Cancelled are BaseException)."""


def _cancelled_in_asyncio_run():
    async def main():
        sub = asyncio.ensure_future(asyncio.sleep(10))
        sub.cancel()
        await sub

    asyncio.run(main())  # a sync handler driving a coroutine: CancelledError is a BaseException


@pytest.mark.parametrize(
    "raise_it",
    [
        _cancelled_in_asyncio_run,
        lambda: (_ for _ in ()).throw(_Abort()),
        lambda: (_ for _ in ()).throw(KeyboardInterrupt()),
    ],
    ids=["CancelledError", "BaseException", "KeyboardInterrupt"],
)
def test_a_sync_handler_raising_a_base_exception_fails_its_job_not_its_lane(tables, raise_it):
    """SystemExit from a handler fails its job (tested above); any other BaseException (an
    asyncio.CancelledError out of asyncio.run, a library's BaseException, KeyboardInterrupt raised
    by code: a real Ctrl-C goes to the main thread, which the worker handles) ended its lane's
    thread. With one lane, run() returned 0 as if the queue were drained, its 4 due jobs untouched
    and the bad job left running until its lease; `pglockkit work` exited 0. With more lanes, the
    process went on with one lane fewer, and the job, reclaimed, ended the next one."""
    db = tables
    bad, *rest = q.enqueue_many(db.conn, "w", [{"bad": True}] + [{}] * 4)

    def handler(job, conn):
        if job.payload.get("bad"):
            raise_it()
        conn.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))

    assert pglockkit.Worker(db.dsn, "w", handler, lease=30).run(exit_when_idle=True) == 5  # was 0
    assert sorted(r[0] for r in db.conn.execute("SELECT job_id FROM done_log")) == sorted(rest)
    status, attempt = db.conn.execute(
        "SELECT status, attempt FROM pglockkit.jobs WHERE id = %s", (bad,)
    ).fetchone()
    assert (status, attempt) == ("queued", 1)


@pytest.mark.parametrize("raised", [_Abort, KeyboardInterrupt], ids=["BaseException", "KeyboardInterrupt"])
@pytest.mark.parametrize("exactly_once", [True, False], ids=["exactly-once", "at-least-once"])
def test_an_async_handler_raising_a_base_exception_fails_its_job_not_the_worker(tables, raised, exactly_once):
    """In aio.Worker, a KeyboardInterrupt raised by a handler's code (a real Ctrl-C goes to run()'s
    signal handler, which stops the worker) or a library's BaseException ended the lane's task and
    run() raised it: the worker was gone, its jobs left running until their lease, and the job,
    run again, ended the next worker. It fails its job like any error now."""
    db = tables
    bad, *rest = q.enqueue_many(db.conn, "w", [{"bad": True}] + [{}] * 4)

    async def exactly(job, conn):
        if job.payload.get("bad"):
            raise raised()
        await conn.execute(
            "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token)
        )

    seen = []

    async def at_least(job):
        if job.payload.get("bad"):
            raise raised()
        seen.append(job.id)

    worker = aio.Worker(db.dsn, "w", exactly if exactly_once else at_least, lease=30)
    assert asyncio.run(worker.run(exit_when_idle=True)) == 5
    if exactly_once:
        seen = [r[0] for r in db.conn.execute("SELECT job_id FROM done_log")]
    assert sorted(seen) == sorted(rest)
    status, attempt, error = db.conn.execute(
        "SELECT status, attempt, last_error FROM pglockkit.jobs WHERE id = %s", (bad,)
    ).fetchone()
    assert (status, attempt) == ("queued", 1) and raised.__name__ in error, (status, attempt, error)


def test_a_sync_wrapper_of_an_async_handler_never_marks_a_job_done_without_running_it(tables):
    """A decorator written as a plain function (functools.wraps around an `async def`, a lambda, an
    object whose __call__ returns a coroutine) hides the coroutine: Worker took the handler for a
    sync one, called it, dropped the coroutine unawaited (RuntimeWarning: never awaited) and
    recorded the job done. Every job ended 'done' and its handler never ran: lost."""
    import functools

    db = tables
    ids = q.enqueue_many(db.conn, "w", [{}] * 3)

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        return wrapper

    @logged
    async def handler(job, conn):
        await conn.execute(
            "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token)
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pglockkit.Worker(db.dsn, "w", handler).run(exit_when_idle=True)
    done = {
        r[0]
        for r in db.conn.execute(
            "SELECT id FROM pglockkit.jobs WHERE id = ANY(%s) AND status = 'done'", (ids,)
        )
    }
    written = {r[0] for r in db.conn.execute("SELECT job_id FROM done_log")}
    assert done <= written, f"jobs {sorted(done - written)} recorded done, their handler never ran"


class _SyncCallReturningCoroutine:
    def __call__(self, job):  # a def __call__ that hands back an async def's coroutine
        return _record_async_alone(job)


async def _record_async_alone(job):
    raise AssertionError("never awaited by the threads worker")


@pytest.mark.parametrize("exactly_once", [True, False], ids=["exactly-once", "at-least-once"])
def test_a_def_handler_that_returns_a_coroutine_fails_its_job_and_says_why(tables, exactly_once):
    """A wrapper that hides its async def from every look (a lambda, an object whose def __call__
    returns the coroutine) is run by the threads worker: the coroutine it returns is closed, not
    left 'never awaited', and the job fails (an attempt counted) with an error that names
    pglockkit.aio.Worker, where it was recorded done without its body having run."""
    db = tables
    (job_id,) = q.enqueue_many(db.conn, "w", [{}])
    handler = (lambda job, conn: _record_async(job, conn)) if exactly_once else _SyncCallReturningCoroutine()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a coroutine never awaited would warn
        assert pglockkit.Worker(db.dsn, "w", handler).run(exit_when_idle=True) == 1
    status, attempt, error = db.conn.execute(
        "SELECT status, attempt, last_error FROM pglockkit.jobs WHERE id = %s", (job_id,)
    ).fetchone()
    assert (status, attempt) == ("queued", 1), (status, error)
    assert error.startswith("TypeError: the handler returned a coroutine") and "pglockkit.aio.Worker" in error
    assert db.conn.execute("SELECT count(*) FROM done_log").fetchone()[0] == 0


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_payload_too_deep_for_json_fails_without_running_and_set_json_loads_still_holds(
    tables, asynchronous
):
    """Arrays nested 5,000 deep are jsonb to PostgreSQL and a RecursionError to json.loads: the job
    fails (an attempt counted) with an error that says its handler did not run, and the jobs
    around it run. The payloads still go through the JSON loader psycopg was given
    (set_json_loads: Decimal for floats here)."""
    import decimal
    import functools
    import json

    from psycopg.types.json import set_json_loads

    db = tables
    good = q.enqueue_many(db.conn, "w", [{"price": 1.5}] * 3)
    bad = db.conn.execute(
        "SELECT pglockkit.enqueue_job('w', "
        "('{\"n\": ' || repeat('[', 5000) || repeat(']', 5000) || '}')::jsonb)"
    ).fetchone()[0]
    prices = []

    def handler(job, conn):
        prices.append(job.payload["price"])

    async def ahandler(job, conn):
        prices.append(job.payload["price"])

    set_json_loads(functools.partial(json.loads, parse_float=decimal.Decimal))
    try:
        cls, h = (aio.Worker, ahandler) if asynchronous else (pglockkit.Worker, handler)
        run = cls(db.dsn, "w", h, lease=30, batch=8).run(exit_when_idle=True)
        assert (asyncio.run(run) if asynchronous else run) == 4
    finally:
        set_json_loads(json.loads)
    assert prices == [decimal.Decimal("1.5")] * 3
    rows = db.conn.execute(
        "SELECT status, attempt FROM pglockkit.jobs WHERE id = ANY(%s)", (good,)
    ).fetchall()
    assert rows == [("done", 1)] * 3
    status, attempt, error = db.conn.execute(
        "SELECT status, attempt, last_error FROM pglockkit.jobs WHERE id = %s", (bad,)
    ).fetchone()
    assert (status, attempt) == ("queued", 1), (status, error)
    assert error.startswith("the handler did not run: this worker's JSON loader cannot decode") and (
        "RecursionError" in error
    ), error


def _run_synchronously(fn):
    """A sync adapter of an async def, as people write one (asgiref's async_to_sync does the same
    for methods: functools.update_wrapper on its bound partial): functools.wraps, then run the
    coroutine to its end in the calling thread."""
    import functools

    @functools.wraps(fn)
    def run(*args):
        return asyncio.run(fn(*args))

    return run


@pytest.mark.parametrize("exactly_once", [True, False], ids=["exactly_once", "at_least_once"])
def test_a_functools_wraps_sync_adapter_of_an_async_def_still_runs_on_threads(tables, exactly_once):
    """abf8312 made is_async look through __wrapped__: a functools.wraps wrapper of an async def
    is taken for async and pglockkit.Worker hands it to aio.Worker. A wrapper that is a sync
    adapter (it runs the coroutine itself with asyncio.run, or asgiref's async_to_sync on a
    method) then runs inside the event loop: asyncio.run raises 'cannot be called from a running
    event loop', and every job fails. It ran on the threads worker before."""
    db = tables
    ids = q.enqueue_many(db.conn, "w", [{}] * 3)

    async def body(job, conn=None):
        await asyncio.sleep(0)
        with psycopg.connect(db.dsn, autocommit=True) as c:
            c.execute("INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0)", (job.id, job.token))

    if exactly_once:

        async def handler(job, conn):
            await body(job)
    else:

        async def handler(job):
            await body(job)

    assert pglockkit.Worker(db.dsn, "w", _run_synchronously(handler)).run(exit_when_idle=True) == 3
    rows = db.conn.execute(
        "SELECT status, last_error FROM pglockkit.jobs WHERE id = ANY(%s) ORDER BY id", (ids,)
    ).fetchall()
    assert rows == [("done", None)] * 3, rows


KINDS = ["cursor", "with-cursor", "transaction", "pipeline", "fails-unused"]


def _stand_in(job, conn):
    """What a handler does with its ``conn`` before its first statement (queue.md: the stand-in)."""
    from psycopg.rows import dict_row

    insert = "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0) RETURNING job_id"
    kind = job.payload["kind"]
    assert conn.info.encoding  # a pool connection's, before the job has one
    if kind == "cursor":
        cur = conn.cursor(row_factory=dict_row)
        cur.execute(insert, (job.id, job.token))
        assert cur.fetchone() == {"job_id": job.id}
    elif kind == "with-cursor":
        with conn.cursor() as cur:
            cur.execute(insert, (job.id, job.token))
            assert cur.fetchall() == [(job.id,)]
    elif kind == "transaction":
        with conn.transaction():
            conn.execute(insert, (job.id, job.token))
    elif kind == "pipeline":
        with conn.pipeline():
            conn.execute(insert, (job.id, job.token))
    else:
        conn.cursor()
        raise RuntimeError("failed before any statement")


async def _stand_in_async(job, conn):
    from psycopg.rows import dict_row

    insert = "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, 0) RETURNING job_id"
    kind = job.payload["kind"]
    assert conn.info.encoding
    if kind == "cursor":
        cur = conn.cursor()
        cur.row_factory = dict_row  # set before the cursor exists on a connection
        await cur.execute(insert, (job.id, job.token))
        assert await cur.fetchone() == {"job_id": job.id}
    elif kind == "with-cursor":
        async with conn.cursor() as cur:
            await cur.execute(insert, (job.id, job.token))
            assert await cur.fetchall() == [(job.id,)]
    elif kind == "transaction":
        async with conn.transaction():
            await conn.execute(insert, (job.id, job.token))
    elif kind == "pipeline":
        async with conn.pipeline():
            await conn.execute(insert, (job.id, job.token))
    else:
        conn.cursor()
        raise RuntimeError("failed before any statement")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_the_conn_a_job_alone_gets_works_before_and_after_it_takes_a_connection(tables, kind, asynchronous):
    """A job that runs alone gets a stand-in ``conn`` that takes a pool connection at its first
    statement: a cursor made before that (with a row factory), ``transaction()`` and
    ``pipeline()`` work as on a connection, the write commits with the job, once; a handler that
    fails before any statement fails its job and writes nothing."""
    db = tables
    job = q.enqueue(db.conn, "w", {"kind": kind}, max_attempts=1)
    handler = _stand_in_async if asynchronous else _stand_in
    assert pglockkit.Worker(db.dsn, "w", handler).run(exit_when_idle=True) == 1
    status, error, token = db.conn.execute(
        "SELECT status, last_error, token FROM pglockkit.jobs WHERE id = %s", (job,)
    ).fetchone()
    logged = db.conn.execute("SELECT job_id, token FROM done_log").fetchall()
    if kind == "fails-unused":
        assert status == "dead" and "failed before any statement" in error
        assert logged == []
    else:
        assert (status, error) == ("done", None)
        assert logged == [(job, token)]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_slow_jobs_that_write_nothing_have_their_outcomes_recorded_together(tables, asynchronous):
    """docs/queue.md: at-least-once handlers hold no connection while they run, and the outcomes
    of slow jobs that wrote nothing are recorded with other lanes' in one transaction. 100 jobs in
    flight that finish together (each waits for all to have started, then 0.1 s), every tenth
    failing: every outcome recorded once (90 done, 10 dead at their one attempt), by a few
    transactions (the rows' distinct ``xmin``). Alone, each outcome was a transaction of its own:
    100."""
    db = tables
    n = 100
    ids = q.enqueue_many(db.conn, "w", [{"fail": i % 10 == 0} for i in range(n)], max_attempts=1)
    ran: list[int] = []
    barrier = threading.Barrier(n)

    def handler(job):
        barrier.wait(20)
        time.sleep(0.1)
        ran.append(job.id)
        if job.payload["fail"]:
            raise RuntimeError("this one fails")

    async def ahandler(job):
        ran.append(job.id)
        while len(ran) < n:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        if job.payload["fail"]:
            raise RuntimeError("this one fails")

    chosen = ahandler if asynchronous else handler
    worker = pglockkit.Worker(db.dsn, "w", chosen, concurrency=n, connections=4, tick_schedules=False)
    assert worker.run(exit_when_idle=True) == n
    writers = db.conn.execute("SELECT count(DISTINCT xmin::text) FROM pglockkit.jobs").fetchone()[0]
    statuses = db.conn.execute("SELECT status, count(*) FROM pglockkit.jobs GROUP BY 1").fetchall()
    assert sorted(statuses) == [("dead", 10), ("done", 90)]
    assert sorted(ran) == sorted(ids)
    assert writers <= 10, writers


def test_the_threads_feeder_answers_every_lane_that_asks_while_another_sends(tables):
    """pglockkit.Worker's lane threads share one Feeder: a lane that asks while another sends
    waits for the next batch. 24 threads claim, ask for a rate token and record, as fast as they
    can, on a pool of 3: every question gets its own answer (a lane that asked just as a batch was
    taken was once left out of both and answered None: a claim or token raised TypeError, and a
    record read as committed while it never was), and every job is done exactly once."""
    from pglockkit.worker.lane import ConnectGate, worker_params
    from pglockkit.worker.pool import Feeder, Pool

    db = tables
    total = 600
    q.enqueue_many(db.conn, "w", [{}] * total)
    settings = pglockkit.Worker(db.dsn, "w", lambda job: None, concurrency=24).settings
    pool = Pool(db.dsn, worker_params(db.dsn, "feeder test"), 3, ConnectGate(1.0), lambda: False)
    feeder = Feeder(pool, settings, lambda: None)
    failures: list[BaseException] = []
    recorded: list[int] = []

    def lane() -> None:
        try:
            while True:
                claimed, error = feeder.claim(1)
                assert error is None, error
                jobs = claimed[0]
                assert feeder.next_rate_token() is None  # no rate limit on "w"
                if not jobs:
                    return
                assert feeder.record(jobs, []) is None
                recorded.extend(job.id for job in jobs)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=lane) for _ in range(24)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes: the race shows
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
        pool.close()
    assert not failures, failures[:3]
    assert len(recorded) == len(set(recorded)) == total
    assert db.conn.execute(
        "SELECT count(*) FILTER (WHERE status = 'done'), count(*) FROM pglockkit.jobs WHERE queue = 'w'"
    ).fetchone() == (total, total)
