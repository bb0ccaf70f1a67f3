"""Failover to a real streaming standby (``pg_basebackup -R``), started by the test, on PostgreSQL 15
and 18: what the kit's fencing tokens promise when the standby is promoted.

A promotion carries the sequences on from the last value that was WAL-logged (about 32 ahead of the
last one handed out) and reached the standby. With asynchronous replication, whatever the old
primary handed out past that, and never replicated, is handed out again. Tokens carry the
server's timeline, which grows at every promotion, so they cannot repeat."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from replication import Node
from scenarios import PROMOTED_EPOCH, assert_done_once, cli, stop_workers, track, worker_proc

import pglockkit
from pglockkit import monitor
from pglockkit import queue as q

HANDED_OUT = 120  # well past a sequence's logged block (32 values), as in the report (222)


def _acquired(conn: psycopg.Connection, name: str, holder: str, ttl: str = "1 hour") -> int:
    token = conn.execute(
        "SELECT pglockkit.acquire_lease(%s, %s, %s::interval)", (name, holder, ttl)
    ).fetchone()[0]
    assert token is not None
    return token


def _replication(conn: psycopg.Connection) -> list[tuple[str, str]]:
    """``doctor``'s findings about replication: (severity, check)."""
    checks = ("standby", "replication", "asynchronous replication", "synchronous replication")
    return [(f.severity, f.check) for f in monitor.doctor(conn) if f.check in checks]


def _schedule(conn: psycopg.Connection) -> None:
    """A yearly schedule whose slot of this year is due (and the next one a year away)."""
    conn.execute("SELECT pglockkit.schedule('report', '0 0 1 1 *', 'reports')")
    conn.execute("UPDATE pglockkit.job_schedules SET next_run = '2026-01-01 00:00+00' WHERE name = 'report'")


def _tick(conn: psycopg.Connection) -> int:
    """Jobs enqueued by a tick of the schedules."""
    return conn.execute("SELECT pglockkit.tick_schedules()").fetchone()[0]


def _start_run(conn: psycopg.Connection, job: str, slot: str) -> int | None:
    return conn.execute("SELECT pglockkit.start_run(%s, %s, 'pod-a')", (job, slot)).fetchone()[0]


def _ran(conn: psycopg.Connection, job: str, slot: str) -> None:
    """Run ``job``'s ``slot`` to success (it must be free)."""
    run_id = _start_run(conn, job, slot)
    assert run_id is not None, f"{job}/{slot} already ran"
    assert conn.execute("SELECT pglockkit.finish_run(%s, true)", (run_id,)).fetchone()[0]


def _churn(conn: psycopg.Connection, name: str, times: int) -> list[int]:
    """``times`` acquisitions of lease ``name``, each released but the last; their tokens."""
    tokens = []
    for i in range(times):
        tokens.append(_acquired(conn, name, f"holder-{i}"))
        if i < times - 1:
            assert conn.execute(
                "SELECT pglockkit.release_lease(%s, %s, %s)", (name, f"holder-{i}", tokens[-1])
            ).fetchone()[0]
    return tokens


def _claims(conn: psycopg.Connection, queue: str, n: int) -> list[tuple[int, int]]:
    """``n`` claims of one job each; (id, token) of each."""
    return [
        conn.execute(
            "SELECT id, token FROM pglockkit.claim_job(%s, 'w', interval '1 hour', 1)", (queue,)
        ).fetchone()
        for _ in range(n)
    ]


def test_tokens_handed_out_before_an_async_failover_are_never_handed_out_again(server, tmp_path):
    """The report's run, on a real standby: the standby stops; the primary hands out lease and
    claim tokens past a sequence's logged block; the primary is SIGKILLed and the standby
    promoted. Before the fix the promoted server handed the same tokens out again: an old holder
    passed ``check_fence`` with the new holder's token, and a stale ``complete_job`` completed a
    job that a new worker had reclaimed with the same token. Now every token after the promotion
    is above every token before it; the old holders' fence, renewal and completion are refused;
    the new holders' are accepted."""
    primary = Node.primary(server.bindir, tmp_path)
    standby = None
    try:
        pglockkit.install(primary.dsn())
        with primary.connect() as conn:
            conn.execute(
                "SELECT pglockkit.enqueue_jobs('q', array_fill('{}'::jsonb, ARRAY[%s]))", (2 * HANDED_OUT,)
            )
            conn.execute("CREATE TABLE fenced (token bigint)")
            _schedule(conn)
        standby = primary.standby(tmp_path)
        primary.wait_caught_up(standby)
        with primary.connect() as conn:  # doctor says what is at stake
            assert _replication(conn) == [("warning", "asynchronous replication")]
        with standby.connect() as conn:
            assert _replication(conn) == [("error", "standby")]
        standby.stop()  # asynchronous replication that falls behind: nothing below reaches it

        with primary.connect() as conn:
            before_leases = _churn(conn, "fence", HANDED_OUT)  # the last one stays held: the old holder
            before_claims = _claims(conn, "q", HANDED_OUT)
            # A run and a schedule slot recorded only on the old primary.
            _ran(conn, "nightly", "2026-12-07")
            assert _tick(conn) == 1
        old_holder, old_token = f"holder-{HANDED_OUT - 1}", before_leases[-1]
        old_job, old_claim = before_claims[-1]
        primary.kill()
        standby.start()
        standby.promote()

        with standby.connect() as conn:
            # Enough acquisitions and claims to pass every token the old primary handed out.
            after_leases = _churn(conn, "fence", HANDED_OUT + 40)
            after_claims = _claims(conn, "q", HANDED_OUT + 40)
            new_token = after_leases[-1]
            assert min(after_leases) > max(before_leases), (before_leases[-3:], after_leases[:3])
            # Timeline 1's tokens are the sequence's values; timeline 2's carry epoch 1 above them.
            assert max(before_leases) < PROMOTED_EPOCH <= min(after_leases)
            assert {t >> 47 for _, t in after_claims} == {PROMOTED_EPOCH >> 47}
            assert not set(after_leases) & set(before_leases)
            assert not {t for _, t in after_claims} & {t for _, t in before_claims}
            assert min(t for _, t in after_claims) > max(t for _, t in before_claims)

            # The old holder's fence and renewal: refused. The new holder's: accepted.
            with pytest.raises(psycopg.Error) as stale, conn.transaction():
                conn.execute("SELECT pglockkit.check_fence('fence', %s)", (old_token,))
                conn.execute("INSERT INTO fenced VALUES (%s)", (old_token,))
            assert stale.value.sqlstate == "PK001", stale.value
            renewed = conn.execute(
                "SELECT pglockkit.renew_lease('fence', %s, %s, '1 hour')", (old_holder, old_token)
            ).fetchone()[0]
            assert renewed is False
            with conn.transaction():
                conn.execute("SELECT pglockkit.check_fence('fence', %s)", (new_token,))
                conn.execute("INSERT INTO fenced VALUES (%s)", (new_token,))
            assert conn.execute("SELECT array_agg(token) FROM fenced").fetchone()[0] == [new_token]

            # The stale worker's completion of a job a new worker reclaimed: refused.
            new_claim = dict(after_claims)[old_job]
            assert (
                conn.execute("SELECT pglockkit.complete_job(%s, %s)", (old_job, old_claim)).fetchone()[0]
                is False
            )
            assert (
                conn.execute("SELECT pglockkit.complete_job(%s, %s)", (old_job, new_claim)).fetchone()[0]
                is True
            )

            # What was lost runs again, once: the run's slot, and the schedule's slot.
            _ran(conn, "nightly", "2026-12-07")
            assert _start_run(conn, "nightly", "2026-12-07") is None  # once on the new primary
            assert _tick(conn) == 1 and _tick(conn) == 0
    finally:
        for node in (primary, standby):
            if node is not None:
                node.stop("immediate")


def _follow(*nodes: Node, dbname: str = "postgres") -> str:
    """A multi-host DSN that connects to whichever of ``nodes`` accepts writes: what a client of
    a replicated server is given (``target_session_attrs=read-write``)."""
    return make_conninfo(
        host=",".join("127.0.0.1" for _ in nodes),
        port=",".join(str(n.port) for n in nodes),
        user="postgres",
        dbname=dbname,
        target_session_attrs="read-write",
        connect_timeout="3",
    )


def _sync_pair(server, tmp_path) -> tuple[Node, Node]:
    """A primary and a standby it commits synchronously to (``synchronous_commit = on``), kit
    installed."""
    primary = Node.primary(server.bindir, tmp_path, settings="-c synchronous_commit=on")
    standby = None
    try:
        standby = primary.standby(tmp_path)
        with primary.connect() as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 30
            while not _count(conn, "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"):
                assert time.monotonic() < deadline, "the standby did not become synchronous"
                time.sleep(0.05)
        pglockkit.install(primary.dsn())
    except BaseException:
        for node in (primary, standby):
            if node is not None:
                node.stop("immediate")
        raise
    return primary, standby


def _count(conn: psycopg.Connection, sql: str) -> int:
    return conn.execute(sql).fetchone()[0]


@pytest.mark.slow
def test_a_sync_failover_loses_no_job_and_the_clients_follow_the_new_primary(server, tmp_path, caplog):
    """Synchronous replication: 2 worker processes drain 5,000 jobs through a multi-host DSN while
    the primary is SIGKILLed and the standby promoted. Every job is done, its effect recorded
    exactly once (in the job's transaction), and the workers go on against the new primary by
    themselves. A Lease and a sole_writer block live at the failover are reported lost, and taken
    again on the new primary through the same DSN: the lease with the same token, since the
    synchronous standby had it."""
    total = 5000
    primary, standby = _sync_pair(server, tmp_path)
    follow = _follow(primary, standby)
    workers: list = []
    try:
        with primary.connect() as conn:
            assert _replication(conn) == [("info", "synchronous replication")]
        with primary.connect() as conn:
            conn.execute("CREATE TABLE done_log (job_id bigint, token bigint, pid int)")
            q.enqueue_many(conn, "w", [{}] * total)
            conn.execute("SELECT pglockkit.register_namespace('graphs')")
            _schedule(conn)
            _ran(conn, "nightly", "2026-12-07")
            assert _tick(conn) == 1
        held = pglockkit.Lease(follow, "nightly", holder="pod-a", ttl=6)
        held.__enter__()
        assert held.acquired
        block_may_end, in_block, block_result = threading.Event(), threading.Event(), {}

        def writer() -> None:
            with pglockkit.sole_writer(follow, "graphs", "plan") as mine:
                block_result["mine"] = mine
                in_block.set()
                block_may_end.wait(60)

        writing = threading.Thread(target=writer)
        writing.start()
        assert in_block.wait(10) and block_result["mine"]

        # A `pglockkit once` whose command runs through the failover (until the test creates go_on).
        go_on = tmp_path / "go-on"
        live_once = track(
            subprocess.Popen(
                [sys.executable, "-m", "pglockkit.cli", "once", "backup", "--slot", "s1", "--dsn", follow,
                 "--", "sh", "-c", f"while [ ! -e {go_on} ]; do sleep 0.05; done"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )
        )  # fmt: skip
        with primary.connect() as conn:
            deadline = time.monotonic() + 20
            while not _count(conn, "SELECT count(*) FROM pglockkit.runs WHERE job = 'backup'"):
                assert time.monotonic() < deadline, "pglockkit once did not start its run"
                time.sleep(0.02)
        workers = [worker_proc(follow, "--batch", "5", "--lease", "2s", "--poll", "0.2") for _ in range(2)]
        with primary.connect() as conn:
            deadline = time.monotonic() + 60
            while _count(conn, "SELECT count(*) FROM done_log") < total * 3 // 10:
                assert time.monotonic() < deadline, "the workers did not start draining"
                assert all(w.poll() is None for w in workers), "a worker exited before the failover"
                time.sleep(0.02)
        primary.kill()
        standby.promote()
        # The lease's connection went with the old primary: it says so, and is not continued.
        # Taken again within its ttl by its holder, it is a renewal: the synchronous standby had it.
        assert held.lost.wait(10), "the lease was not reported lost"
        held.__exit__(None, None, None)
        with pglockkit.Lease(follow, "nightly", holder="pod-a", ttl=6) as again:
            assert again.acquired and again.token == held.token

        with standby.connect() as conn:
            deadline = time.monotonic() + 90
            while _count(conn, "SELECT count(*) FROM pglockkit.jobs WHERE queue = 'w' AND status <> 'done'"):
                assert time.monotonic() < deadline, "the queue was not drained on the new primary"
                assert all(w.poll() is None for w in workers), "a worker exited instead of following"
                time.sleep(0.1)
            assert_done_once(conn, total)
            # The run and the schedule's slot recorded before the failover are not done again.
            assert _start_run(conn, "nightly", "2026-12-07") is None
            assert _tick(conn) == 0
            # Both workers went on against the new primary.
            deadline = time.monotonic() + 30
            while _count(
                conn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pglockkit worker w'"
            ) < len(workers):
                assert time.monotonic() < deadline, "not every worker reconnected to the new primary"
                time.sleep(0.1)

        # The sole_writer block that was live: its lock is reported lost when it ends.
        with caplog.at_level(logging.WARNING, logger="pglockkit.locks"):
            block_may_end.set()
            writing.join(10)
        lost = [r for r in caplog.records if getattr(r, "pglockkit", {}).get("event") == "lost"]
        assert lost and "graphs" in lost[0].getMessage(), caplog.text
        with pglockkit.sole_writer(follow, "graphs", "plan") as mine:
            assert mine  # taken again, on the new primary
        # The once whose session went with the old primary says its outcome was not recorded; the
        # slot runs again on the new primary.
        go_on.touch()
        assert live_once.wait(30) == 1
        assert "was not recorded" in live_once.stderr.read()
        again = cli("once", "backup", "--slot", "s1", "--dsn", follow, "--", "true")
        assert again.returncode == 0, again.stderr
        with standby.connect() as conn:
            assert (
                conn.execute(
                    "SELECT array_agg(status ORDER BY id) FROM pglockkit.runs WHERE job = 'backup'"
                ).fetchone()[0][-1]
                == "succeeded"
            )
    finally:
        block_may_end.set()
        outputs = stop_workers(workers)
        for node in (primary, standby):
            node.stop("immediate")
    for code, err in outputs:
        assert code == 0, err[-3000:]  # a graceful stop after SIGTERM, on the new primary
        assert "connection lost" in err and "reconnecting in" in err, err[-3000:]
