"""What enters the job queue: a missing job id is its own error (UnknownJob, not UnknownNamespace),
job times must be finite (and the tools read infinite ones already stored without breaking), and a
payload is bounded by a limit that only the admin role sets."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime

import psycopg
import pytest
from psycopg import errors
from psycopg.types.json import Jsonb
from scenarios import cli

import pglockkit
import pglockkit.aio as aio
from pglockkit import locks
from pglockkit import queue as q

MISSING = 987654


def _ghost() -> q.Job:
    return q.Job(MISSING, "q", {}, 1, 5, 1, datetime.now(UTC))


LIMIT_NOW = "SELECT value FROM pglockkit.settings WHERE name = 'max_payload_bytes'"


def _count(conn, where: str = "true") -> int:
    return conn.execute(f"SELECT count(*) FROM pglockkit.jobs WHERE {where}").fetchone()[0]


# --- a missing job is UnknownJob --------------------------------------------------------------

SYNC_CALLS = {
    "complete": lambda conn: q.complete(conn, _ghost()),
    "fail": lambda conn: q.fail(conn, _ghost(), "boom"),
    "fail with retry_in": lambda conn: q.fail(conn, _ghost(), "boom", retry_in=1),
    "extend": lambda conn: q.extend(conn, _ghost(), 30),
    "release": lambda conn: q.release(conn, _ghost()),
    "cancel": lambda conn: q.cancel(conn, MISSING),
}


@pytest.mark.parametrize("call", sorted(SYNC_CALLS))
def test_a_missing_job_raises_unknown_job(db, call):
    with pytest.raises(pglockkit.UnknownJob) as err:
        SYNC_CALLS[call](db.conn)
    assert err.value.sqlstate == "42704"
    assert f"no job with id {MISSING}" in str(err.value)
    assert not isinstance(err.value, pglockkit.UnknownNamespace)
    assert isinstance(err.value, pglockkit.UnknownObject) and isinstance(err.value, LookupError)


def test_a_missing_job_raises_unknown_job_from_aio(db):
    async def main() -> list[BaseException]:
        raised = []
        async with await psycopg.AsyncConnection.connect(db.dsn, autocommit=True) as conn:
            for call in (
                aio.complete(conn, _ghost()),
                aio.fail(conn, _ghost(), "boom"),
                aio.extend(conn, _ghost(), 30),
                aio.release(conn, _ghost()),
                aio.cancel(conn, MISSING),
            ):
                try:
                    await call
                except Exception as exc:
                    raised.append(exc)
        return raised

    raised = asyncio.run(main())
    assert len(raised) == 5 and all(type(e) is pglockkit.UnknownJob for e in raised), raised


def test_a_job_cancelled_and_pruned_under_its_worker_is_unknown_job(db):
    # The situation of issue 13 item 5: the worker's job row is gone when it reports back.
    job_id = q.enqueue(db.conn, "q", {"n": 1})
    [job] = q.claim(db.conn, "q", "w1", lease=30)
    assert q.cancel(db.conn, job_id)
    assert db.conn.execute("SELECT pglockkit.prune_jobs('0 s')").fetchone()[0] == 1
    for call in (q.complete, q.release, lambda c, j: q.fail(c, j, "boom"), lambda c, j: q.extend(c, j, 30)):
        with pytest.raises(pglockkit.UnknownJob):
            call(db.conn, job)


def test_an_unknown_namespace_is_still_unknown_namespace(db):
    with db.connect(autocommit=False) as conn:
        for call in (
            lambda: locks.try_xact_lock(conn, "nope", "r"),
            lambda: locks.xact_lock(conn, "nope", "r", timeout=1),
            lambda: locks.xact_lock_all(conn, "nope", ["a", "b"]),
        ):
            with pytest.raises(pglockkit.UnknownNamespace) as err:
                call()
            conn.rollback()
            assert err.value.sqlstate == "42704"
            assert not isinstance(err.value, pglockkit.UnknownJob)
            assert isinstance(err.value, pglockkit.UnknownObject) and isinstance(err.value, LookupError)


def test_42704_names_the_table_it_looked_in(db):
    """The structure the Python mapping reads: the error's schema and table fields."""
    for call, table in (
        (f"SELECT pglockkit.complete_job({MISSING}, 1)", "jobs"),
        (f"SELECT pglockkit.cancel_job({MISSING})", "jobs"),
        ("SELECT pglockkit.lock_key('nope', 'r')", "namespaces"),
        ("SELECT pglockkit.try_lock('nope', 7)", "namespaces"),
    ):
        with pytest.raises(errors.UndefinedObject) as err:
            db.conn.execute(call)
        assert (err.value.diag.schema_name, err.value.diag.table_name) == ("pglockkit", table), call


# --- infinite times ---------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["infinity", "-infinity"])
@pytest.mark.parametrize(
    "call",
    [
        "SELECT pglockkit.enqueue_job('q', '{}', %s::timestamptz)",
        "SELECT pglockkit.enqueue_job('q', run_at => %s::timestamptz, dedup_key => 'd')",
        "SELECT pglockkit.enqueue_jobs('q', ARRAY['{}', '{}']::jsonb[], %s::timestamptz)",
    ],
)
def test_an_infinite_run_at_is_refused(db, call, when):
    with pytest.raises(errors.InvalidParameterValue) as err:
        db.conn.execute(call, (when,))
    assert "run_at must be a finite time" in err.value.diag.message_primary
    assert _count(db.conn) == 0


def test_an_infinite_retry_in_is_refused(db):
    job_id = q.enqueue(db.conn, "q")
    [job] = q.claim(db.conn, "q", "w1", lease=30)
    if db.server.version >= 17:
        with pytest.raises(errors.InvalidParameterValue) as err:
            db.conn.execute("SELECT pglockkit.fail_job(%s, %s, 'boom', 'infinity')", (job.id, job.token))
        assert "retry_in must be finite" in err.value.diag.message_primary
    else:  # no infinite intervals before PostgreSQL 17: the literal itself is invalid
        with pytest.raises(errors.InvalidDatetimeFormat):
            db.conn.execute("SELECT pglockkit.fail_job(%s, %s, 'boom', 'infinity')", (job.id, job.token))
    row = db.conn.execute("SELECT status, token, last_error FROM pglockkit.jobs WHERE id = %s", (job_id,))
    assert row.fetchone() == ("running", job.token, None)
    assert q.fail(db.conn, job, "boom", retry_in=0) == "queued"


def test_the_tools_read_infinite_times_stored_before_the_fix(db):
    # Rows as an older version let them in (written here directly, as the superuser): a job due
    # since -infinity, enqueued 10 minutes ago, and one that would run at infinity.
    db.conn.execute(
        "INSERT INTO pglockkit.jobs (queue, payload, run_at, created_at) VALUES "
        "('inf', '{\"n\": 1}', '-infinity', now() - interval '10 minutes'), "
        "('inf', '{\"n\": 2}', 'infinity', now())"
    )
    ready, scheduled, lag = db.conn.execute(
        "SELECT ready, scheduled, extract(epoch FROM oldest_ready_age) FROM pglockkit.queue_stats"
    ).fetchone()
    assert (ready, scheduled) == (1, 1)
    assert 599 <= lag < 700  # waiting since it was enqueued

    out = cli("jobs", "inf", "--dsn", db.dsn)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and "-infinity" in lines[2] and " infinity" in lines[1], out.stdout

    out = cli("top", "--once", "--dsn", db.dsn)
    assert out.returncode == 0, out.stderr
    [row] = [line for line in out.stdout.splitlines() if line.startswith("inf ")]
    # About 10 minutes (10.1m when the CLI starts slowly under load), not infinite.
    assert row.split()[1:3] == ["1", "1"] and any(re.fullmatch(r"10\.[0-4]m", c) for c in row.split()), (
        out.stdout
    )

    out = cli("doctor", "--dsn", db.dsn, "--lag-after", "5m")
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"queue inf: the oldest ready job has waited 10\.[0-4]m", out.stdout), out.stdout

    # The job due since -infinity is claimed and runs like any other.
    [job] = q.claim(db.conn, "inf", "w1", lease=30)
    assert job.payload == {"n": 1} and q.complete(db.conn, job)


# --- payload size limit -------------------------------------------------------------------------

MB = 1024 * 1024


def _payload(size: int) -> dict:
    """A payload whose jsonb form is about size bytes."""
    return {"blob": "x" * (size - 20)}


def test_a_payload_over_the_limit_is_refused_with_its_size_and_the_limit(db):
    assert db.conn.execute(LIMIT_NOW).fetchone() == (MB,)
    q.enqueue(db.conn, "q", _payload(MB - 100))  # just under: accepted
    with pytest.raises(pglockkit.LimitExceeded) as err:
        q.enqueue(db.conn, "q", _payload(50 * MB))
    assert err.value.sqlstate == "54000" and isinstance(err.value, pglockkit.InvalidArgument)
    message = str(err.value)
    assert "payload is 52428" in message and "max_payload_bytes 1048576" in message, message
    assert err.value.hint and "set_max_payload_bytes" in err.value.hint
    assert _count(db.conn) == 1


def test_a_batch_with_one_payload_over_the_limit_stores_nothing(db):
    payloads = [_payload(100), _payload(MB - 100), _payload(MB + 100), _payload(10)]
    with pytest.raises(pglockkit.LimitExceeded) as err:
        q.enqueue_many(db.conn, "q", payloads)
    assert "payload 3 of 4 is" in str(err.value), str(err.value)
    assert _count(db.conn) == 0
    assert len(q.enqueue_many(db.conn, "q", payloads[:2])) == 2


def test_a_payload_of_at_most_4096_bytes_does_not_read_the_limit(db):
    # The fast path: while another session locks the settings table, small payloads still go in
    # at once; a larger one needs the setting and waits (here: until its lock_timeout).
    with db.connect(autocommit=False) as locker:
        locker.execute("LOCK TABLE pglockkit.config IN ACCESS EXCLUSIVE MODE")
        db.conn.execute("SET lock_timeout = '200ms'")
        q.enqueue(db.conn, "q", _payload(4000))
        q.enqueue_many(db.conn, "q", [_payload(4000), _payload(10)])
        for call in (
            lambda: q.enqueue(db.conn, "q", _payload(5000)),
            lambda: q.enqueue_many(db.conn, "q", [_payload(10), _payload(5000)]),
        ):
            with pytest.raises(pglockkit.LockTimeout):
                call()
        locker.rollback()
    assert _count(db.conn) == 3


def test_a_compressed_payload_is_measured_uncompressed(db):
    # A value read from a table arrives TOAST-compressed: 200 kB of one letter is about 2.3 kB so.
    db.conn.execute("SELECT pglockkit.set_max_payload_bytes(65536)")
    db.conn.execute("CREATE TABLE outbox (p jsonb)")
    db.conn.execute("INSERT INTO outbox VALUES (%s)", (Jsonb(_payload(200_000)),))
    compressed = db.conn.execute("SELECT pg_column_size(p), pg_column_compression(p) FROM outbox").fetchone()
    assert compressed[0] < 4096 and compressed[1] is not None, compressed
    for call in (
        "SELECT pglockkit.enqueue_job('q', p) FROM outbox",
        "SELECT pglockkit.enqueue_jobs('q', array_agg(p)) FROM outbox",
    ):
        with pytest.raises(errors.ProgramLimitExceeded):
            db.conn.execute(call)
    assert _count(db.conn) == 0


# The login roles the shared as_role fixture (tests/conftest.py) creates: name -> group role.
ROLES = {"jobs_producer": "pglockkit_user", "jobs_ops": "pglockkit_admin"}


def test_only_the_admin_role_sets_the_payload_limit(db, as_role):
    producer, ops = as_role("jobs_producer"), as_role("jobs_ops")
    assert ops.execute("SELECT pglockkit.set_max_payload_bytes(8192)").fetchone() == (MB,)  # the old one
    with pytest.raises(pglockkit.LimitExceeded):
        q.enqueue(producer, "q", _payload(10_000))
    q.enqueue(producer, "q", _payload(8000))
    # A producer cannot raise it: not through the setter, not in the table, not with a setting.
    for statement in (
        "SELECT pglockkit.set_max_payload_bytes(1073741824)",
        "UPDATE pglockkit.config SET max_payload_bytes = 268435455",
        "INSERT INTO pglockkit.config DEFAULT VALUES",
        "DELETE FROM pglockkit.config",
    ):
        with pytest.raises(errors.InsufficientPrivilege):
            producer.execute(statement)
    producer.execute("SET pglockkit.max_payload_bytes = '268435455'")
    with pytest.raises(pglockkit.LimitExceeded):
        q.enqueue(producer, "q", _payload(10_000))
    # Everyone can read it.
    assert producer.execute(LIMIT_NOW).fetchone() == (8192,)


@pytest.mark.parametrize(
    ("value", "sqlstate"), [(None, "22004"), (4095, "22003"), (0, "22003"), (268435456, "22003")]
)
def test_a_payload_limit_out_of_range_is_refused(db, value, sqlstate):
    with pytest.raises(psycopg.Error) as err:
        db.conn.execute("SELECT pglockkit.set_max_payload_bytes(%s::integer)", (value,))
    assert err.value.sqlstate == sqlstate
    assert db.conn.execute("SELECT max_payload_bytes FROM pglockkit.config").fetchone() == (MB,)
