"""Singleton runs and ``pglockkit once``: one run per job and slot across processes, with the
policy for a holder that dies (its run is re-run by the next start)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import psycopg
import pytest

import pglockkit
import pglockkit.aio as aio
from pglockkit import finish_run, start_run


def _history(conn, job):
    return conn.execute(
        "SELECT slot, status, attempt FROM pglockkit.run_history WHERE job = %s ORDER BY id", (job,)
    ).fetchall()


def test_one_run_per_slot(db):
    with db.connect() as a, db.connect() as b:
        run = start_run(a, "nightly", "2026-11-30", "pod-a")
        assert run is not None
        assert start_run(b, "nightly", "2026-11-30", "pod-b") is None  # running elsewhere
        assert finish_run(a, run, True, "42 rows")
        assert not finish_run(a, run, True)  # already finished
        assert start_run(b, "nightly", "2026-11-30", "pod-b") is None  # already ran
        assert start_run(b, "nightly", "2026-12-01", "pod-b") is not None  # the next slot
    row = db.conn.execute(
        "SELECT status, holder, detail, duration >= '0'::interval FROM pglockkit.run_history WHERE id = %s",
        (run,),
    ).fetchone()
    assert row == ("succeeded", "pod-a", "42 rows", True)


def test_failed_run_is_recorded_and_not_rerun(db):
    with db.connect() as conn:
        run = start_run(conn, "report", "s1", "pod")
        assert finish_run(conn, run, False, "exit 3")
        assert start_run(conn, "report", "s1", "pod") is None
    assert _history(db.conn, "report") == [("s1", "failed", 1)]


def test_holder_that_dies_is_abandoned_and_rerun(db):
    holder = db.connect()
    run = start_run(holder, "nightly", "s", "pod-a")
    assert _history(db.conn, "nightly") == [("s", "running", 1)]
    db.conn.execute("SELECT pg_terminate_backend(%s)", (holder.info.backend_pid,))
    deadline = time.monotonic() + 2
    while _history(db.conn, "nightly") != [("s", "abandoned", 1)]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with db.connect() as b:
        assert start_run(b, "nightly", "s", "pod-b") == run  # taken over
        assert _history(db.conn, "nightly") == [("s", "running", 2)]
        assert finish_run(b, run, True)
    holder.close()


def test_a_runner_whose_session_ended_cannot_finish_the_attempt_that_took_over(db):
    # pod-a's backend is killed while its process lives; pod-b takes the slot over (attempt 2,
    # the same run id); pod-a reconnects and reports its outcome. That recorded pod-a's failure over
    # pod-b's running attempt (and pod-b's own finish_run then said false).
    a = db.connect()
    run = start_run(a, "nightly", "2026-12-01", "pod-a")
    db.conn.execute("SELECT pg_terminate_backend(%s)", (a.info.backend_pid,))
    deadline = time.monotonic() + 2
    while _history(db.conn, "nightly") != [("2026-12-01", "abandoned", 1)]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    a.close()
    with db.connect() as b, db.connect() as a_again:
        assert start_run(b, "nightly", "2026-12-01", "pod-b") == run
        assert not finish_run(a_again, run, False, "pod-a: connection lost")
        assert db.conn.execute(
            "SELECT status, holder, attempt, detail FROM pglockkit.run_history WHERE id = %s", (run,)
        ).fetchone() == ("running", "pod-b", 2, None)
        assert finish_run(b, run, True)


def test_only_the_starters_session_finishes_a_run(db, advisory_locks):
    # finish_run releases the slot's lock, which only the starter's session can: from another
    # session it said true and left the starter holding the lock for as long as it lived.
    with db.connect() as starter, db.connect() as other:
        run = start_run(starter, "report", "s1", "pod-a")
        assert not finish_run(other, run, True)
        assert _history(db.conn, "report") == [("s1", "running", 1)]
        assert advisory_locks(db.conn, starter.info.backend_pid, granted_only=True) == 1
        assert finish_run(starter, run, True)
        assert advisory_locks(db.conn, starter.info.backend_pid, granted_only=True) == 0
        assert _history(db.conn, "report") == [("s1", "succeeded", 1)]


def test_finish_unknown_run(db):
    with pytest.raises(psycopg.errors.UndefinedObject, match="no run with id 999") as err:
        db.conn.execute("SELECT pglockkit.finish_run(999, true)")
    assert (err.value.diag.schema_name, err.value.diag.table_name) == ("pglockkit", "runs")
    # Python tells it from an unknown namespace or job without reading the message.
    with pytest.raises(pglockkit.UnknownRun, match="no run with id 999") as py_err:
        finish_run(db.conn, 999, True)
    assert isinstance(py_err.value, pglockkit.UnknownObject) and isinstance(py_err.value, LookupError)
    assert not isinstance(py_err.value, (pglockkit.UnknownJob, pglockkit.UnknownNamespace))


@pytest.mark.parametrize(
    ("call", "sqlstate"),
    [
        ("SELECT pglockkit.start_run(NULL, 's', 'h')", "22004"),
        ("SELECT pglockkit.start_run('j', NULL, 'h')", "22004"),
        ("SELECT pglockkit.start_run('j', 's', NULL)", "22004"),
        ("SELECT pglockkit.start_run('', 's', 'h')", "22023"),
        ("SELECT pglockkit.start_run('j', '', 'h')", "22023"),
        ("SELECT pglockkit.start_run('j', 's', '')", "22023"),
        ("SELECT pglockkit.finish_run(NULL, true)", "22004"),
        ("SELECT pglockkit.finish_run(1, NULL)", "22004"),
    ],
)
def test_bad_input(db, call, sqlstate):
    with pytest.raises(psycopg.Error) as err:
        db.conn.execute(call)
    assert err.value.sqlstate == sqlstate
    assert db.conn.execute("SELECT count(*) FROM pglockkit.runs").fetchone()[0] == 0


def _once(dsn, *args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "pglockkit.cli", "once", "--dsn", dsn, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_six_cron_pods_at_once_run_the_command_exactly_once(db, tmp_path):
    out = tmp_path / "ran.txt"
    command = [
        "--",
        sys.executable,
        "-c",
        f"open({str(out)!r}, 'a').write('ran\\n'); import time; time.sleep(0.5)",
    ]
    for _round in range(2):
        pods = [_once(db.dsn, "nightly", "--slot", "2026-11-30", *command) for _ in range(6)]
        results = [p.communicate(timeout=60) for p in pods]
        assert [p.returncode for p in pods] == [0] * 6, "\n".join(err for _, err in results)
        assert out.read_text() == "ran\n"  # once in the first round, never in the second
    assert _history(db.conn, "nightly") == [("2026-11-30", "succeeded", 1)]


def test_once_propagates_the_exit_status_and_records_failure(db):
    proc = _once(db.dsn, "flaky", "--", sys.executable, "-c", "raise SystemExit(3)")
    proc.communicate(timeout=60)
    assert proc.returncode == 3
    today = pglockkit.runs.today_utc()
    assert _history(db.conn, "flaky") == [(today, "failed", 1)]
    detail = db.conn.execute("SELECT detail FROM pglockkit.run_history WHERE job = 'flaky'").fetchone()[0]
    assert "exit status 3" in detail


def test_killed_once_is_rerun_by_the_next_pod(db, tmp_path):
    proc = _once(db.dsn, "nightly", "--slot", "s1", "--", "sleep", "30", start_new_session=True)
    deadline = time.monotonic() + 20
    while _history(db.conn, "nightly") != [("s1", "running", 1)]:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the pod dies: the wrapper and its command
    proc.wait()
    out = tmp_path / "rerun"
    rerun = _once(db.dsn, "nightly", "--slot", "s1", "--", "touch", str(out))
    rerun.communicate(timeout=60)
    assert rerun.returncode == 0 and out.exists()
    assert _history(db.conn, "nightly") == [("s1", "succeeded", 2)]


def test_once_without_command_is_a_usage_error(db):
    proc = _once(db.dsn, "nightly")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--" in err


def test_singleton_decorator(db):
    calls = []
    barrier = threading.Barrier(2)

    @pglockkit.singleton(db.dsn, "tick", slot="t1")
    def tick(name):
        calls.append(name)
        time.sleep(0.3)
        return name

    results = []
    threads = [threading.Thread(target=lambda n=n: (barrier.wait(), results.append(tick(n)))) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sorted(results, key=str) == sorted([calls[0], None], key=str)

    @pglockkit.singleton(db.dsn, "boom", slot="t1")
    def boom():
        raise ValueError("bad data")

    with pytest.raises(ValueError):
        boom()
    assert boom() is None  # the slot had its (failed) run
    assert _history(db.conn, "boom") == [("t1", "failed", 1)]


def test_once_with_a_missing_command_exits_127_and_records_failure(db):
    proc = _once(db.dsn, "typo", "--slot", "s", "--", "no-such-command-xyz")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 127 and "cannot run 'no-such-command-xyz'" in err
    assert _history(db.conn, "typo") == [("s", "failed", 1)]


def test_start_run_twice_in_a_session_runs_once_and_leaks_no_lock(db, advisory_locks):
    with db.connect() as conn:
        run = conn.execute("SELECT pglockkit.start_run('twice', 's1', 'a')").fetchone()[0]
        assert run is not None
        assert conn.execute("SELECT pglockkit.start_run('twice', 's1', 'a')").fetchone()[0] is None
        assert conn.execute("SELECT pglockkit.finish_run(%s, true)", (run,)).fetchone()[0] is True
        assert advisory_locks(conn, conn.info.backend_pid) == 0


def test_a_rolled_back_or_failed_start_run_does_not_block_the_slot(db, advisory_locks):
    with db.connect() as a, db.connect() as b:
        a.execute("BEGIN")
        assert a.execute("SELECT pglockkit.start_run('rb', 's1', 'a')").fetchone()[0] is not None
        a.execute("ROLLBACK")  # the run's row is gone; its session key is not
        # The same session can start the slot again (on the key it still holds) and finish it.
        run = a.execute("SELECT pglockkit.start_run('rb', 's1', 'a')").fetchone()[0]
        assert run is not None
        assert a.execute("SELECT pglockkit.finish_run(%s, true)", (run,)).fetchone()[0] is True
        assert advisory_locks(a, a.info.backend_pid) == 0
        # A start whose insert fails (a job name too long) releases the slot's key.
        with pytest.raises(psycopg.errors.CheckViolation):
            a.execute("SELECT pglockkit.start_run(repeat(md5('x'), 100), 's1', 'a')")
        assert advisory_locks(a, a.info.backend_pid) == 0
        assert b.execute("SELECT pglockkit.start_run('rb', 's2', 'b')").fetchone()[0] is not None


def test_prune_runs_deletes_finished_runs_only(db):
    """Issue 13 item 11: pruning runs. Finished runs older than older_than go; a running one stays.
    A pruned slot's row is gone, so start_run would run that slot again: prune only slots that no
    pod can still start (docs/runs.md says so)."""
    with db.connect() as a:
        ok = start_run(a, "prune", "s1", "a")
        assert finish_run(a, ok, True)
        failed = start_run(a, "prune", "s2", "a")
        assert finish_run(a, failed, False, "boom")
        running = start_run(a, "prune", "s3", "a")
        assert pglockkit.prune_runs(a, 3600) == 0
        assert pglockkit.prune_runs(a, 0) == 2
        assert _history(a, "prune") == [("s3", "running", 1)]
        assert finish_run(a, running, True)
        with pytest.raises(psycopg.Error) as err:
            a.execute("SELECT pglockkit.prune_runs(NULL)")
        assert err.value.sqlstate == "22004"
        with pytest.raises(psycopg.Error) as err:
            a.execute("SELECT pglockkit.prune_runs('-1 s')")
        assert err.value.sqlstate == "22023"
        assert a.execute("SELECT pglockkit.prune_runs('1000000 years')").fetchone()[0] == 0
        assert _history(a, "prune") == [("s3", "succeeded", 1)]
        # The documented consequence: the pruned slot s1 can be started again.
        assert start_run(a, "prune", "s1", "a") is not None


@pytest.mark.parametrize(
    "message",
    ["unexpected bytes b'\x00\x01' in row 7", "cannot parse report-\udcff.csv"],
    ids=["nul", "lone-surrogate"],
)
def test_run_once_records_a_failure_the_server_cannot_store_as_is_and_the_slot_does_not_rerun(db, message):
    """A body's exception is recorded as the run's failure whatever its text holds: a NUL byte
    (PostgreSQL text cannot hold one) or a lone surrogate (a file name read from a non-UTF-8
    directory, which psycopg cannot encode) made finish_run raise, which replaced the body's
    exception, left the run 'running' (abandoned once the connection closed), and let the next pod
    run the slot again."""

    class BadRecord(Exception):
        pass

    with pytest.raises(BadRecord), pglockkit.run_once(db.dsn, "odd-detail", "2026-11-30") as run:
        assert run is not None
        raise BadRecord(message)
    assert _history(db.conn, "odd-detail") == [("2026-11-30", "failed", 1)]
    with pglockkit.run_once(db.dsn, "odd-detail", "2026-11-30") as again:
        assert again is None, "a failed slot ran again"


def test_run_once_keeps_the_bodys_exception_when_its_connection_is_lost(db):
    """If the run's connection dies while the body fails, the run cannot be recorded (the next
    start_run re-runs it), but the caller still gets the body's own exception, not the driver's
    AdminShutdown: sole_writer and Lease treat a lost session the same way on exit."""
    with pytest.raises(ValueError, match="the body's own error"):
        with pglockkit.run_once(db.dsn, "lost-conn", "2026-11-30") as run:
            assert run is not None
            pid = db.conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'pglockkit run lost-conn'"
            ).fetchone()[0]
            db.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            raise ValueError("the body's own error")


def test_run_once_says_the_outcome_was_not_recorded_when_its_connection_was_lost(db, caplog):
    """The body succeeds but the run's connection died meanwhile (a server restart; here its
    backend is terminated): the slot is free and the outcome cannot be recorded. What came out of
    the block was the driver's "terminating connection due to administrator command" alone, not
    that the outcome was not recorded and that the slot may run again. Still an OperationalError,
    sync and async, so that callers who caught the driver's error still do."""
    caplog.set_level("WARNING", "pglockkit.runs")

    def terminate(job: str) -> None:
        db.conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (f"pglockkit run {job}",),
        )

    with pytest.raises(psycopg.OperationalError, match="was not recorded") as raised:
        with pglockkit.run_once(db.dsn, "lost-ok", "2026-11-30") as run:
            assert run is not None
            terminate("lost-ok")
    assert "the slot may run again" in str(raised.value)
    assert "terminating connection" in str(raised.value.__cause__)

    async def main():
        with pytest.raises(psycopg.OperationalError, match="was not recorded"):
            async with aio.run_once(db.dsn, "alost-ok", "2026-11-30") as run:
                assert run is not None
                terminate("alost-ok")

    asyncio.run(main())
    warned = [r.getMessage() for r in caplog.records if "was not recorded" in r.getMessage()]
    assert len(warned) == 2 and "job=lost-ok" in warned[0] and "job=alost-ok" in warned[1], warned
    with pglockkit.run_once(db.dsn, "lost-ok", "2026-11-30") as again:
        assert again is not None  # the slot runs again, as the error said


@pytest.mark.parametrize("empty", ["slot", "holder"])
def test_run_once_refuses_an_empty_slot_or_holder_as_sql_does(db, empty):
    """An empty slot ran today's slot, and an empty holder became this host's name: both are
    refused (22023), as start_run and `pglockkit once --slot ''` refuse them."""
    kwargs = {"slot": "2026-11-30", "holder": "pod-1", empty: ""}
    with pytest.raises(pglockkit.InvalidArgument, match="must not be empty"):
        with pglockkit.run_once(db.dsn, "empty-args", **kwargs):
            pytest.fail("ran with an empty " + empty)

    async def main():
        with pytest.raises(pglockkit.InvalidArgument, match="must not be empty"):
            async with aio.run_once(db.dsn, "empty-args", **kwargs):
                pytest.fail("ran with an empty " + empty)

    asyncio.run(main())
    assert _history(db.conn, "empty-args") == []


def test_async_run_once_records_a_nul_failure_and_keeps_the_bodys_exception_on_a_lost_session(db):
    async def main():
        with pytest.raises(ValueError, match="row 7"):
            async with aio.run_once(db.dsn, "anul", "s1") as run:
                assert run is not None
                raise ValueError("bytes b'\x00' in row 7")
        with pytest.raises(ValueError, match="the body's own error"):
            async with aio.run_once(db.dsn, "alost", "s1") as run:
                assert run is not None
                db.conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'pglockkit run alost'"
                )
                raise ValueError("the body's own error")

    asyncio.run(main())
    assert _history(db.conn, "anul") == [("s1", "failed", 1)]
    detail = db.conn.execute("SELECT detail FROM pglockkit.runs WHERE job = 'anul'").fetchone()[0]
    assert detail == "ValueError: bytes b'\\x00' in row 7"


def test_a_finish_run_whose_transaction_rolls_back_keeps_the_slot_with_its_live_runner(db):
    """docs/runs.md: the starter's session holds the slot's lock until finish_run; a slot runs once;
    only a run whose holder died is taken over. finish_run called in a transaction that then rolls
    back (the runner records its outcome and its report in one transaction, and the COMMIT fails)
    records nothing, so the run is still running with its runner alive: it must not turn
    'abandoned' and be run again by the next pod, and the runner must still be able to record it."""
    with db.connect() as a, db.connect() as b:
        run = start_run(a, "nightly", "s1", "pod-a")
        a.execute("BEGIN")
        assert a.execute("SELECT pglockkit.finish_run(%s, true, 'report written')", (run,)).fetchone()[0]
        a.execute("ROLLBACK")  # e.g. the report's insert failed at COMMIT
        assert _history(db.conn, "nightly") == [("s1", "running", 1)]  # pod-a lives: not abandoned
        assert start_run(b, "nightly", "s1", "pod-b") is None  # not run a second time
        assert finish_run(a, run, True, "report written")  # the runner records it after all
    assert _history(db.conn, "nightly") == [("s1", "succeeded", 1)]


def test_start_run_returns_at_once_while_the_runner_records_its_outcome(db):
    """docs/runs.md: "Everyone else gets NULL at once." A pod that starts the slot while the runner's
    finish_run is in an open transaction must not wait for that transaction."""
    with db.connect() as a, db.connect() as b:
        run = start_run(a, "nightly", "s1", "pod-a")
        a.execute("BEGIN")
        assert a.execute("SELECT pglockkit.finish_run(%s, true)", (run,)).fetchone()[0]
        b.execute("SET statement_timeout = '2s'")
        started = time.monotonic()
        try:
            got = start_run(b, "nightly", "s1", "pod-b")
        except psycopg.errors.QueryCanceled:
            got = "waited"
        waited = time.monotonic() - started
        a.execute("COMMIT")
        assert got is None and waited < 1, (got, waited)
    assert _history(db.conn, "nightly") == [("s1", "succeeded", 1)]


RUN_HOLDER = r"""
import sys, time
import psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    print(conn.execute("SELECT pglockkit.start_run('nightly', 's1', 'pod-0')").fetchone()[0], flush=True)
    time.sleep(600)
"""


def test_six_pods_racing_for_a_sigkilled_runners_slot_take_it_over_once(db):
    """docs/runs.md: a run whose holder died is taken over by the next start_run (attempt + 1), and a
    slot runs once per attempt. The runner is a real process, SIGKILLed; six pods call start_run at
    a barrier, before the kill (all NULL) and after it: exactly one takes the run over."""
    holder = subprocess.Popen([sys.executable, "-c", RUN_HOLDER, db.dsn], stdout=subprocess.PIPE, text=True)
    try:
        run = int(holder.stdout.readline())
        conns = [db.connect() for _ in range(6)]
        barrier = threading.Barrier(6)

        def race() -> list:
            got: list = []

            def pod(i: int) -> None:
                barrier.wait(10)
                got.append(start_run(conns[i], "nightly", "s1", f"pod-{i + 1}"))

            threads = [threading.Thread(target=pod, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return got

        assert race() == [None] * 6  # the runner lives
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + 2
        while _history(db.conn, "nightly") != [("s1", "abandoned", 1)]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        got = race()
        assert sorted(got, key=str) == sorted([run] + [None] * 5, key=str), got
        assert _history(db.conn, "nightly") == [("s1", "running", 2)]
        assert race() == [None] * 6  # the new runner lives
        for conn in conns:
            conn.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_runs_lists_the_newest_first_also_within_one_second(db):
    """`pglockkit runs` / `pglockkit.runs.runs()` are documented "newest first" (and `--limit N`
    the N newest). The query orders by its own output column `started_at`, which it truncated
    to the second, so runs started within one second come in arbitrary order (oldest first, as
    stored) and `--limit 1` may return an older run than the newest."""
    from pglockkit.runs import runs

    with db.connect() as conn:
        conn.autocommit = True
        ids = []
        for i in range(12):  # a few ms each: most of them share their second
            run = start_run(conn, "newest-first", f"slot-{i}", "pod-a")
            assert finish_run(conn, run, True)
            ids.append(run)
        newest_first = [
            r[0]
            for r in conn.execute(
                "SELECT id FROM pglockkit.run_history WHERE job = 'newest-first'"
                " ORDER BY started_at DESC, id DESC"
            )
        ]
        assert newest_first == ids[::-1]  # the runs' own timestamps order them
        listed = [r["id"] for r in runs(conn, "newest-first")]
        assert listed == newest_first
        assert [r["id"] for r in runs(conn, "newest-first", limit=1)] == [ids[-1]]


def test_a_run_outlasting_the_servers_idle_session_timeout_is_not_started_again_meanwhile(db):
    """A nightly job that runs longer than the server's idle_session_timeout (a managed server's
    or a role's setting): run_once's and ``pglockkit once``'s connections sit idle while the body
    or command runs, the server ends them, the slot's lock goes, and the next cron pod starts the
    same slot while the first is still running: the job runs twice at once."""
    db.conn.execute(f'ALTER DATABASE "{db.conn.info.dbname}" SET idle_session_timeout = 1000')
    with pglockkit.run_once(db.dsn, "nightly-aggregation", "2026-11-30") as run:
        assert run is not None
        time.sleep(2.0)  # the aggregation, longer than the idle timeout
        with pglockkit.run_once(db.dsn, "nightly-aggregation", "2026-11-30") as second:
            assert second is None, "a second pod started the slot while the first was running it"

    async def async_pods() -> None:
        async with aio.run_once(db.dsn, "nightly-aggregation", "2026-12-01") as run:
            assert run is not None
            await asyncio.sleep(2.0)
            async with aio.run_once(db.dsn, "nightly-aggregation", "2026-12-01") as second:
                assert second is None, "a second pod started the slot while the first was running it"

    asyncio.run(async_pods())
    history = "SELECT slot, status, attempt FROM pglockkit.run_history ORDER BY slot"
    done = [("2026-11-30", "succeeded", 1), ("2026-12-01", "succeeded", 1)]
    assert db.conn.execute(history).fetchall() == done
