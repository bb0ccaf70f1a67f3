"""Schedules: each due slot enqueued exactly once whoever ticks (six processes racing), a schedule
changed while they tick, catch-up after downtime, the jobs' payloads, bad input, privileges.

The race runs on a test clock: ``tick_schedules(as_of)`` ticks as of a time no later than now,
and the tickers pass a clock that starts an hour back and runs 60 times fast, so the per-minute
schedule ``* * * * *`` has a slot every real second."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg.types.json import Jsonb

import pglockkit
import pglockkit.aio as aio

ROLES = {"sched_worker": "pglockkit_user", "sched_admin": "pglockkit_admin"}

TICKER = r"""
import sys, time
from datetime import datetime, timedelta, UTC
import psycopg
dsn, base = sys.argv[1], datetime.fromisoformat(sys.argv[2])
t0, until = float(sys.argv[3]), float(sys.argv[4])
n = calls = 0
with psycopg.connect(dsn, autocommit=True) as conn:
    while time.time() < until:
        as_of = base + timedelta(seconds=(time.time() - t0) * 60)
        n += conn.execute("SELECT pglockkit.tick_schedules(%s)", (as_of,)).fetchone()[0]
        calls += 1
        time.sleep(0.005)
print(n, calls)
"""


def _backdate(db, name: str, to: datetime) -> None:
    """Move a schedule into the test clock's past: its next run becomes `to` (a slot)."""
    db.conn.execute("UPDATE pglockkit.job_schedules SET next_run = %s WHERE name = %s", (to, name))


def _slots(db, queue: str) -> list[tuple[str, str]]:
    return db.conn.execute(
        "SELECT payload->>'_slot', payload->>'v' FROM pglockkit.jobs WHERE queue = %s ORDER BY id", (queue,)
    ).fetchall()


def test_six_processes_ticking_enqueue_each_slot_once_and_a_change_loses_none(db):
    db.conn.execute("SELECT pglockkit.schedule('every', '* * * * *', 'q', '{\"v\": 1}', catch_up => 1000)")
    now = db.conn.execute("SELECT now()").fetchone()[0]
    base = now.replace(second=0, microsecond=0) - timedelta(hours=1)
    _backdate(db, "every", base)
    t0 = time.time()
    duration = 10.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TICKER, db.dsn, base.isoformat(), str(t0), str(t0 + duration)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    # Halfway, an admin replaces the schedule (new payload) while the six tick.
    time.sleep(duration / 2)
    with db.connect(autocommit=True) as admin:
        next_run = admin.execute(
            "SELECT pglockkit.schedule('every', '*/2 * * * *', 'q', '{\"v\": 2}', catch_up => 1000)"
        ).fetchone()[0]
        changed_at = admin.execute("SELECT clock_timestamp()").fetchone()[0]
    out = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, [err for _, err in out]
    enqueued = sum(int(o.split()[0]) for o, _ in out)
    calls = sum(int(o.split()[1]) for o, _ in out)

    slots = _slots(db, "q")
    # Every minute from base to the change, each once, all of the old definition: the tickers
    # enqueued the first ~5 (one a second), schedule() the old definition's due rest up to now.
    expected = []
    t = base
    while t <= changed_at:
        expected.append((t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "1"))
        t += timedelta(minutes=1)
    assert slots == expected
    by_tickers = enqueued
    assert 3 <= by_tickers <= 12, by_tickers  # about one slot a second of the race's first half
    assert calls > 100  # the tickers really raced: hundreds of ticks on one row
    # The new definition runs from the first */2 slot after the change.
    row = db.conn.execute(
        "SELECT cron, payload, next_run FROM pglockkit.schedules WHERE name = 'every'"
    ).fetchone()
    assert row == ("*/2 * * * *", {"v": 2}, next_run)
    assert (
        next_run > changed_at and next_run.minute % 2 == 0 and next_run - changed_at <= timedelta(minutes=2)
    )
    # ... and a tick then enqueues the new payload for it (moved into the test clock's past).
    # As of two minutes before next_run (not now: a minute may turn under a slow run): the 30
    # slots from next_run - 60 min to next_run - 2 min.
    _backdate(db, "every", next_run - timedelta(hours=1))
    as_of = next_run - timedelta(minutes=2)
    assert db.conn.execute("SELECT pglockkit.tick_schedules(%s)", (as_of,)).fetchone()[0] == 30
    assert {v for _, v in _slots(db, "q")[len(expected) :]} == {"2"}


def test_a_tick_waits_for_no_one_and_a_change_waits_for_the_tick(db):
    """Explicit interleaving: A ticks (holds the row), B ticks (skips it, 0 at once), C replaces
    the schedule (waits for A), A commits, C settles nothing twice."""
    db.conn.execute("SELECT pglockkit.schedule('s', '* * * * *', 'q', catch_up => 1000)")
    now = db.conn.execute("SELECT now()").fetchone()[0]
    _backdate(db, "s", now.replace(second=0, microsecond=0) - timedelta(minutes=10))
    with db.connect(autocommit=False) as a, db.connect() as b, db.connect() as c:
        assert a.execute("SELECT pglockkit.tick_schedules()").fetchone()[0] in (10, 11)
        b.execute("SET lock_timeout = '5s'")
        started = time.monotonic()
        assert b.execute("SELECT pglockkit.tick_schedules()").fetchone()[0] == 0
        assert time.monotonic() - started < 1
        result: list = []

        def change() -> None:
            try:
                result.append(
                    c.execute("SELECT pglockkit.schedule('s', '* * * * *', 'q', '{\"v\": 2}')").fetchone()
                )
            except Exception as exc:  # shown by the assertion below
                result.append(exc)

        changer = threading.Thread(target=change)
        changer.start()
        time.sleep(0.3)
        assert not result, result
        assert changer.is_alive()  # waiting for A's row lock
        a.commit()
        changer.join(10)
        assert result
    slots = [s for s, _ in _slots(db, "q")]
    assert len(slots) == len(set(slots)) and len(slots) in (10, 11, 12)


@pytest.mark.parametrize(("catch_up", "jobs"), [(None, 1), (10, 10), (1000, 30)])
def test_after_downtime_the_latest_slot_only_or_the_newest_catch_up(db, catch_up, jobs):
    args = "'s', '* * * * *', 'q'" + (f", catch_up => {catch_up}" if catch_up else "")
    db.conn.execute(f"SELECT pglockkit.schedule({args})")
    now = db.conn.execute("SELECT now()").fetchone()[0]
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=30)
    _backdate(db, "s", start)
    as_of = start + timedelta(minutes=29, seconds=30)  # 30 slots due: start .. start + 29 min
    assert db.conn.execute("SELECT pglockkit.tick_schedules(%s)", (as_of,)).fetchone()[0] == jobs
    got = [s for s, _ in _slots(db, "q")]
    newest = [(start + timedelta(minutes=29 - i)).strftime("%Y-%m-%dT%H:%M:%SZ") for i in range(jobs)]
    assert got == sorted(newest)
    row = db.conn.execute("SELECT next_run, last_run FROM pglockkit.schedules").fetchone()
    assert row == (start + timedelta(minutes=30), start + timedelta(minutes=29))
    assert db.conn.execute("SELECT pglockkit.tick_schedules(%s)", (as_of,)).fetchone()[0] == 0


def test_the_job_carries_payload_slot_priority_and_max_attempts(db):
    db.conn.execute(
        "SELECT pglockkit.schedule('report', '0 9 * * *', 'reports', '{\"kind\": \"daily\"}', "
        "'Europe/Berlin', priority => 7, max_attempts => 2)"
    )
    _backdate(db, "report", datetime(2024, 3, 31, 7, 0, tzinfo=UTC))  # 09:00 CEST
    assert db.conn.execute("SELECT pglockkit.tick_schedules('2024-03-31 07:00:05Z')").fetchone()[0] == 1
    payload, run_at, priority, max_attempts = db.conn.execute(
        "SELECT payload, run_at, priority, max_attempts FROM pglockkit.jobs"
    ).fetchone()
    assert payload == {"kind": "daily", "_schedule": "report", "_slot": "2024-03-31T07:00:00Z"}
    assert run_at == datetime(2024, 3, 31, 7, 0, tzinfo=UTC)
    assert (priority, max_attempts) == (7, 2)
    # The next run: 09:00 Berlin the next day.
    assert db.conn.execute("SELECT next_run FROM pglockkit.schedules").fetchone()[0] == datetime(
        2024, 4, 1, 7, 0, tzinfo=UTC
    )


def test_a_schedule_that_cannot_enqueue_skips_its_slot_and_says_why(db):
    db.conn.execute("SELECT pglockkit.schedule('big', '* * * * *', 'q', %s)", (Jsonb({"x": "y" * 6000}),))
    db.conn.execute("SELECT pglockkit.schedule('small', '* * * * *', 'q')")
    db.conn.execute("SELECT pglockkit.set_max_payload_bytes(4096)")
    now = db.conn.execute("SELECT now()").fetchone()[0]
    for name in ("big", "small"):
        _backdate(db, name, now.replace(second=0, microsecond=0) - timedelta(minutes=1))
    assert db.conn.execute("SELECT pglockkit.tick_schedules()").fetchone()[0] == 1  # small's
    error, next_run = db.conn.execute(
        "SELECT last_error, next_run FROM pglockkit.schedules WHERE name = 'big'"
    ).fetchone()
    assert error.startswith("54000: job payload is") and next_run > now


def test_a_failed_tick_skips_only_the_due_slots_in_the_schedules_zone(db):
    # Hourly business hours in Tokyo: 09:00-17:00 JST is 00:00-08:00 UTC. The 09:00 slot cannot
    # be enqueued; the next run is 10:00 JST, not the cron read in UTC (09:00 UTC, 18:00 JST),
    # which lost eight slots that were not due yet.
    c = db.conn
    c.execute(
        "SELECT pglockkit.schedule('biz', '0 9-17 * * *', 'q', %s, 'Asia/Tokyo')", (Jsonb({"x": "y" * 6000}),)
    )
    c.execute("SELECT pglockkit.set_max_payload_bytes(4096)")
    c.execute("UPDATE pglockkit.job_schedules SET next_run = '2024-01-10 00:00Z'")  # 09:00 JST
    assert c.execute("SELECT pglockkit.tick_schedules('2024-01-10 00:00:05Z')").fetchone()[0] == 0
    next_run, error = c.execute("SELECT next_run, last_error FROM pglockkit.schedules").fetchone()
    assert error.startswith("54000") and next_run == datetime(2024, 1, 10, 1, 0, tzinfo=UTC)
    c.execute("SELECT pglockkit.set_max_payload_bytes(1048576)")  # fixed at once
    for hour in range(1, 10):  # a tick an hour, 10:00 .. 18:00 JST
        c.execute("SELECT pglockkit.tick_schedules(%s)", (datetime(2024, 1, 10, hour, 0, 5, tzinfo=UTC),))
    slots = [s for (s,) in c.execute("SELECT payload->>'_slot' FROM pglockkit.jobs ORDER BY id")]
    assert slots == [f"2024-01-10T{h:02d}:00:00Z" for h in range(1, 9)]  # 10:00 .. 17:00 JST


def test_a_replacement_goes_on_when_the_old_definition_cannot_enqueue(db):
    # The admin lowered max_payload_bytes and shrinks the schedule's payload to fit, while a slot
    # of the old definition is due: the replacement is the fix, so it must not fail on the old
    # payload. The due slot is skipped as a tick would skip it, and last_error says why.
    c = db.conn
    c.execute("SELECT pglockkit.schedule('big', '* * * * *', 'q', %s)", (Jsonb({"x": "y" * 6000}),))
    c.execute("SELECT pglockkit.set_max_payload_bytes(4096)")
    now = c.execute("SELECT now()").fetchone()[0]
    _backdate(db, "big", now.replace(second=0, microsecond=0) - timedelta(minutes=5))
    c.execute("SELECT pglockkit.schedule('big', '* * * * *', 'q', '{\"small\": 1}')")
    payload, error, next_run = c.execute(
        "SELECT payload, last_error, next_run FROM pglockkit.schedules WHERE name = 'big'"
    ).fetchone()
    assert payload == {"small": 1} and error.startswith("54000: job payload is") and next_run > now
    assert c.execute("SELECT count(*) FROM pglockkit.jobs").fetchone()[0] == 0
    # The new definition enqueues its next slot.
    _backdate(db, "big", now.replace(second=0, microsecond=0))
    assert c.execute("SELECT pglockkit.tick_schedules()").fetchone()[0] == 1
    assert c.execute("SELECT last_error FROM pglockkit.schedules").fetchone()[0] is None


@pytest.mark.parametrize(
    ("call", "state", "message"),
    [
        ("'s', '* * * *', 'q'", "22023", "has 4 fields"),
        ("'s', '* * * * *', 'q', timezone => 'Mars/Olympus'", "22023", "time zone"),
        ("'s', '* * * * *', 'q', '[1]'", "22023", "must be a JSON object"),
        ("'s', '* * * * *', 'q', '{\"_slot\": 1}'", "22023", "must not have the keys"),
        ("'', '* * * * *', 'q'", "22023", "name must be 1 to 1024 bytes"),
        ("'s', '* * * * *', ''", "22023", "queue name must not be empty"),
        ("'s', '* * * * *', 'q', catch_up => 0", "22003", "catch_up 0 is out of range"),
        ("'s', '* * * * *', 'q', max_attempts => 1001", "22003", "max_attempts 1001"),
        ("NULL, '* * * * *', 'q'", "22004", "must not be null"),
        ("'s', NULL, 'q'", "22004", "cron must not be null"),
        ("'s', '* * * * *', NULL", "22004", "queue must not be null"),
    ],
)
def test_schedule_bad_input_changes_nothing(db, call, state, message):
    db.conn.execute("SELECT pglockkit.schedule('s', '0 0 * * *', 'q')")
    before = db.conn.execute("SELECT * FROM pglockkit.schedules").fetchall()
    with pytest.raises(psycopg.Error, match=message) as err:
        db.conn.execute(f"SELECT pglockkit.schedule({call})")
    assert err.value.sqlstate == state
    assert db.conn.execute("SELECT * FROM pglockkit.schedules").fetchall() == before


def test_unschedule_says_whether_there_was_one_and_tick_refuses_the_future(db):
    db.conn.execute("SELECT pglockkit.schedule('s', '0 0 * * *', 'q')")
    assert db.conn.execute("SELECT pglockkit.unschedule('s')").fetchone()[0] is True
    assert db.conn.execute("SELECT pglockkit.unschedule('s')").fetchone()[0] is False
    with pytest.raises(psycopg.errors.NullValueNotAllowed):
        db.conn.execute("SELECT pglockkit.unschedule(NULL)")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="in the future"):
        db.conn.execute("SELECT pglockkit.tick_schedules(now() + interval '1 minute')")


def test_workers_tick_and_read_admins_schedule(db, as_role):
    worker, admin = as_role("sched_worker"), as_role("sched_admin")
    assert admin.execute("SELECT pglockkit.schedule('s', '* * * * *', 'q')").fetchone()[0] is not None
    for stmt in ("SELECT pglockkit.schedule('t', '* * * * *', 'q')", "SELECT pglockkit.unschedule('s')"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            worker.execute(stmt)
    assert worker.execute("SELECT pglockkit.tick_schedules()").fetchone()[0] == 0
    assert worker.execute("SELECT name, queue FROM pglockkit.schedules").fetchall() == [("s", "q")]
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        worker.execute("UPDATE pglockkit.job_schedules SET next_run = now()")
    assert admin.execute("SELECT pglockkit.unschedule('s')").fetchone()[0] is True


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_worker_ticks_the_schedules_as_it_polls(db, asynchronous):
    db.conn.execute("SELECT pglockkit.schedule('w', '* * * * *', 'ticked', '{\"to\": \"ana\"}')")
    now = db.conn.execute("SELECT now()").fetchone()[0]
    _backdate(db, "w", now.replace(second=0, microsecond=0) - timedelta(minutes=1))
    seen: list = []

    def handler(job):
        seen.append(job.payload)

    async def ahandler(job):
        seen.append(job.payload)

    worker = pglockkit.Worker(db.dsn, "ticked", ahandler if asynchronous else handler)
    timer = threading.Timer(10, worker.stop)
    timer.start()
    try:
        assert worker.run(max_jobs=1) == 1
    finally:
        timer.cancel()
    assert seen[0]["to"] == "ana" and seen[0]["_schedule"] == "w"


def test_python_and_aio_calls(db):
    conn = db.conn
    next_run = pglockkit.schedule(
        conn, "p", "*/5 * * * *", "q", {"a": 1}, timezone="Europe/Berlin", catch_up=3
    )
    assert (
        next_run == pglockkit.cron_next(conn, "*/5 * * * *", None, "Europe/Berlin")
        or next_run.minute % 5 == 0
    )
    [row] = pglockkit.schedules(conn)
    assert (row["name"], row["payload"], row["catch_up"], row["next_run"]) == ("p", {"a": 1}, 3, next_run)
    assert pglockkit.tick_schedules(conn) == 0
    assert pglockkit.cron_next(conn, "0 0 1 1 *", datetime(2024, 6, 1, tzinfo=UTC)) == datetime(
        2025, 1, 1, tzinfo=UTC
    )

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(db.dsn, autocommit=True) as aconn:
            assert [r["name"] for r in await aio.schedules(aconn)] == ["p"]
            assert await aio.tick_schedules(aconn) == 0
            assert await aio.schedule(aconn, "p2", "@daily", "q") is not None
            assert await aio.unschedule(aconn, "p2") is True
            assert await aio.cron_next(aconn, "@yearly", datetime(2024, 6, 1, tzinfo=UTC)) == datetime(
                2025, 1, 1, tzinfo=UTC
            )

    asyncio.run(run())
    assert pglockkit.unschedule(conn, "p") is True and pglockkit.unschedule(conn, "p") is False
    with pytest.raises(pglockkit.InvalidArgument):
        pglockkit.schedule(conn, "bad", "* * *", "q")


def test_cli_schedule_list_unschedule_and_scheduler(db):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pglockkit.cli", *args, "--dsn", db.dsn],
            capture_output=True,
            text=True,
            timeout=60,
        )

    made = cli(
        "schedule", "nightly", "0 2 * * *", "reports", "--payload", '{"k": 1}', "--timezone", "Europe/Berlin"
    )
    assert made.returncode == 0 and "next run" in made.stdout, made.stderr
    assert "nightly" in cli("schedules").stdout
    bad = cli("schedule", "x", "0 2 * *", "reports")
    assert bad.returncode == 1 and "[22023]" in bad.stderr and "has 4 fields" in bad.stderr
    last = db.conn.execute(
        "SELECT pglockkit.cron_next('0 2 * * *', now() - interval '1 day', 'Europe/Berlin')"
    )
    _backdate(db, "nightly", last.fetchone()[0])  # its last slot, not enqueued yet
    proc = subprocess.Popen(
        [sys.executable, "-m", "pglockkit.cli", "scheduler", "--every", "0.1", "--dsn", db.dsn],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while (
        time.monotonic() < deadline
        and not db.conn.execute("SELECT count(*) FROM pglockkit.jobs").fetchone()[0]
    ):
        time.sleep(0.1)
    proc.terminate()  # SIGTERM: stops after the tick in progress
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "1 job(s) enqueued" in out
    assert cli("unschedule", "nightly").returncode == 0
    gone = cli("unschedule", "nightly")
    assert gone.returncode == 1 and "no schedule named 'nightly'" in gone.stderr


def test_unschedule_while_four_sessions_tick_stops_the_slots_at_once(db):
    """docs/schedules.md: unschedule() deletes the row: slots after it commits are not enqueued, jobs
    already enqueued stay. Four sessions tick a per-minute schedule on the 60-times-fast test clock
    (a slot every real second, each contested); once unschedule() has returned, no job is added,
    and every slot enqueued until then is there once."""
    db.conn.execute("SELECT pglockkit.schedule('every', '* * * * *', 'q', catch_up => 1000)")
    now = db.conn.execute("SELECT now()").fetchone()[0]
    base = now.replace(second=0, microsecond=0) - timedelta(hours=1)
    _backdate(db, "every", base)
    t0 = time.time()
    stop = threading.Event()
    errors: list[BaseException] = []
    ticks = [0]

    def ticker() -> None:
        try:
            with db.connect() as conn:
                while not stop.is_set():
                    as_of = base + timedelta(seconds=(time.time() - t0) * 60)
                    conn.execute("SELECT pglockkit.tick_schedules(%s)", (as_of,))
                    ticks[0] += 1
                    time.sleep(0.002)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=ticker) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(2.5)
    assert db.conn.execute("SELECT pglockkit.unschedule('every')").fetchone()[0] is True
    at_unschedule = _slots(db, "q")
    time.sleep(2)  # two more slots' worth of ticking
    stop.set()
    for t in threads:
        t.join()
    assert errors == [] and ticks[0] > 100
    slots = _slots(db, "q")
    assert slots == at_unschedule  # nothing after unschedule returned
    assert len(slots) >= 2 and len({s for s, _ in slots}) == len(slots)  # each slot once


def test_schedule_refuses_a_payload_whose_jobs_would_be_over_the_payload_limit(db):
    """Each job of a schedule carries its payload plus "_schedule" (the name, up to 1024 bytes)
    and "_slot". schedule() checked the payload alone: one that fit while its jobs did not was
    accepted, and then every slot was skipped (a WARNING and last_error at each tick), the limit
    unchanged: the schedule never ran. It is refused up front now (54000), and a payload whose
    jobs fit is stored and runs."""
    c = db.conn
    c.execute("SELECT pglockkit.set_max_payload_bytes(4096)")
    name = "n" * 1000
    too_big = Jsonb({"blob": "x" * 4070})
    assert c.execute("SELECT pg_column_size(%s::jsonb)", (too_big,)).fetchone()[0] <= 4096
    with pytest.raises(psycopg.errors.ProgramLimitExceeded) as refused:
        c.execute("SELECT pglockkit.schedule(%s, '* * * * *', 'q', %s)", (name, too_big))
    assert "over the limit max_payload_bytes 4096" in str(refused.value)
    assert c.execute("SELECT count(*) FROM pglockkit.schedules").fetchone()[0] == 0
    fits = Jsonb({"blob": "x" * 2900})  # with the name and the slot, under 4096 bytes
    c.execute("SELECT pglockkit.schedule(%s, '* * * * *', 'q', %s)", (name, fits))
    now = c.execute("SELECT now()").fetchone()[0]
    _backdate(db, name, now.replace(second=0, microsecond=0) - timedelta(minutes=1))
    assert c.execute("SELECT pglockkit.tick_schedules()").fetchone()[0] == 1
    assert c.execute("SELECT last_error FROM pglockkit.schedules").fetchone()[0] is None


def test_cli_scheduler_once_that_cannot_connect_exits_1(db):
    """docs/cli.md: errors print their SQLSTATE and exit 1. `pglockkit scheduler --once` (a cron
    job's or a Kubernetes CronJob's tick) that cannot reach the database, or is refused by it,
    ticked nothing: it must not exit 0 saying "0 job(s) enqueued" after promising to retry."""
    refused = db.dsn.replace(f"user={db.conn.info.user}", "user=no_such_role_sched")
    assert refused != db.dsn
    done = subprocess.run(
        [sys.executable, "-m", "pglockkit.cli", "scheduler", "--once", "--dsn", refused],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "retrying" not in done.stderr


def test_cli_scheduler_goes_on_while_the_database_refuses_writes_and_ticks_once_it_takes_them(db):
    """A database that refuses writes (default_transaction_read_only, as an old primary does
    after a failover) failed the tick with 25006, and `pglockkit scheduler` exited 1: the
    schedules stopped until something restarted it, where a worker's ticker carries on. It now
    says so on one line, backs off (0.2, 0.4, 0.8 s ... for --every 0.1s), tries again on a new
    connection, and ticks once the database takes writes."""
    db.conn.execute("SELECT pglockkit.schedule('minutely', '* * * * *', 'q')")
    now = db.conn.execute("SELECT now()").fetchone()[0]
    _backdate(db, "minutely", now.replace(second=0, microsecond=0) - timedelta(minutes=1))
    dbname = db.conn.info.dbname
    db.conn.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
    proc = subprocess.Popen(
        [sys.executable, "-m", "pglockkit.cli", "scheduler", "--every", "0.1s", "--dsn", db.dsn],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2.5)
        assert proc.poll() is None, proc.communicate()
        assert db.conn.execute("SELECT count(*) FROM pglockkit.jobs").fetchone()[0] == 0
        db.conn.execute(f'ALTER DATABASE "{dbname}" RESET default_transaction_read_only')
        deadline = time.monotonic() + 20
        while not db.conn.execute("SELECT count(*) FROM pglockkit.jobs").fetchone()[0]:
            assert time.monotonic() < deadline, "no tick after the database took writes again"
            time.sleep(0.1)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    failed = [line for line in err.splitlines() if "tick failed" in line]
    assert failed and all("read-only transaction" in line and "retrying in" in line for line in failed), err
    assert len(failed) <= 5, err  # backing off: 0.2 + 0.4 + 0.8 + 1.6 s fill the 2.5 s
    assert "1 job(s) enqueued" in out
