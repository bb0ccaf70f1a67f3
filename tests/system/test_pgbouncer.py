"""pglockkit through a real PgBouncer (Debian's 1.18), in transaction and session pooling.

What works through transaction pooling: transaction locks, the queue (exactly once under SIGKILL),
leases. What is refused: ``sole_writer`` and a session-bound ``Lease`` (any pool mode). What cannot
be refused and leaks: plain SQL session locks (``try_lock``), shown here as the hazard
docs/pgbouncer.md warns about. Through session pooling session locks work per client connection;
on disconnect, the default ``server_reset_query`` (``DISCARD ALL``) releases them, and an empty
one leaks them to the next client.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import psycopg
import pytest
from pgbouncer import PgBouncer
from scenarios import exactly_once_under_sigkill, lease_contenders

import pglockkit
import pglockkit.aio as aio
from pglockkit import monitor

NS = "bouncer"


@pytest.fixture
def bouncer(db) -> Iterator[Callable[..., PgBouncer]]:
    """Start PgBouncers in front of ``db``; stopped at teardown, their logs printed (shown on failure)."""
    db.conn.execute("SELECT pglockkit.register_namespace(%s)", (NS,))
    started: list[PgBouncer] = []

    def start(pool_mode: str = "transaction", **settings: str | int) -> PgBouncer:
        started.append(PgBouncer(db.dsn, pool_mode=pool_mode, **settings))
        return started[-1]

    yield start
    for b in started:
        b.stop()
        print(f"--- pgbouncer {b.pool_mode} log ---\n{b.log()}")
        b.cleanup()


def _server_pid(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT pg_backend_pid()").fetchone()[0]


def _held(db) -> list[tuple]:
    """Advisory locks granted now, seen on a direct connection: (namespace, pid, state)."""
    return db.conn.execute(
        "SELECT namespace, pid, state FROM pglockkit.advisory_locks WHERE granted ORDER BY pid"
    ).fetchall()


def _idle_holders(db) -> list[tuple]:
    return db.conn.execute("SELECT namespace, pid FROM pglockkit.idle_lock_holders ORDER BY pid").fetchall()


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --- the signal: PgBouncer answers the startup with a BackendKeyData of its own -------------------


@pytest.mark.parametrize("pool_mode", ["transaction", "session"])
def test_startup_pid_differs_from_the_server_pid_through_pgbouncer(db, bouncer, pool_mode):
    b = bouncer(pool_mode)
    with db.connect() as direct:
        assert direct.info.backend_pid == _server_pid(direct)
    with b.connect() as pooled:
        server_pid = _server_pid(pooled)
        assert pooled.info.backend_pid != server_pid
        # The server pid is a real backend of this database; the client-side one is PgBouncer's.
        activity = db.conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        pids = {r[0] for r in activity}
        assert server_pid in pids and pooled.info.backend_pid not in pids


# --- transaction pooling: what works ---------------------------------------------------------------


def test_xact_locks_through_transaction_pooling(db, bouncer):
    b = bouncer("transaction", pool_size=4)
    with b.connect() as a, b.connect() as other:
        with a.transaction():
            key = pglockkit.xact_lock(a, NS, "invoice:7", timeout=1)
            holder = _server_pid(a)
            assert _held(db) == [(NS, holder, "idle in transaction")]
            with other.transaction():
                assert not pglockkit.try_xact_lock(other, NS, "invoice:7")
            started = time.monotonic()
            with pytest.raises(pglockkit.LockTimeout) as err, other.transaction():
                pglockkit.xact_lock(other, NS, "invoice:7", timeout=0.3)
            waited = time.monotonic() - started
            assert err.value.sqlstate == "55P03" and 0.25 <= waited < 3
            assert other.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # rolled back
        assert _held(db) == []  # released at commit
        with other.transaction():
            assert pglockkit.xact_lock(other, NS, "invoice:7", timeout=1) == key
            assert pglockkit.try_xact_lock(other, NS, "other")


def test_one_of_three_pooled_clients_wins_a_try_xact_lock(db, bouncer):
    b = bouncer("transaction", pool_size=4)
    barrier = threading.Barrier(3)
    results: list[bool] = []

    def client() -> None:
        with b.connect() as conn, conn.transaction():
            barrier.wait(5)
            results.append(pglockkit.try_xact_lock(conn, NS, "nightly"))
            barrier.wait(5)  # everyone has tried while the winner still holds it

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(results) == [False, False, True]
    assert _held(db) == []


def test_queue_exactly_once_through_transaction_pooling(db, bouncer):
    """4 ``pglockkit work`` processes on the pooler's DSN drain 1,000 jobs while a random one is
    SIGKILLed every few hundred ms: every job done, recorded once, with its final claim's token."""
    b = bouncer("transaction", pool_size=6)
    db.conn.execute("CREATE TABLE done_log (job_id bigint, token bigint, pid int)")
    stats = exactly_once_under_sigkill(db.conn, b.dsn(), total=1000, workers=4, timeout=120, job_s=0.01)
    assert stats["kills"] >= 3
    assert stats["crashes"] == []
    assert stats["recorded"] == stats["distinct"] == 1000
    assert stats["mismatched"] == 0
    assert stats["reclaimed"] > 0
    # The workers' connections really went through the pooler: more client connections than
    # server sessions, and more server sessions than one.
    servers = db.conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchone()[0]
    assert 1 < servers <= 6


def test_lease_contenders_never_overlap_through_transaction_pooling(db, bouncer):
    b = bouncer("transaction", pool_size=4)
    stats = lease_contenders(b.connect, db.conn, contenders=8, seconds=2)
    assert stats["errors"] == []
    assert stats["intervals"] >= 30 and stats["open"] == 0 and stats["holders"] >= 4
    assert stats["overlaps"] == 0
    assert stats["tokens_in_order"]


# --- refused: sole_writer needs a direct connection ------------------------------------------------


@pytest.mark.parametrize("pool_mode", ["transaction", "session"])
def test_sole_writer_refuses_a_pooler(db, bouncer, pool_mode):
    b = bouncer(pool_mode)
    with pytest.raises(pglockkit.PoolerDetected) as err:
        with pglockkit.sole_writer(b.dsn(), NS, "restock_plan"):
            pytest.fail("sole_writer ran its body through a pooler")
    exc = err.value
    assert isinstance(exc, pglockkit.PglockkitError) and exc.sqlstate is None
    assert exc.client_pid != exc.server_pid
    message = str(exc)
    assert "sole_writer needs a direct connection" in message and "pooler" in message
    assert f"client-side pid {exc.client_pid}, server pid {exc.server_pid}" in message
    assert "reaches PostgreSQL directly" in message
    assert _held(db) == []  # refused before any lock was taken
    _wait_for(lambda: b.clients() == 0, "the refused connection to be closed")
    # The same call on a direct DSN works.
    with pglockkit.sole_writer(db.dsn, NS, "restock_plan") as mine:
        assert mine


# The same refusal from the async sole_writer (pglockkit.aio).
def test_sole_writer_refuses_pgbouncer_before_taking_a_lock(db, ns, advisory_locks):
    bouncer = PgBouncer(db.dsn, pool_mode="session")
    try:

        async def main():
            with pytest.raises(pglockkit.PoolerDetected) as err:
                async with aio.sole_writer(bouncer.dsn(), ns, "restock_plan"):
                    pytest.fail("sole_writer ran its body through a pooler")
            assert err.value.client_pid != err.value.server_pid
            assert advisory_locks(db.conn) == 0
            async with aio.sole_writer(db.dsn, ns, "restock_plan") as mine:  # direct: fine
                assert mine

        asyncio.run(main())
    finally:
        bouncer.stop()


# A bound lease is freed when its holder's backend ends: through a pooler that backend is a pooled
# server session that outlives the client, so Lease(bind_session=True) is refused like sole_writer.
@pytest.mark.parametrize("pool_mode", ["transaction", "session"])
def test_a_session_bound_lease_refuses_a_pooler(db, bouncer, pool_mode):
    b = bouncer(pool_mode)
    with pytest.raises(pglockkit.PoolerDetected) as err:
        with pglockkit.Lease(b.dsn(), "restock", ttl=30, bind_session=True):
            pytest.fail("a bound lease was taken through a pooler")
    message = str(err.value)
    assert "Lease(bind_session=True) needs a direct connection" in message
    assert "leave bind_session off" in message and err.value.client_pid != err.value.server_pid
    assert db.conn.execute("SELECT count(*) FROM pglockkit.leases").fetchone()[0] == 0  # nothing taken
    assert _held(db) == []
    _wait_for(lambda: b.clients() == 0, "the refused connection to be closed")

    async def refused_async() -> None:
        with pytest.raises(pglockkit.PoolerDetected, match=r"Lease\(bind_session=True\)"):
            async with aio.Lease(b.dsn(), "restock", ttl=30, bind_session=True):
                pytest.fail("a bound lease was taken through a pooler")

    asyncio.run(refused_async())
    # Unbound through the pooler, and bound on a direct DSN: both work.
    with pglockkit.Lease(b.dsn(), "restock", ttl=30) as lease:
        assert lease.acquired
    with pglockkit.Lease(db.dsn, "restock", ttl=30, bind_session=True) as lease:
        assert lease.acquired
    _wait_for(lambda: b.clients() == 0, "the async refused connection to be closed")


# --- doctor's pooler check -------------------------------------------------------------------------


def _pooler_findings(conn: psycopg.Connection) -> dict[str, str]:
    return {f.check: f.severity for f in monitor.doctor(conn) if "pooler" in f.check}


def test_doctor_finds_transaction_pooling_and_not_session_pooling_or_a_direct_connection(db, bouncer):
    transaction = bouncer("transaction", pool_size=4, server_round_robin=0)
    session = bouncer("session", pool_size=4)
    with transaction.connect() as conn:
        [finding] = monitor._pooler_check(conn)
        assert (finding.severity, finding.check) == ("error", "transaction-mode pooler")
        assert f"client-side pid {conn.info.backend_pid}" in finding.message
        assert _pooler_findings(conn) == {"transaction-mode pooler": "error"}
    with session.connect() as conn:
        [finding] = monitor._pooler_check(conn)
        assert (finding.severity, finding.check) == ("info", "connection pooler")
        assert f"server pid {_server_pid(conn)}" in finding.message
    with db.connect() as conn:
        assert _pooler_findings(conn) == {}
    # Repeatable, not a lucky interleaving: ten more runs, each with a fresh client connection.
    for _ in range(10):
        with transaction.connect() as t_conn, session.connect() as s_conn:
            assert [f.check for f in monitor._pooler_check(t_conn)] == ["transaction-mode pooler"]
            assert [f.check for f in monitor._pooler_check(s_conn)] == ["connection pooler"]


def test_doctor_probe_gives_up_on_a_full_session_pool(db, bouncer):
    session = bouncer("session", pool_size=1)
    with session.connect() as conn:
        started = time.monotonic()
        [finding] = monitor._pooler_check(conn)  # the probe waits 2 s for a server, then gives up
        assert finding.check == "connection pooler" and time.monotonic() - started < 6


# --- the hazard that cannot be refused: plain SQL session locks through transaction pooling ---------


def test_session_lock_through_transaction_pooling_stays_behind_and_changes_hands(db, bouncer):
    """``try_lock`` through transaction pooling: the lock stays on the server session, which
    PgBouncer then hands to another client; the taker's own unlock lands elsewhere (55000), and the
    other client, who never asked for it, holds it and can release it."""
    b = bouncer("transaction", pool_size=4, server_round_robin=0)
    with b.connect() as taker, b.connect() as bystander:
        assert taker.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]
        s1 = _server_pid(taker)
        # The lock outlives the statement's transaction: it sits on a server session that is idle
        # in the pool, where monitoring sees it.
        assert _held(db) == [(NS, s1, "idle")]
        assert _idle_holders(db) == [(NS, s1)]
        with bystander.transaction():
            # PgBouncer reuses the most recently released server session: the bystander's.
            assert _server_pid(bystander) == s1
            with pytest.raises(pglockkit.LockNotHeld) as err:
                with pglockkit.errors.translated():
                    taker.execute("SELECT pglockkit.unlock(%s, 'tick')", (NS,))
            assert err.value.sqlstate == "55000"
            assert _held(db) == [(NS, s1, "idle in transaction")]  # still held, by the bystander's session
            bystander.execute("SELECT pglockkit.unlock(%s, 'tick')", (NS,))  # "releases" a lock it never took
        assert _held(db) == []


def test_session_lock_through_transaction_pooling_outlives_the_client(db, bouncer):
    b = bouncer("transaction", pool_size=4)
    with b.connect() as taker:
        assert taker.execute("SELECT pglockkit.try_lock(%s, 'leak')", (NS,)).fetchone()[0]
        s1 = _server_pid(taker)
    time.sleep(0.2)
    assert _idle_holders(db) == [(NS, s1)]  # no reset query runs in transaction mode by default
    with db.connect() as rival:
        assert not rival.execute("SELECT pglockkit.try_lock(%s, 'leak')", (NS,)).fetchone()[0]


def test_reset_query_always_in_transaction_mode_drops_the_lock_at_once(db, bouncer):
    b = bouncer("transaction", pool_size=4, server_reset_query_always=1)
    with b.connect() as taker:
        assert taker.execute("SELECT pglockkit.try_lock(%s, 'gone')", (NS,)).fetchone()[0]
        _wait_for(lambda: _held(db) == [], "DISCARD ALL after the transaction")
        with pytest.raises(psycopg.Error) as err:
            taker.execute("SELECT pglockkit.unlock(%s, 'gone')", (NS,))
        assert err.value.sqlstate == "55000"


# --- session pooling -------------------------------------------------------------------------------


def test_session_locks_work_per_client_connection_through_session_pooling(db, bouncer):
    b = bouncer("session", pool_size=4)
    with b.connect() as a, b.connect() as other:
        assert a.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]
        s1 = _server_pid(a)
        for _ in range(5):
            with a.transaction():
                assert _server_pid(a) == s1  # pinned to one server session
        assert not other.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]
        with pytest.raises(psycopg.Error) as err:
            other.execute("SELECT pglockkit.unlock(%s, 'tick')", (NS,))
        assert err.value.sqlstate == "55000"
        a.execute("SELECT pglockkit.unlock(%s, 'tick')", (NS,))
        assert other.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]
        other.execute("SELECT pglockkit.unlock(%s, 'tick')", (NS,))


def _server_alive(db, pid: int) -> bool:
    return bool(db.conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0])


def test_session_pooling_default_reset_query_releases_the_lock_on_disconnect(db, bouncer):
    b = bouncer("session", pool_size=4)
    assert dict((r[0], r[1]) for r in b.admin("SHOW CONFIG"))["server_reset_query"] == "DISCARD ALL"
    with b.connect() as a:
        assert a.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]
        s1 = _server_pid(a)
        assert _held(db) == [(NS, s1, "idle")]
    _wait_for(lambda: _held(db) == [], "DISCARD ALL to release the lock")
    assert _server_alive(db, s1)  # released by the reset query, not by closing the server session
    last_query = db.conn.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (s1,)).fetchone()[0]
    assert last_query == "DISCARD ALL"


def test_session_pooling_without_reset_query_leaks_the_lock_to_the_next_client(db, bouncer):
    b = bouncer("session", pool_size=4, server_reset_query="''")
    with b.connect() as a:
        assert a.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]
        s1 = _server_pid(a)
    time.sleep(0.2)
    assert _server_alive(db, s1)
    idle = db.conn.execute("SELECT namespace, pid, state FROM pglockkit.idle_lock_holders").fetchall()
    assert idle == [(NS, s1, "idle")]
    with db.connect() as rival:
        assert not rival.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]
    with b.connect() as heir:
        assert _server_pid(heir) == s1  # the next client gets that server session, lock included
        assert heir.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]  # re-entrant
        heir.execute("SELECT pglockkit.unlock(%s, 'tick'), pglockkit.unlock(%s, 'tick')", (NS, NS))
    assert _held(db) == []


@pytest.mark.parametrize("pool_mode", ["transaction", "session"])
def test_once_refuses_a_pooler_before_it_runs_the_command(db, bouncer, tmp_path, pool_mode):
    """`pglockkit once` holds the slot with a session lock. Through transaction pooling that lock
    stayed on a server session that went back to the pool while the command ran; the finish landed
    on another session, was refused (false), and once exited 0 with the run left 'running', so the
    slot ran again once that server session closed. Now it refuses a pooler, as sole_writer does."""
    b = bouncer(pool_mode)
    marker = tmp_path / "ran"
    out = subprocess.run(
        [sys.executable, "-m", "pglockkit.cli", "once", "nightly", "--slot", "s1", "--dsn", b.dsn(), "--",
         sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x')"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1 and not marker.exists(), out.stderr
    assert "pglockkit once needs a direct connection" in out.stderr and "[None]" not in out.stderr
    assert db.conn.execute("SELECT count(*) FROM pglockkit.runs").fetchone()[0] == 0
    assert _held(db) == []


# run_once (and singleton, aio.run_once) hold the slot with a session lock, as `pglockkit once` does.
def test_run_once_through_transaction_pooling_records_the_run_or_refuses(db, bouncer):
    """Through transaction pooling, run_once's start_run takes the slot's session lock on one server
    session; while the body runs that session goes back to the pool, finish_run lands on another,
    is refused (false), and run_once logs "succeeded" and returns normally. The run stays
    'running' with its lock on a server session other clients use (the same defect `pglockkit
    once` had). run_once must refuse the pooler (PoolerDetected before the body), or record."""
    b = bouncer("transaction")
    ran = []
    other = psycopg.connect(b.dsn(), autocommit=True, prepare_threshold=None)
    try:
        try:
            with pglockkit.run_once(b.dsn(), "nightly", "s1") as run:
                ran.append(run)
                # Another client of the pool is in a transaction meanwhile: it has the server
                # session that served start_run (the only idle one), so finish_run gets another.
                other.execute("BEGIN")
                other.execute("SELECT 1")
        except pglockkit.PoolerDetected:
            assert ran == [], "run_once ran its body before refusing the pooler"
            return
        other.rollback()
        status = db.conn.execute(
            "SELECT status FROM pglockkit.runs WHERE job = 'nightly' AND slot = 's1'"
        ).fetchone()[0]
        assert status == "succeeded", f"run_once returned normally but the run is {status!r}"
    finally:
        other.close()


def test_once_refusing_a_pooler_leaves_no_session_setting_on_the_pooled_server_session(db, bouncer, tmp_path):
    """sole_writer and Lease(bind_session=True) refuse the pooler before they set the server
    keepalives; `pglockkit once` sets them first (set_config(..., false): session-level), then
    refuses. Through transaction pooling the settings stay on the server session PgBouncer hands
    to the next client, which never asked for them."""
    b = bouncer("transaction", pool_size=1)
    with psycopg.connect(b.dsn(), autocommit=True, prepare_threshold=None) as before:
        default = before.execute("SHOW tcp_user_timeout").fetchone()[0]
    out = subprocess.run(
        [sys.executable, "-m", "pglockkit.cli", "once", "nightly", "--slot", "s1", "--dsn", b.dsn(), "--",
         sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1 and "pglockkit once needs a direct connection" in out.stderr, out.stderr
    with psycopg.connect(b.dsn(), autocommit=True, prepare_threshold=None) as other:
        assert other.execute("SHOW tcp_user_timeout").fetchone()[0] == default


def test_a_session_lock_leaked_on_a_busy_transaction_pool_is_reported_by_its_hold_time(db, bouncer):
    """The leak of the brief (seeds 001, 003, 004) as production meets it: a try_lock through
    transaction pooling stays on a server session that the pool keeps busy with other clients'
    transactions. Every later tick skips, yet that session never idles for long, so the idle
    check (idle_lock_holders, and the alert on it) never sees it. sample(), run every few
    seconds, keeps how long the lock has been held: lock_holds shows it, and doctor reports it
    as a long-held lock."""
    b = bouncer("transaction", pool_size=1)
    with b.connect() as taker:
        assert taker.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]
    stop = threading.Event()

    def busy_client():  # the rest of the application, through the same pool
        with b.connect() as other:
            while not stop.is_set():
                other.execute("SELECT 1")
                time.sleep(0.05)

    traffic = threading.Thread(target=busy_client)
    traffic.start()
    try:
        for _ in range(7):  # `pglockkit sample --every 0.5s`, for 3 s
            db.conn.execute("SELECT pglockkit.sample()")
            time.sleep(0.5)
        with db.connect() as rival:  # every later tick skips: the leak is real
            assert not rival.execute("SELECT pglockkit.try_lock(%s, 'tick')", (NS,)).fetchone()[0]
        findings = monitor.doctor(db.conn, idle_after=timedelta(seconds=1), held_after=timedelta(seconds=2))
        held = db.conn.execute("SELECT namespace, held_for FROM pglockkit.lock_holds").fetchall()
    finally:
        stop.set()
        traffic.join()
    assert [ns for ns, _ in held] == [NS] and held[0][1] >= timedelta(seconds=2.5), held
    assert not [f for f in findings if f.check == "idle lock holder"]  # what the idle check misses
    long_held = [f.message for f in findings if f.check == "long-held lock"]
    assert len(long_held) == 1 and f"has held advisory lock {NS}/" in long_held[0], findings
