"""The Python lock helpers' fast path (issue 16): one round trip, with a key computed locally from
the namespace id cached per process and database, that costs the server one try when the lock is
free (a held lock then waits in SQL, in a second statement); namespaces not cached and bad input
go to the SQL functions, as before. Each test runs the sync helpers and their
``pglockkit.aio`` twins through one client class (one suite, both drivers), on both servers.
Round trips are counted from libpq's protocol trace, locks read from ``pg_locks`` by another
connection."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import psycopg
import pytest
from psycopg import pq

import pglockkit
import pglockkit.aio as aio
from pglockkit import _calls, _nscache, lock_key


def _numbered(query: str) -> str:
    """A query as the server sees it: psycopg's %s placeholders numbered $1, $2, ..."""
    parts = query.split("%s")
    return "".join(f"{p}${i}" for i, p in enumerate(parts[:-1], 1)) + parts[-1]


TRY = _numbered(_calls.TRY_KEY)  # the one statement of a free lock with the namespace id cached
WAIT = _numbered(_calls.WAIT_KEY)  # xact_lock's second, when the key is held
TRY_ALL = _numbered(_calls.TRY_KEYS)  # xact_lock_all's one statement for free locks, cache filled
LOCK_ALL = _numbered(_calls.XACT_LOCK_ALL_TEXTS)  # its SQL function (cache empty, or a key held)


class Client:
    """One connection (``autocommit=False``) and the lock helpers on it, sync or async."""

    def __init__(self, dsn: str, flavour: str):
        self.flavour = flavour
        if flavour == "sync":
            self.conn = psycopg.connect(dsn)
        else:
            self._runner = asyncio.Runner()
            self.conn = self._runner.run(psycopg.AsyncConnection.connect(dsn))
        self.pid = self.conn.info.backend_pid

    def _call(self, name: str, *args):
        if self.flavour == "sync":
            return getattr(pglockkit, name)(self.conn, *args)
        return self._runner.run(getattr(aio, name)(self.conn, *args))

    def xact_lock(self, ns, resource, timeout=None) -> int:
        return self._call("xact_lock", ns, resource, timeout)

    def try_xact_lock(self, ns, resource) -> bool:
        return self._call("try_xact_lock", ns, resource)

    def xact_lock_all(self, ns, resources, timeout=None) -> list[int]:
        return self._call("xact_lock_all", ns, resources, timeout)

    def execute(self, query: str, params=()) -> None:
        if self.flavour == "sync":
            self.conn.execute(query, params)
        else:
            self._runner.run(self.conn.execute(query, params))

    def autocommit(self) -> None:
        if self.flavour == "sync":
            self.conn.autocommit = True
        else:
            self._runner.run(self.conn.set_autocommit(True))

    def rollback(self) -> None:
        if self.flavour == "sync":
            self.conn.rollback()
        else:
            self._runner.run(self.conn.rollback())

    @contextmanager
    def statements(self) -> Iterator[list[str]]:
        """The statements sent meanwhile, one entry per round trip (its text, from the trace)."""
        sent: list[str] = []
        with tempfile.TemporaryFile("w+") as trace:
            self.conn.pgconn.trace(trace.fileno())
            self.conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            try:
                yield sent
            finally:
                self.conn.pgconn.untrace()
                trace.seek(0)
                lines = [line.rstrip("\n").split("\t") for line in trace]
        texts = [f[3].strip().split('"')[-2] for f in lines if f[0] == "F" and f[2] in ("Parse", "Query")]
        trips = sum(1 for f in lines if f[0] == "B" and f[2] == "ReadyForQuery")
        assert len(texts) == trips, lines  # one statement per round trip, none prepared
        sent.extend(texts)

    def close(self) -> None:
        if self.conn.closed:
            return
        if self.flavour == "sync":
            self.conn.close()
        else:
            self._runner.run(self.conn.close())
            self._runner.close()


@pytest.fixture(params=["sync", "aio"])
def client(request, db):
    """A ``Client`` on ``db``, with the sync helpers or the aio twins, closed after the test."""
    made: list[Client] = []

    def make(dsn: str = db.dsn) -> Client:
        made.append(Client(dsn, request.param))
        return made[-1]

    yield make
    for c in made:
        c.close()


def held(conn: psycopg.Connection, pid: int) -> set[int]:
    """The advisory keys ``pid`` holds, as another connection sees them in ``pg_locks``."""
    rows = conn.execute(
        """SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks
            WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND pid = %s""",
        (pid,),
    ).fetchall()
    return {r[0] for r in rows}


def sql_key(conn: psycopg.Connection, ns: str, resource: str | int) -> int:
    return conn.execute("SELECT pglockkit.lock_key(%s, %s)", (ns, resource)).fetchone()[0]


def installed_database(server, request) -> str:
    """The DSN of a new database with pglockkit, cloned from the server's template."""
    template = request.getfixturevalue(f"{server.name}_proc").template_dbname
    name = server.create_database()
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}"')
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return server.dsn(name)


@pytest.mark.parametrize("resource", [7, "invoice:7", "fäktura:7 ✓"])
def test_a_free_lock_is_one_round_trip_taking_the_key_sql_computes(db, ns, client, resource):
    c = client()
    c.execute("SELECT 1")  # the transaction is open: its BEGIN is not the helper's round trip
    with c.statements() as first:
        c.xact_lock(ns, "fills the cache")
    assert len(first) == 1 and "pglockkit.xact_lock" in first[0]
    with c.statements() as sent:
        key = c.xact_lock(ns, resource, 2)
        assert c.try_xact_lock(ns, f"{resource}+")
    assert sent == [TRY, TRY]
    assert key == sql_key(db.conn, ns, resource)
    assert held(db.conn, c.pid) >= {key, sql_key(db.conn, ns, f"{resource}+")}
    c.rollback()
    assert held(db.conn, c.pid) == set()


def test_a_long_resource_takes_the_fast_path_without_being_kept_in_the_key_cache(db, ns, client):
    c = client()
    c.execute("SELECT 1")
    c.xact_lock(ns, "fills the cache")
    long_id = random.getrandbits(64)
    long = f"row:{long_id}:" + "ä" * 20_000
    before = _calls._cached_key.cache_info().currsize
    with c.statements() as sent:
        key = c.xact_lock(ns, long, 2)
    assert sent == [TRY] and key == sql_key(db.conn, ns, long)
    assert key in held(db.conn, c.pid)
    assert _calls._cached_key.cache_info().currsize == before  # not kept alive by the cache
    c.xact_lock(ns, f"short:{long_id}")  # a name no other test locks
    assert _calls._cached_key.cache_info().currsize == before + 1  # a short one is
    c.rollback()


def test_xact_lock_all_takes_free_keys_in_one_round_trip_of_tries(db, ns, client):
    """The SQL function's first call teaches the cache; then a free set is one statement that
    tries the distinct keys, computed here, in ascending order: the keys SQL computes, held until
    the transaction ends."""
    c = client()
    c.execute("SELECT 1")
    with c.statements() as first:
        assert c.xact_lock_all(ns, ["fills", "the cache"]) == sorted(
            sql_key(db.conn, ns, r) for r in ("fills", "the cache")
        )
    assert first == [LOCK_ALL]
    with c.statements() as sent:
        texts = c.xact_lock_all(ns, ["z", "a", "fäktura ✓", "a"], 2)
        ints = c.xact_lock_all(ns, [9, 3, 9])
        once = c.xact_lock_all(ns, (r for r in ("g2", "g1")))  # any iterable, read once
    assert sent == [TRY_ALL, TRY_ALL, TRY_ALL]
    assert once == sorted(sql_key(db.conn, ns, r) for r in ("g1", "g2"))
    assert texts == sorted({sql_key(db.conn, ns, r) for r in ("z", "a", "fäktura ✓")})
    assert ints == sorted({sql_key(db.conn, ns, 9), sql_key(db.conn, ns, 3)})
    assert held(db.conn, c.pid) >= set(texts) | set(ints)
    c.rollback()
    assert held(db.conn, c.pid) == set()


def test_xact_lock_all_at_a_held_key_holds_only_the_keys_below_it_and_waits(db, ns, client):
    """The tries stop at the first held key, as the SQL function's do: while the call waits, its
    transaction holds exactly the keys below the held one (never one above a key it lacks: no
    deadlock between callers), then the SQL function takes the rest in order."""
    c = client()
    c.xact_lock_all(ns, ["fills the cache"])
    c.rollback()
    c.execute("SELECT 1")  # the transaction is open: its BEGIN is not the helper's round trip
    resources = [f"r{i}" for i in range(6)]
    keys = sorted(sql_key(db.conn, ns, r) for r in resources)
    seen: dict[str, set[int]] = {}
    with db.connect() as holder:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (keys[3],))
        threading.Timer(0.3, lambda: seen.setdefault("waiting", held(db.conn, c.pid))).start()
        threading.Timer(0.6, holder.execute, args=("COMMIT",)).start()
        with c.statements() as sent:
            started = time.monotonic()
            assert c.xact_lock_all(ns, resources, 5) == keys
            assert 0.5 <= time.monotonic() - started < 4
    assert sent == [TRY_ALL, LOCK_ALL]
    assert seen["waiting"] == set(keys[:3])
    assert held(db.conn, c.pid) == set(keys)


def test_a_callers_search_path_cannot_change_the_fast_path(db, ns, client):
    """A pg_try_advisory_xact_lock of the caller's, first on its search_path, is not the one called."""
    db.conn.execute("CREATE SCHEMA evil")
    db.conn.execute(
        "CREATE FUNCTION evil.pg_try_advisory_xact_lock(bigint) RETURNS boolean"
        " LANGUAGE sql AS $$ SELECT true $$"
    )
    c = client()
    c.execute("SET search_path = evil, pg_catalog")
    c.xact_lock(ns, "fills the cache")
    with db.connect() as other, other.transaction():
        assert pglockkit.try_xact_lock(other, ns, "r")
        with c.statements() as sent:
            assert c.try_xact_lock(ns, "r") is False
        assert sent == [TRY]


def test_a_namespace_registered_after_the_cache_was_filled_is_seen(db, ns, client):
    c = client()
    c.xact_lock(ns, "fills the cache")
    with pytest.raises(pglockkit.UnknownNamespace, match='unknown lock namespace "late"') as err:
        c.xact_lock("late", "r")
    assert err.value.sqlstate == "42704"
    c.rollback()
    db.conn.execute("SELECT pglockkit.register_namespace('late', 4242)")
    assert c.xact_lock("late", "r") == sql_key(db.conn, "late", "r")
    assert c.try_xact_lock("late", 9)
    assert held(db.conn, c.pid) >= {sql_key(db.conn, "late", "r"), lock_key(4242, 9)}


def test_held_locks_are_skipped_or_waited_for_with_the_cache_filled(db, ns, client, caplog):
    caplog.set_level(logging.INFO, logger="pglockkit.locks")
    c = client()
    c.xact_lock(ns, "fills the cache")
    key = lock_key(pglockkit.namespace_id(ns), "busy")
    with db.connect() as holder:
        holder.execute("BEGIN")
        assert pglockkit.try_xact_lock(holder, ns, "busy")
        with c.statements() as sent:
            assert c.try_xact_lock(ns, "busy") is False
            threading.Timer(0.3, holder.execute, args=("COMMIT",)).start()
            started = time.monotonic()
            assert c.xact_lock(ns, "busy", timeout=5) == key
            assert 0.25 <= time.monotonic() - started < 3
        assert sent == [TRY, TRY, WAIT]  # try_xact_lock's try; xact_lock's, then its wait
    events = [r.pglockkit for r in caplog.records if hasattr(r, "pglockkit") and r.pglockkit["key"] == key]
    assert [(e["event"], e["namespace"], e["resource"]) for e in events[-2:]] == [
        ("skipped", ns, "busy"),
        ("acquired", ns, "busy"),
    ]
    assert events[-1]["wait_ms"] >= 250


def test_a_changed_lock_timeout_is_seen_at_once_and_the_error_names_the_holder(db, client, caplog):
    """The wait is decided in SQL, from the namespace's current row: no cached timeout to go stale."""
    caplog.set_level(logging.INFO, logger="pglockkit.locks")
    db.conn.execute("SELECT pglockkit.register_namespace('quick', lock_timeout => '50 ms')")
    c = client()
    with db.connect() as holder:
        assert holder.execute("SELECT pglockkit.try_lock('quick', 'x')").fetchone()[0]
        for timeout in ("00:00:00.05", "00:00:00.08"):
            c.xact_lock("quick", "fills the cache")
            with pytest.raises(pglockkit.LockTimeout) as err:
                c.xact_lock("quick", "x")
            c.rollback()
            cause = err.value.__cause__
            assert (
                f"quick/x (key {sql_key(db.conn, 'quick', 'x')}) within {timeout}"
                in cause.diag.message_primary
            )
            assert f"Held by pid {holder.info.backend_pid}" in cause.diag.message_detail
            assert (
                err.value.sqlstate == "55P03" and err.value.retry_after == pglockkit.LockTimeout.retry_after
            )
            db.conn.execute("SELECT pglockkit.register_namespace('quick', lock_timeout => '80 ms')")
    timeouts = [r.pglockkit for r in caplog.records if getattr(r, "pglockkit", {}).get("event") == "timeout"]
    assert len(timeouts) == 2 and all(e["wait_ms"] >= 50 for e in timeouts)


def test_an_id_changed_by_hand_is_seen_after_the_refresh_interval(db, client, monkeypatch):
    db.conn.execute("SELECT pglockkit.register_namespace('moved', 101)")
    c = client()
    assert c.xact_lock("moved", "r") >> 48 == 101
    c.rollback()
    db.conn.execute("DELETE FROM pglockkit.namespaces WHERE name = 'moved'")
    db.conn.execute("SELECT pglockkit.register_namespace('moved', 202)")
    # The documented trade-off: until the interval has passed, the cached id is used. (And the
    # statement's fallback to pglockkit.xact_lock, which would take the new key, did not run.)
    assert c.xact_lock("moved", "r") == lock_key(101, "r")
    assert held(db.conn, c.pid) == {lock_key(101, "r")}
    c.rollback()
    monkeypatch.setattr(_nscache, "REFRESH_S", 0.0)
    assert c.xact_lock("moved", "r") == lock_key(202, "r") == sql_key(db.conn, "moved", "r")
    assert held(db.conn, c.pid) == {lock_key(202, "r")}


def test_one_name_with_other_ids_in_two_databases_gets_the_key_of_each(db, server, request, client):
    other_dsn = installed_database(server, request)
    db.conn.execute("SELECT pglockkit.register_namespace('multi', 301)")
    with psycopg.connect(other_dsn, autocommit=True) as other:
        other.execute("SELECT pglockkit.register_namespace('multi', 302)")
        a, b = client(), client(other_dsn)
        for _ in range(2):  # the second round from the cache
            for c, ns_id, conn in ((a, 301, db.conn), (b, 302, other)):
                assert c.xact_lock("multi", "r") == lock_key(ns_id, "r") == sql_key(conn, "multi", "r")
                assert c.try_xact_lock("multi", 5)
                assert held(conn, c.pid) == {lock_key(ns_id, "r"), lock_key(ns_id, 5)}
                c.rollback()


def test_a_database_created_again_under_its_name_gets_its_new_ids(server, request, client):
    """Test suites drop and create databases under one name: the ids cached for the old database
    are not used in the new one, though a connection to it has taken a lock (and so is known)."""
    dsn = installed_database(server, request)
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    template = request.getfixturevalue(f"{server.name}_proc").template_dbname
    for ns_id in (401, 402):
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pglockkit.register_namespace('first')")
            conn.execute("SELECT pglockkit.register_namespace('again', %s)", (ns_id,))
        c = client(dsn)
        c.xact_lock("first", "r")
        assert c.xact_lock("again", "r") == lock_key(ns_id, "r")
        assert c.try_xact_lock("again", "s")
        c.close()


BAD_INPUT = [  # (namespace, resource, timeout)
    ("missing", "r", None),
    (None, "r", None),
    ("graphs", None, None),
    ("graphs", -1, None),
    ("graphs", 2**47, None),
    ("graphs", 2**70, None),
    ("graphs", True, None),
    ("graphs", 1.5, None),
    ("graphs", "a\x00b", None),
    ("graphs", "r", 0),
    ("graphs", "r", -1),
    ("graphs", 7, timedelta(days=25)),
]
TODAY = {  # the helpers' one SQL call before the fast path
    "xact_lock": "SELECT pglockkit.xact_lock(%s, %s, %s)",
    "try_xact_lock": "SELECT pglockkit.try_xact_lock(%s, %s)",
}


def _outcome(call) -> tuple:
    """What a caller can see of an error: its type, SQLSTATE, message, detail and hint. (Not the
    statement psycopg's text quotes for errors at parse time: the SQL calls now return more.)"""
    try:
        call()
    except Exception as exc:
        server = exc.__cause__ if isinstance(exc, pglockkit.PglockkitError) else exc
        diag = getattr(server, "diag", None)
        if diag is None or diag.message_primary is None:  # raised in the client
            return type(exc), str(exc)
        return type(exc), diag.sqlstate, diag.message_primary, diag.message_detail, diag.message_hint
    raise AssertionError("no error")


@pytest.mark.parametrize("helper", ["xact_lock", "try_xact_lock"])
def test_bad_input_gets_the_same_error_with_the_cache_filled_or_not(db, ns, client, helper, monkeypatch):
    """Each bad input is refused as the helpers' one SQL call refused it before the fast path, with
    the namespace not cached and cached: same exception type, SQLSTATE and message."""
    c = client()
    with db.connect(autocommit=False) as today:
        for namespace, resource, timeout in BAD_INPUT:
            if helper == "try_xact_lock" and timeout is not None:
                continue
            args = (namespace, resource) if helper == "try_xact_lock" else (namespace, resource, timeout)
            params = args if helper == "try_xact_lock" else (namespace, resource, _calls.interval(timeout))
            try:  # an int past bigint is refused before any call (it went as a numeric: 42883)
                _calls.int_resource(resource)
            except pglockkit.InvalidArgument as exc:
                expected = (type(exc), str(exc))
            else:
                expected = _outcome(lambda p=params: _calls.run(today, _calls.Call(TODAY[helper], p)))
            today.rollback()
            for refresh_s in (-1.0, _nscache.REFRESH_S):  # never cached; cached
                monkeypatch.setattr(_nscache, "REFRESH_S", refresh_s)
                c.xact_lock(ns, "fills the cache")
                c.rollback()
                assert _outcome(lambda a=args: getattr(c, helper)(*a)) == expected, (args, refresh_s)
                c.rollback()
    c.autocommit()
    expected = _outcome(lambda: getattr(c, helper)(ns, "r"))
    assert expected[0] is ValueError and "conn.transaction()" in expected[1]


BAD_SETS = [  # (namespace, resources, timeout) for xact_lock_all
    ("missing", ["r"], None),
    (None, ["r"], None),
    ("graphs", ["r", None], None),
    ("graphs", [3, -1], None),
    ("graphs", [2**47], None),
    ("graphs", [True], None),
    ("graphs", ["a\x00b"], None),
    ("graphs", [f"r{i}" for i in range(1001)], None),
    ("graphs", ["r"], 0),
    ("graphs", ["r", "s"], -1),
    ("graphs", [7], timedelta(days=25)),
]


def test_xact_lock_all_bad_input_gets_the_same_error_with_the_cache_filled_or_not(
    db, ns, client, monkeypatch
):
    """As for the single locks: each bad set is refused as the SQL function's call refuses it, with
    the namespace cached or not."""
    c = client()
    with db.connect(autocommit=False) as today:
        for args in BAD_SETS:
            expected = _outcome(lambda a=args: _calls.run(today, _calls.xact_lock_all(today, *a)))
            today.rollback()
            for refresh_s in (-1.0, _nscache.REFRESH_S):  # never cached; cached
                monkeypatch.setattr(_nscache, "REFRESH_S", refresh_s)
                c.xact_lock_all(ns, ["fills the cache"])
                c.rollback()
                got = _outcome(lambda a=args: c.xact_lock_all(*a))
                assert got == expected, (args[0], args[1][:3], args[2], refresh_s)
                c.rollback()


def test_many_threads_share_one_cache(db, monkeypatch):
    """Eight threads, each on its own connection, lock in three namespaces while the cache is
    refreshed all the time; every key is the one the formula gives, and nothing raises."""
    ids = {"t.one": 11, "t.two": 12, "t.three": 13}
    for name, ns_id in ids.items():
        db.conn.execute("SELECT pglockkit.register_namespace(%s, %s)", (name, ns_id))
    monkeypatch.setattr(_nscache, "REFRESH_S", 0.002)
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(db.dsn) as conn:
                barrier.wait()
                for i in range(150):
                    name = rng.choice(list(ids))
                    resource = rng.choice([f"w{seed}.{i}", seed * 1000 + i])
                    if rng.random() < 0.5:
                        assert pglockkit.xact_lock(conn, name, resource) == lock_key(ids[name], resource)
                    else:
                        assert pglockkit.try_xact_lock(conn, name, resource) is True
                    conn.commit()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_collected_connection_leaves_the_cache_and_a_new_one_learns_again(db, ns):
    """The cache is keyed by id(connection): a finalizer drops the entry when the connection is
    collected, so a later connection that gets the same id does not inherit its database."""
    conn = psycopg.connect(db.dsn)
    with conn.transaction():
        pglockkit.xact_lock(conn, ns, "r")
    conn_id = id(conn)
    database, ids = _nscache._by_conn[conn_id]
    assert ids is _nscache._databases[database]
    assert _nscache.cached_id(conn, ns) == pglockkit.namespace_id(ns)
    conn.close()
    del conn
    gc.collect()
    assert conn_id not in _nscache._by_conn
