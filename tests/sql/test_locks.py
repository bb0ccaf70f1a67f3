"""Advisory-lock helpers against real servers: the contract tests of one writer per
LangGraph graph, timeouts, deadlock freedom by ordering, row locks, and bad input."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time

import psycopg
import pytest

import pglockkit
import pglockkit.aio as aio
from pglockkit import lock_key, namespace_id

# --- one writer per graph ----------------------------------------------------------------------


def _race(db, ns, tick):
    """Two replicas released by a barrier each run ``tick``; returns the log."""
    barrier = threading.Barrier(2)
    log: list[str] = []

    def replica(name):
        barrier.wait()
        tick(name, log)

    threads = [threading.Thread(target=replica, args=(n,)) for n in ("replica-a", "replica-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return log


def test_barrier_one_runs_one_skips_with_sole_writer(db, ns):
    def tick(name, log):
        with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine:
            if not mine:
                log.append(f"{name}: skipped")
                return
            time.sleep(0.5)  # the graph run: widens the race window
            log.append(f"{name}: ran")

    log = _race(db, ns, tick)
    assert sorted(entry.split(": ")[1] for entry in log) == ["ran", "skipped"]


def test_barrier_blocking_lock_runs_twice(db, ns):
    """The same race with a blocking session lock: the duplicate is serialised, not prevented."""

    def tick(name, log):
        with db.connect() as conn:
            conn.execute("SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'restock_plan'))", (ns,))
            time.sleep(0.5)
            log.append(f"{name}: ran")
            conn.execute("SELECT pglockkit.unlock(%s, 'restock_plan')", (ns,))

    log = _race(db, ns, tick)
    assert sorted(entry.split(": ")[1] for entry in log) == ["ran", "ran"]


def test_failure_inside_sole_writer_still_releases(db, ns):
    with pytest.raises(RuntimeError, match="supplier feed down"):
        with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine:
            assert mine
            raise RuntimeError("supplier feed down")
    with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine:
        assert mine


def test_two_resources_never_block_each_other(db, ns):
    with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as a:
        started = time.monotonic()
        with pglockkit.sole_writer(db.dsn, ns, "pack_audit") as b:
            assert a and b
            assert time.monotonic() - started < 1
        with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as again:
            assert not again


def test_killed_holder_frees_the_lock_at_once(db, ns):
    holder = db.connect()
    assert holder.execute("SELECT pglockkit.try_lock(%s, 'restock_plan')", (ns,)).fetchone()[0]
    pid = holder.info.backend_pid
    with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine:
        assert not mine
    assert db.conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
    killed = time.monotonic()
    while True:  # termination is asynchronous; the lock goes with the backend's exit
        with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine:
            if mine:
                break
        assert time.monotonic() - killed < 2, "lock still held 2 s after its backend was terminated"
        time.sleep(0.01)
    holder.close()


def test_sole_writer_survives_its_own_backend_being_killed(db, ns, caplog):
    """If the server kills the holder mid-run, leaving the block does not raise, and the lock is free.
    The lock went before the block ended, and another process may have taken it: a warning says so,
    not a quiet "released"."""
    caplog.set_level(logging.INFO, logger="pglockkit.locks")
    with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine:
        assert mine
        pid = db.conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = %s",
            (lock_key(namespace_id(ns), "restock_plan") & 0xFFFFFFFF,),
        ).fetchone()[0]
        db.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        time.sleep(0.2)
    events = [r for r in caplog.records if hasattr(r, "pglockkit")]
    assert [e.pglockkit["event"] for e in events] == ["acquired", "lost"]
    assert events[1].levelno == logging.WARNING
    assert "sole_writer lost its lock graphs/restock_plan: the connection was lost" in events[1].getMessage()
    with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine:
        assert mine


def test_sole_writer_logs_acquire_skip_release_with_key(db, ns, caplog):
    caplog.set_level(logging.INFO, logger="pglockkit.locks")
    key = lock_key(namespace_id(ns), "restock_plan")
    with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine:
        assert mine
        with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as other:
            assert not other
    events = [r.pglockkit for r in caplog.records if hasattr(r, "pglockkit")]
    assert [e["event"] for e in events] == ["acquired", "skipped", "released"]
    assert all(e["key"] == key and e["namespace"] == ns for e in events)
    assert events[1]["held_by_pid"].isdigit()
    assert events[2]["hold_ms"] >= 0


def test_an_xact_lock_all_timeout_is_logged_like_an_xact_lock_timeout(db, ns, caplog):
    # docs/python.md: "Every acquisition, skip, timeout and release is logged on logger
    # pglockkit.locks". xact_lock's timeout is logged (event "timeout", with wait_ms);
    # xact_lock_all's raised LockTimeout and logged nothing.
    caplog.set_level(logging.INFO, logger="pglockkit.locks")
    with db.connect() as holder, db.connect() as waiter:
        with holder.transaction():
            pglockkit.xact_lock(holder, ns, "b")
            with waiter.transaction(), pytest.raises(pglockkit.LockTimeout):
                pglockkit.xact_lock(waiter, ns, "b", timeout=0.1)
            with waiter.transaction(), pytest.raises(pglockkit.LockTimeout):
                pglockkit.xact_lock_all(waiter, ns, ["a", "b"], timeout=0.1)
    timeouts = [r.pglockkit for r in caplog.records if getattr(r, "pglockkit", {}).get("event") == "timeout"]
    assert len(timeouts) == 2, timeouts
    assert all(e["namespace"] == ns and e["wait_ms"] >= 0 for e in timeouts)
    assert timeouts[1]["resource"] == "2 resources"


def test_unlock_of_a_lock_not_held_is_an_error(db, ns):
    with pytest.raises(
        psycopg.errors.ObjectNotInPrerequisiteState, match="is not held by this session"
    ) as err:
        db.conn.execute("SELECT pglockkit.unlock(%s, 'never-taken')", (ns,))
    assert "pooler" in err.value.diag.message_hint
    # A lock held by another session cannot be released from here either.
    with db.connect() as other:
        assert other.execute("SELECT pglockkit.try_lock(%s, 7)", (ns,)).fetchone()[0]
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            db.conn.execute("SELECT pglockkit.unlock(%s, 7)", (ns,))
        assert not db.conn.execute("SELECT pglockkit.try_lock(%s, 7)", (ns,)).fetchone()[0]


def test_session_locks_are_reentrant_and_need_one_unlock_each(db, ns):
    for _ in range(2):
        assert db.conn.execute("SELECT pglockkit.try_lock(%s, 'r')", (ns,)).fetchone()[0]
    db.conn.execute("SELECT pglockkit.unlock(%s, 'r')", (ns,))
    with db.connect() as other:
        assert not other.execute("SELECT pglockkit.try_lock(%s, 'r')", (ns,)).fetchone()[0]
        db.conn.execute("SELECT pglockkit.unlock(%s, 'r')", (ns,))
        assert other.execute("SELECT pglockkit.try_lock(%s, 'r')", (ns,)).fetchone()[0]


# --- transaction locks and timeouts -------------------------------------------------------------


def test_try_xact_lock_is_released_at_commit(db, ns):
    with db.connect() as a, db.connect() as b:
        with a.transaction():
            assert pglockkit.try_xact_lock(a, ns, "nightly")
            with b.transaction():
                assert not pglockkit.try_xact_lock(b, ns, "nightly")
        with b.transaction():
            assert pglockkit.try_xact_lock(b, ns, "nightly")


def test_xact_lock_times_out_in_about_the_timeout(db, ns):
    with db.connect() as holder, db.connect() as waiter:
        with holder.transaction():
            pglockkit.xact_lock(holder, ns, "invoice:42")
            started = time.monotonic()
            with pytest.raises(pglockkit.LockTimeout) as err, waiter.transaction():
                pglockkit.xact_lock(waiter, ns, "invoice:42", timeout=0.2)
            elapsed = time.monotonic() - started
        assert 0.18 <= elapsed < 1.0, elapsed
        assert err.value.sqlstate == "55P03"
        assert err.value.retry_after == pytest.approx(0.2)
        cause = err.value.__cause__
        assert f"Held by pid {holder.info.backend_pid}" in cause.diag.message_detail
        assert "graphs/invoice:42" in cause.diag.message_primary
        assert "try_xact_lock" in cause.diag.message_hint


@pytest.mark.parametrize("resource", [7, "invoice:7"])
@pytest.mark.parametrize("call", ["xact_lock", "xact_lock_with_timeout", "try_xact_lock"])
def test_a_free_transaction_lock_takes_exactly_its_key(db, ns, call, resource):
    """The uncontended path (one function call since 0016 and 0017) takes the documented key."""
    sql = {
        "xact_lock": "SELECT pglockkit.xact_lock(%s, %s)",
        "xact_lock_with_timeout": "SELECT pglockkit.xact_lock(%s, %s, interval '1 s')",
        "try_xact_lock": "SELECT pglockkit.try_xact_lock(%s, %s)",
    }[call]
    key = lock_key(namespace_id(ns), resource)
    with db.connect() as conn, conn.transaction():
        got = conn.execute(sql, (ns, resource)).fetchone()[0]
        assert got == (True if call == "try_xact_lock" else key)
        held = conn.execute(
            """SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks
                WHERE locktype = 'advisory' AND objsubid = 1 AND pid = pg_backend_pid()"""
        ).fetchall()
        assert held == [(key,)]


def test_xact_lock_waits_and_gets_the_lock_when_released(db, ns):
    with db.connect() as holder, db.connect() as waiter:
        holder.execute("BEGIN")
        holder.execute("SELECT pglockkit.xact_lock(%s, 1)", (ns,))
        threading.Timer(0.3, holder.execute, args=("COMMIT",)).start()
        started = time.monotonic()
        with waiter.transaction():
            key = pglockkit.xact_lock(waiter, ns, 1, timeout=5)
        assert 0.25 <= time.monotonic() - started < 3
        assert key == lock_key(namespace_id(ns), 1)


def test_timeout_leaves_lock_timeout_setting_as_it_was(db, ns):
    with db.connect() as holder, db.connect(autocommit=False) as conn:
        holder.execute("SELECT pglockkit.try_lock(%s, 'busy')", (ns,))
        conn.execute("SET lock_timeout = '7s'")
        conn.commit()
        conn.execute("SELECT pglockkit.xact_lock(%s, 'free', interval '50 ms')", (ns,))
        assert conn.execute("SHOW lock_timeout").fetchone()[0] == "7s"
        conn.execute("SAVEPOINT s")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            conn.execute("SELECT pglockkit.xact_lock(%s, 'busy', interval '50 ms')", (ns,))
        conn.execute("ROLLBACK TO SAVEPOINT s")
        assert conn.execute("SHOW lock_timeout").fetchone()[0] == "7s"
        # The lock taken before the failed wait is still held by this transaction.
        assert not holder.execute("SELECT pglockkit.try_xact_lock(%s, 'free')", (ns,)).fetchone()[0]
        conn.rollback()


def test_namespace_default_timeout_applies_when_call_passes_none(db):
    db.conn.execute("SELECT pglockkit.register_namespace('quick', lock_timeout => interval '150 ms')")
    with db.connect() as holder, db.connect() as waiter:
        holder.execute("SELECT pglockkit.try_lock('quick', 'x')")
        started = time.monotonic()
        with pytest.raises(pglockkit.LockTimeout), waiter.transaction():
            pglockkit.xact_lock(waiter, "quick", "x")
        assert 0.13 <= time.monotonic() - started < 1.0


def test_server_lock_timeout_applies_without_call_or_namespace_timeout(db, ns):
    with db.connect() as holder, db.connect() as waiter:
        holder.execute("SELECT pglockkit.try_lock(%s, 'x')", (ns,))
        waiter.execute("SET lock_timeout = '120ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable) as err, waiter.transaction():
            waiter.execute("SELECT pglockkit.xact_lock(%s, 'x')", (ns,))
        assert "lock_timeout 120ms" in err.value.diag.message_primary


def test_python_helpers_refuse_autocommit_without_transaction(db, ns):
    with pytest.raises(ValueError, match=r"conn\.transaction"):
        pglockkit.xact_lock(db.conn, ns, "x")
    with pytest.raises(ValueError, match=r"conn\.transaction"):
        pglockkit.try_xact_lock(db.conn, ns, "x")


# --- deadlock freedom ---------------------------------------------------------------------------


def _opposite_orders(db, lock_pair) -> list[str]:
    """Two sessions lock 'a' and 'b' in opposite orders, released together. Returns sqlstates."""
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def session(order):
        with db.connect(autocommit=False) as conn:
            conn.execute("SET deadlock_timeout = '100ms'")
            try:
                lock_pair(conn, order, barrier)
                conn.commit()
                outcomes.append("ok")
            except psycopg.Error as exc:
                outcomes.append(exc.sqlstate)

    threads = [threading.Thread(target=session, args=(o,)) for o in (["a", "b"], ["b", "a"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(outcomes)


def test_unordered_locks_deadlock(db, ns):
    def one_at_a_time(conn, order, barrier):
        conn.execute("SELECT pglockkit.xact_lock(%s, %s)", (ns, order[0]))
        barrier.wait()
        conn.execute("SELECT pglockkit.xact_lock(%s, %s)", (ns, order[1]))

    assert _opposite_orders(db, one_at_a_time) == ["40P01", "ok"]


def test_xact_lock_all_in_opposite_orders_does_not_deadlock(db, ns):
    def all_at_once(conn, order, barrier):
        barrier.wait()
        conn.execute("SELECT pglockkit.xact_lock_all(%s, %s::text[])", (ns, order))
        time.sleep(0.05)

    assert _opposite_orders(db, all_at_once) == ["ok", "ok"]


def test_swarm_with_random_orders_has_no_deadlocks(db, ns):
    """Eight threads, each locking the same five resources in a random order, many times."""
    resources = [f"acct:{i}" for i in range(5)]
    errors: list[str] = []
    done = []

    def worker(seed):
        rng = random.Random(seed)
        with db.connect(autocommit=False) as conn:
            conn.execute("SET deadlock_timeout = '50ms'")
            conn.commit()
            for _ in range(25):
                order = rng.sample(resources, k=len(resources))
                try:
                    keys = conn.execute(
                        "SELECT pglockkit.xact_lock_all(%s, %s::text[], '10s')", (ns, order)
                    ).fetchone()[0]
                    assert keys == sorted(keys)
                    time.sleep(0.001)
                    conn.commit()
                    done.append(1)
                except psycopg.Error as exc:
                    errors.append(exc.sqlstate)
                    conn.rollback()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(done) == 8 * 25


def test_xact_lock_all_waits_at_a_held_key_holding_only_the_keys_below_it(db, ns):
    """The fast path tries the keys in ascending order; at a held key the waiting path takes over.
    While it waits it holds the keys below the held one and none above (what makes opposite
    orders deadlock-free), and after the wait every key once, the result ascending."""
    resources = [f"r{i}" for i in range(8)]
    keys = sorted(lock_key(namespace_id(ns), r) for r in resources)
    busy = next(r for r in resources if lock_key(namespace_id(ns), r) == keys[4])
    held_key = (
        "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks"
        " WHERE locktype = 'advisory' AND pid = %s AND granted"
    )
    result: list = []
    with db.connect() as holder, db.connect() as waiter:
        holder.execute("BEGIN")
        holder.execute("SELECT pglockkit.xact_lock(%s, %s)", (ns, busy))
        waiter.execute("BEGIN")
        thread = threading.Thread(
            target=lambda: result.append(
                waiter.execute(
                    "SELECT pglockkit.xact_lock_all(%s, %s::text[], '10s')", (ns, resources)
                ).fetchone()[0]
            )
        )
        thread.start()
        deadline = time.monotonic() + 5
        while (
            time.monotonic() < deadline
            and len(db.conn.execute(held_key, (waiter.info.backend_pid,)).fetchall()) < 4
        ):
            time.sleep(0.02)
        time.sleep(0.1)
        waiting_holds = sorted(k for (k,) in db.conn.execute(held_key, (waiter.info.backend_pid,)).fetchall())
        assert waiting_holds == keys[:4] and thread.is_alive()
        holder.execute("COMMIT")
        thread.join(5)
        assert result == [keys]
        assert sorted(k for (k,) in db.conn.execute(held_key, (waiter.info.backend_pid,)).fetchall()) == keys
        waiter.execute("COMMIT")


def test_xact_lock_all_timeout_bounds_the_whole_call(db, ns, advisory_locks):
    with db.connect() as holder, db.connect() as waiter:
        holder.execute("SELECT pglockkit.try_lock(%s, 'c')", (ns,))
        started = time.monotonic()
        with pytest.raises(pglockkit.LockTimeout), waiter.transaction():
            pglockkit.xact_lock_all(waiter, ns, ["a", "b", "c", "d"], timeout=0.2)
        assert 0.18 <= time.monotonic() - started < 1.0
        # The failed call took nothing with it: its transaction rolled back.
        assert advisory_locks(db.conn, waiter.info.backend_pid) == 0


def test_xact_lock_all_dedupes_and_handles_integers_and_empty(db, ns, advisory_locks):
    with db.connect() as conn, conn.transaction():
        keys = pglockkit.xact_lock_all(conn, ns, [3, 1, 3, 2])
        assert keys == [lock_key(namespace_id(ns), i) for i in (1, 2, 3)]
        assert pglockkit.xact_lock_all(conn, ns, []) == []
        assert advisory_locks(db.conn, conn.info.backend_pid) == 3


def test_xact_lock_all_takes_up_to_1000_resources(db, ns, advisory_locks):
    with db.connect() as conn, conn.transaction():
        keys = pglockkit.xact_lock_all(conn, ns, [f"r{i}" for i in range(1000)])
        assert len(set(keys)) == 1000 and keys == sorted(keys)
        assert advisory_locks(db.conn, conn.info.backend_pid) == 1000


# --- row locks ----------------------------------------------------------------------------------


@pytest.fixture
def orders(db):
    db.conn.execute('CREATE SCHEMA "Shop Floor"')
    db.conn.execute('CREATE TABLE "Shop Floor"."Orders ""2026""" (id bigint PRIMARY KEY, status text)')
    db.conn.execute(
        'INSERT INTO "Shop Floor"."Orders ""2026""" SELECT g, \'pending\' FROM generate_series(1, 10) g'
    )
    return '"Shop Floor"."Orders ""2026"""'


def test_lock_rows_locks_existing_rows_and_quotes_identifiers(db, orders):
    with db.connect() as conn, db.connect() as other:
        with conn.transaction():
            assert pglockkit.lock_rows(conn, orders, [3, 1, 99, 1]) == 2
            other.execute("SET lock_timeout = '100ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute(f"SELECT 1 FROM {orders} WHERE id = 3 FOR UPDATE")
            assert other.execute(f"SELECT id FROM {orders} WHERE id = 2 FOR UPDATE").fetchall() == [(2,)]


def test_lock_rows_in_opposite_orders_does_not_deadlock(db, orders):
    def lock_pair(conn, order, barrier):
        barrier.wait()
        conn.execute("SELECT pglockkit.lock_rows(%s, %s)", (orders, [int(o == "b") + 1 for o in order]))
        time.sleep(0.05)

    assert _opposite_orders(db, lock_pair) == ["ok", "ok"]


def test_lock_rows_timeout(db, orders):
    with db.connect() as holder, db.connect() as waiter:
        with holder.transaction():
            holder.execute(f"SELECT 1 FROM {orders} WHERE id = 5 FOR UPDATE")
            started = time.monotonic()
            with pytest.raises(pglockkit.LockTimeout, match="could not lock row 5"), waiter.transaction():
                pglockkit.lock_rows(waiter, orders, [1, 5, 9], timeout=0.2)
            assert 0.18 <= time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("call", "sqlstate"),
    [
        ("SELECT pglockkit.lock_rows(NULL, ARRAY[1])", "22004"),
        ("SELECT pglockkit.lock_rows('pglockkit.namespaces', NULL)", "22004"),
        ("SELECT pglockkit.lock_rows('pglockkit.namespaces', ARRAY[1, NULL])", "22004"),
        ("SELECT pglockkit.lock_rows('pglockkit.namespaces', ARRAY[1], interval '-1 s')", "22023"),
        ("SELECT pglockkit.lock_rows('pg_catalog.pg_class', ARRAY[1])", "42703"),
        ("SELECT pglockkit.lock_rows('no_such_table', ARRAY[1])", "42P01"),
    ],
)
def test_lock_rows_bad_input(db, call, sqlstate):
    with pytest.raises(psycopg.Error) as err:
        db.conn.execute(call)
    assert err.value.sqlstate == sqlstate


@pytest.mark.parametrize("id_type", ["uuid", "text", "timestamp with time zone"])
def test_lock_rows_names_an_id_column_that_is_not_a_number(db, id_type):
    db.conn.execute(f"CREATE TABLE keyed (id {id_type} PRIMARY KEY)")
    message = f'column "id" of table public.keyed is {id_type}, not an integer'
    with pytest.raises(psycopg.Error, match=message) as err:
        db.conn.execute("SELECT pglockkit.lock_rows('keyed', ARRAY[1])")
    assert err.value.sqlstate == "42804"
    assert "operator does not exist" in err.value.diag.message_detail
    assert "xact_lock_all" in err.value.diag.message_hint


@pytest.mark.parametrize("id_type", ["smallint", "integer", "numeric", "positive_int"])
def test_lock_rows_takes_any_integer_id_column(db, id_type):
    db.conn.execute("CREATE DOMAIN positive_int AS integer CHECK (VALUE > 0)")
    db.conn.execute(f"CREATE TABLE counted (id {id_type} PRIMARY KEY)")
    db.conn.execute("INSERT INTO counted SELECT g FROM generate_series(1, 3) g")
    with db.connect() as conn, conn.transaction():
        assert conn.execute("SELECT pglockkit.lock_rows('counted', ARRAY[3, 1, 7])").fetchone()[0] == 2


# Each relation lock_rows cannot lock rows of, and each bad id, gets a documented SQLSTATE and a
# message naming the relation and the problem (once: bare 42703, 42809, 0A000 or 22003
# from the server, naming neither the call nor the fix).
@pytest.mark.parametrize(
    ("setup", "tbl", "ids", "sqlstate", "message"),
    [
        ("CREATE SEQUENCE tally", "tally", "ARRAY[1]", "42809", "public.tally is a sequence, not a table"),
        (
            "CREATE TABLE indexed (id bigint PRIMARY KEY)",
            "indexed_pkey",
            "ARRAY[1]",
            "42809",
            "public.indexed_pkey is an index, not a table",
        ),
        (
            "CREATE TYPE pair AS (id bigint)",
            "pair",
            "ARRAY[1]",
            "42809",
            "public.pair is a composite type, not a",
        ),
        (
            "CREATE MATERIALIZED VIEW frozen AS SELECT 1::bigint AS id",
            "frozen",
            "ARRAY[1]",
            "42809",
            "public.frozen is a materialized view, not a table",
        ),
        (
            "CREATE TABLE base (id bigint); CREATE VIEW totals AS SELECT max(id) AS id FROM base",
            "totals",
            "ARRAY[1]",
            "42809",
            "rows of view public.totals cannot be locked",
        ),
        (
            "CREATE TABLE unkeyed (key bigint)",
            "unkeyed",
            "ARRAY[1]",
            "42703",
            'table public.unkeyed has no column "id"',
        ),
        (
            "CREATE TABLE by_oid (id oid PRIMARY KEY)",
            "by_oid",
            "ARRAY[1, 4294967296]",
            "22003",
            'id 4294967296 is out of range for column "id" of table public.by_oid \\(oid\\)',
        ),
        ("", "1", "ARRAY[1]", "42P01", "relation with OID 1 does not exist"),
    ],
)
def test_lock_rows_names_a_relation_it_cannot_lock_rows_of(db, setup, tbl, ids, sqlstate, message):
    if setup:
        db.conn.execute(setup)
    with db.connect() as conn:
        conn.execute("BEGIN")
        with pytest.raises(psycopg.Error, match=message) as err:
            conn.execute(f"SELECT pglockkit.lock_rows(%s::regclass, {ids})", (tbl,))
        assert err.value.sqlstate == sqlstate
        conn.execute("ROLLBACK")


def test_lock_rows_locks_through_a_simple_view_and_a_partitioned_table(db):
    db.conn.execute("CREATE TABLE parts (id bigint PRIMARY KEY) PARTITION BY RANGE (id)")
    db.conn.execute("CREATE TABLE parts_low PARTITION OF parts FOR VALUES FROM (0) TO (100)")
    db.conn.execute("INSERT INTO parts SELECT g FROM generate_series(1, 5) g")
    db.conn.execute("CREATE VIEW parts_view AS SELECT id FROM parts WHERE id > 1")
    db.conn.execute("CREATE TABLE by_oid (id oid PRIMARY KEY)")
    db.conn.execute("INSERT INTO by_oid VALUES (4294967295)")
    with db.connect() as conn, db.connect() as other, conn.transaction():
        assert conn.execute("SELECT pglockkit.lock_rows('parts', ARRAY[2, 9])").fetchone()[0] == 1
        assert conn.execute("SELECT pglockkit.lock_rows('parts_view', ARRAY[1, 3])").fetchone()[0] == 1
        assert conn.execute("SELECT pglockkit.lock_rows('by_oid', ARRAY[4294967295])").fetchone()[0] == 1
        other.execute("SET lock_timeout = '50ms'")
        for table, row in (("parts", 2), ("parts", 3), ("by_oid", 4294967295)):
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute(f"SELECT 1 FROM {table} WHERE id = {row} FOR UPDATE")


# --- bad input ----------------------------------------------------------------------------------

BAD_CALLS = [
    ("SELECT pglockkit.lock_key('graphs', NULL::text)", "22004", "resource must not be null"),
    ("SELECT pglockkit.lock_key(NULL, 'x')", "22004", "namespace must not be null"),
    ("SELECT pglockkit.lock_key('graphs', -1)", "22003", "out of range"),
    ("SELECT pglockkit.lock_key('graphs', 140737488355328)", "22003", "out of range"),
    ("SELECT pglockkit.try_lock('graphs', NULL::text)", "22004", "must not be null"),
    ("SELECT pglockkit.try_lock('graphs', -5)", "22003", "out of range"),
    ("SELECT pglockkit.unlock('graphs', NULL::bigint)", "22004", "must not be null"),
    ("SELECT pglockkit.try_xact_lock(NULL, 'x')", "22004", "must not be null"),
    ("SELECT pglockkit.xact_lock('graphs', 'x', interval '0')", "22023", "must be positive"),
    ("SELECT pglockkit.xact_lock('graphs', 'x', interval '-1 ms')", "22023", "must be positive"),
    ("SELECT pglockkit.xact_lock('graphs', 'x', interval '1 day -25 hours')", "22023", "must be positive"),
    ("SELECT pglockkit.xact_lock('graphs', 'x', interval '30 days')", "22003", "out of range"),
    ("SELECT pglockkit.xact_lock('graphs', -1, interval '1 s')", "22003", "out of range"),
    ("SELECT pglockkit.xact_lock_all('graphs', NULL::text[])", "22004", "without nulls"),
    ("SELECT pglockkit.xact_lock_all('graphs', ARRAY['a', NULL])", "22004", "without nulls"),
    ("SELECT pglockkit.xact_lock_all('graphs', ARRAY[1, -1]::bigint[])", "22003", "out of range"),
    ("SELECT pglockkit.xact_lock_all('graphs', ARRAY['a'], interval '0')", "22023", "must be positive"),
    (
        "SELECT pglockkit.xact_lock_all('graphs', ARRAY(SELECT 'r' || g FROM generate_series(1, 1001) g))",
        "22023",
        "at most 1000 resources, got 1001",
    ),
    # 20,001 locks would fill the server's shared lock table (53200 for every session) before 0014.
    (
        "SELECT pglockkit.xact_lock_all('graphs', ARRAY(SELECT g::bigint FROM generate_series(0, 20000) g))",
        "22023",
        "at most 1000 resources, got 20001",
    ),
]


@pytest.mark.parametrize(("call", "sqlstate", "message"), BAD_CALLS)
def test_bad_input_is_rejected_and_takes_no_lock(db, ns, call, sqlstate, message, advisory_locks):
    registry = db.conn.execute("SELECT * FROM pglockkit.namespaces ORDER BY id").fetchall()
    with db.connect() as conn:
        conn.execute("BEGIN")
        with pytest.raises(psycopg.Error, match=message) as err:
            conn.execute(call)
        assert err.value.sqlstate == sqlstate
        conn.execute("ROLLBACK")
        assert advisory_locks(db.conn, conn.info.backend_pid) == 0
    assert db.conn.execute("SELECT * FROM pglockkit.namespaces ORDER BY id").fetchall() == registry


def test_a_lock_timeout_names_the_holder_in_its_own_message(db, ns):
    """locks.md: "A timeout names the holder". The server's 55P03 says who in its DETAIL, and
    psycopg's own exception text shows it; the LockTimeout the helpers raise instead kept only
    the primary message, so `str(exc)` (what a log line or an HTTP 503 body shows) lost the pid.
    Checked on the cached-key path, the first-call SQL path and xact_lock_all."""
    with db.connect() as holder, db.connect() as waiter:
        with holder.transaction():
            pglockkit.xact_lock(holder, ns, "invoice:9")
            pid = holder.info.backend_pid
            for attempt in ("first call (SQL function)", "cached key (_xact_lock)"):
                with pytest.raises(pglockkit.LockTimeout) as err, waiter.transaction():
                    pglockkit.xact_lock(waiter, ns, "invoice:9", timeout=0.1)
                assert f"Held by pid {pid}" in str(err.value), (attempt, str(err.value))
            with pytest.raises(pglockkit.LockTimeout) as err, waiter.transaction():
                pglockkit.xact_lock_all(waiter, ns, ["invoice:1", "invoice:9"], timeout=0.1)
            assert f"Held by pid {pid}" in str(err.value), str(err.value)


# --- review (locks): inputs the Python helpers must refuse with the documented SQLSTATE -----------


@pytest.mark.parametrize("resource", [2**63, -(2**63) - 1, 2**64])
@pytest.mark.parametrize("helper", ["xact_lock", "try_xact_lock", "resource_key", "sole_writer"])
def test_an_integer_resource_beyond_bigint_is_refused_as_out_of_range(db, ns, helper, resource):
    """errors.md: an integer resource outside 0..2^47-1 is 22003 (InvalidArgument). psycopg sends a
    Python int past int64 as numeric, and the call failed with 42883 "function
    pglockkit.xact_lock(unknown, numeric, unknown) does not exist" instead (as int4() in _calls
    already fixes for the integer arguments of other calls)."""
    with db.connect() as conn:
        with pytest.raises(pglockkit.InvalidArgument, match="out of range") as err:
            if helper == "sole_writer":
                with pglockkit.sole_writer(db.dsn, ns, resource):
                    pass
            elif helper == "resource_key":
                pglockkit.locks.resource_key(conn, ns, resource)
            else:
                with conn.transaction():
                    getattr(pglockkit, helper)(conn, ns, resource)
        assert err.value.sqlstate == "22003"


def test_xact_lock_all_never_locks_a_number_that_is_not_an_int_as_text(db, ns):
    """A Decimal (what psycopg returns for a numeric column) or a float is neither a text nor an
    integer resource. xact_lock refuses it (with 42883), keys.lock_key with TypeError; but
    xact_lock_all sent the list as %s::text[] and silently locked the TEXT resources '7' and '8',
    not the integer ids 7 and 8 that a SQL client locks: no mutual exclusion between the two."""
    from decimal import Decimal

    for resources, named in (([Decimal(7), Decimal(8)], "Decimal"), ([7.0, 8.0], "float"), ([True], "bool")):
        with db.connect() as conn, conn.transaction():
            with pytest.raises(
                pglockkit.InvalidArgument, match=f"all text or all integers, got {named}"
            ) as err:
                pglockkit.xact_lock_all(conn, ns, resources)
            assert err.value.sqlstate == "22023"
            assert (
                conn.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
                ).fetchone()[0]
                == 0
            )
    with db.connect() as conn, conn.transaction():
        with pytest.raises(pglockkit.InvalidArgument, match="mixed"):
            pglockkit.xact_lock_all(conn, ns, [1, "a"])
        with pytest.raises(pglockkit.InvalidArgument, match="integer ids, got Decimal"):
            pglockkit.lock_rows(conn, "pglockkit.namespaces", [Decimal("1.5")])


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), float("-inf"), 1e15])
@pytest.mark.parametrize("helper", ["xact_lock", "xact_lock_all", "lock_rows", "register_namespace"])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_invalid_argument(db, ns, helper, timeout):
    """errors.md: every error carries a SQLSTATE and a message naming the problem (a bad timeout:
    22023, over 24 days: 22003). A NaN or infinite float timeout raised datetime's bare
    ValueError("cannot convert float NaN to integer") / OverflowError("cannot convert float
    infinity to integer"), naming neither the timeout nor the call."""
    with db.connect() as conn:
        with (
            pytest.raises(pglockkit.InvalidArgument, match=f"timeout {timeout!r}") as err,
            conn.transaction(),
        ):
            if helper == "xact_lock":
                pglockkit.xact_lock(conn, ns, "x", timeout=timeout)
            elif helper == "xact_lock_all":
                pglockkit.xact_lock_all(conn, ns, ["x"], timeout=timeout)
            elif helper == "register_namespace":
                pglockkit.register_namespace(conn, "slow", lock_timeout=timeout)
            else:
                pglockkit.lock_rows(conn, "pglockkit.namespaces", [1], timeout=timeout)
        assert err.value.sqlstate in ("22023", "22003")


# --- review (locks): timeouts whose month/year parts compare one way and are timed another --------


@pytest.mark.parametrize(
    "call",
    [
        "SELECT pglockkit.xact_lock(%s, 'held', interval '-1 year 361 days')",
        "SELECT pglockkit.xact_lock_all(%s, ARRAY['held'], interval '-1 year 361 days')",
    ],
)
def test_a_timeout_that_compares_as_a_day_is_not_timed_as_a_millisecond(db, ns, call):
    """'-1 year 361 days' compares as 1 day (a year is 360 days to interval comparison), so
    _check_timeout and xact_lock's fast-path guard accept it; but _set_lock_timeout times it by
    its epoch (a year is 365.25 days there): -4.25 days, clamped to 1 ms, and the call gave up
    with 55P03 "within -1 years +361 days" at once. (Leases already refuse '-2 mon 61 days' for
    the same reason: positive to compare, not in effect.) It must be refused up front (22023) or
    waited as what it compares as; here the holder is still there after 1 s."""
    with db.connect() as holder, db.connect() as waiter:
        holder.execute("SELECT pglockkit.try_lock(%s, 'held')", (ns,))
        waiter.execute("BEGIN")
        waiter.execute("SET LOCAL statement_timeout = '1s'")
        with pytest.raises(psycopg.errors.QueryCanceled):  # still waiting after 1 s, as for a day
            waiter.execute(call, (ns,))
        waiter.execute("ROLLBACK")


def test_a_positive_timeout_under_24_days_never_fails_on_the_lock_timeout_setting(db, ns):
    """'1 year -340 days' compares as 20 days (accepted: positive, under 24 days), but its epoch
    is 25.25 days, and _set_lock_timeout failed with the server's 22023 'invalid value for
    parameter "lock_timeout": "2181600000ms"' (Value exceeds integer range), a message about a
    setting the caller never named. The same value passes register_namespace and the namespaces
    CHECK, after which every contended xact_lock in that namespace fails that way."""
    db.conn.execute(
        "SELECT pglockkit.register_namespace('lenient', lock_timeout => interval '1 year -340 days')"
    )
    for namespace, timeout in ((ns, "interval '1 year -340 days'"), ("lenient", "NULL")):
        with db.connect() as holder, db.connect() as waiter:
            holder.execute("SELECT pglockkit.try_lock(%s, 'held')", (namespace,))
            waiter.execute("BEGIN")
            waiter.execute("SET LOCAL statement_timeout = '1s'")
            with pytest.raises(psycopg.errors.QueryCanceled):  # waiting, as for 20 days
                waiter.execute(f"SELECT pglockkit.xact_lock(%s, 'held', {timeout})", (namespace,))
            waiter.execute("ROLLBACK")


# --- review (locks): lock_rows on a floating-point id column ---------------------------------------


def test_lock_rows_never_locks_a_row_whose_id_is_not_the_one_asked_for(db):
    """errors.md / locks.md: lock_rows takes rows by their id (an integer or numeric; 42804 for an
    id that is not a number). On a double precision id the bigint id is converted to float8, and
    2^53 + 1 became 2^53: lock_rows locked the row with id 2^53, counted it as found, and left
    the caller believing it holds row 2^53 + 1. Either refuse a floating-point id column (42804)
    or lock only rows whose id equals the id asked for."""
    db.conn.execute("CREATE TABLE measured (id double precision PRIMARY KEY)")
    db.conn.execute("INSERT INTO measured VALUES (9007199254740992)")  # 2^53
    with db.connect() as conn, db.connect() as other:
        conn.execute("BEGIN")
        with pytest.raises(psycopg.errors.DatatypeMismatch, match="double precision, not an integer"):
            conn.execute("SELECT pglockkit.lock_rows('measured', ARRAY[9007199254740993])")
        conn.execute("ROLLBACK")
        other.execute("SET lock_timeout = '100ms'")
        rows = other.execute("SELECT id FROM measured WHERE id = 9007199254740992 FOR UPDATE").fetchall()
        assert len(rows) == 1  # not locked by lock_rows


def test_sole_writer_releases_the_key_it_took_even_if_the_namespace_moved(db):
    """sole_writer takes the session lock on the key it computed at entry, but its exit called
    pglockkit.unlock(ns, resource), which computes the key again from the registry as it is then.
    With the namespace re-registered under another id while the block ran (deleted by hand, which
    python.md's cache note treats as a case to survive), a block that succeeded raised
    LockNotHeld (55000) on exit, with the hint that blames a transaction-mode pooler; had it been
    deleted, UnknownNamespace. The exit should release the key it took (pg_advisory_unlock(key))."""
    db.conn.execute("SELECT pglockkit.register_namespace('moving', 500)")
    with pglockkit.sole_writer(db.dsn, "moving", "job") as mine:
        assert mine
        db.conn.execute("DELETE FROM pglockkit.namespaces WHERE name = 'moving'")
        db.conn.execute("SELECT pglockkit.register_namespace('moving', 501)")
    assert db.conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(500, "job"),)).fetchone()[0]


# --- review (latest): integer types other than int that psycopg sends as integers ------------------


def test_lock_rows_and_xact_lock_all_take_numpy_integer_ids_as_xact_lock_does(db, ns, orders):
    """numpy integers (what pandas hands out, and what psycopg sends as int2..int8) are integers:
    before c77906d lock_rows([np.int64(3)]) locked row 3, and xact_lock(np.int64(7)) still locks
    the integer resource 7. The new input checks test ``isinstance(i, int)``, so lock_rows now
    raises InvalidArgument "lock_rows takes integer ids, got int64" (an integer id refused as not
    an integer), and xact_lock_all "all text or all integers, got int64" for what xact_lock takes.
    operator.index() (or numbers.Integral) would tell integers from 1.5 / Decimal('1.5')."""
    import numpy as np  # in the dev extra, with matplotlib

    with db.connect() as conn, conn.transaction():
        assert pglockkit.lock_rows(conn, orders, [np.int64(3), np.int64(1)]) == 2
        key = pglockkit.xact_lock(conn, ns, np.int64(7))
        assert pglockkit.xact_lock_all(conn, ns, [np.int64(7)]) == [key]


def test_sole_writer_keeps_its_lock_while_the_server_ends_idle_sessions(db, ns):
    """A managed server (or a role) with idle_session_timeout ends sessions idle that long. The
    sole_writer connection is idle for the whole block, so the server ends it, the lock goes
    with it, and a second replica runs the same tick while the first is still running: the
    duplicate sole_writer exists to stop, with nothing reported to either replica."""
    db.conn.execute(f'ALTER DATABASE "{db.conn.info.dbname}" SET idle_session_timeout = 1000')
    with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine:
        assert mine
        time.sleep(2.0)  # the graph run, longer than the server's idle_session_timeout
        with pglockkit.sole_writer(db.dsn, ns, "restock_plan") as rival:
            assert not rival, "a second replica won the lock while the first was still running"

    async def async_replicas() -> None:
        async with aio.sole_writer(db.dsn, ns, "restock_plan") as mine:
            assert mine
            await asyncio.sleep(2.0)
            async with aio.sole_writer(db.dsn, ns, "restock_plan") as rival:
                assert not rival, "a second replica won the lock while the first was still running"

    asyncio.run(async_replicas())
