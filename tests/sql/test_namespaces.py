"""The namespace registry: derived ids, idempotent registration, collisions, bad input."""

from __future__ import annotations

import threading
from datetime import timedelta

import psycopg
import pytest

import pglockkit
from pglockkit import namespace_id


def _registry(conn):
    return conn.execute(
        "SELECT id, name, description, lock_timeout FROM pglockkit.namespaces ORDER BY id"
    ).fetchall()


def test_kit_namespace_is_registered_at_install(db):
    assert db.conn.execute("SELECT id FROM pglockkit.namespaces WHERE name = 'pglockkit'").fetchone()[
        0
    ] == namespace_id("pglockkit")


def test_derived_id_is_deterministic_and_registration_idempotent(db):
    first = pglockkit.register_namespace(db.conn, "billing", description="invoices")
    assert first == namespace_id("billing")
    assert pglockkit.register_namespace(db.conn, "billing") == first
    assert pglockkit.register_namespace(db.conn, "billing", first) == first
    rows = [r for r in _registry(db.conn) if r[1] == "billing"]
    assert rows == [(first, "billing", "invoices", None)]


def test_reregistration_updates_description_and_timeout_only_when_given(db):
    pglockkit.register_namespace(db.conn, "cron", 77, "nightly jobs", lock_timeout=2)
    pglockkit.register_namespace(db.conn, "cron")
    assert [r for r in _registry(db.conn) if r[1] == "cron"] == [
        (77, "cron", "nightly jobs", timedelta(seconds=2))
    ]
    pglockkit.register_namespace(db.conn, "cron", lock_timeout=timedelta(milliseconds=500))
    assert [r for r in _registry(db.conn) if r[1] == "cron"] == [
        (77, "cron", "nightly jobs", timedelta(milliseconds=500))
    ]


def test_id_collision_names_the_holder_and_changes_nothing(db):
    pglockkit.register_namespace(db.conn, "billing", 42)
    before = _registry(db.conn)
    with pytest.raises(pglockkit.NamespaceConflict, match='held by namespace "billing"') as err:
        pglockkit.register_namespace(db.conn, "shipping", 42)
    assert err.value.sqlstate == "23505"
    with pytest.raises(pglockkit.NamespaceConflict, match="already registered with id 42, not 43"):
        pglockkit.register_namespace(db.conn, "billing", 43)
    assert _registry(db.conn) == before


def test_derived_id_collision_is_an_error_naming_the_holder(db):
    # Take the id that 'victim' would derive under another name.
    pglockkit.register_namespace(db.conn, "squatter", namespace_id("victim"))
    with pytest.raises(pglockkit.NamespaceConflict, match='held by namespace "squatter"'):
        pglockkit.register_namespace(db.conn, "victim")
    assert pglockkit.register_namespace(db.conn, "victim", 9) == 9


@pytest.mark.parametrize(
    ("args", "sqlstate", "message"),
    [
        ((None,), "22004", "must not be null"),
        (("",), "22023", "invalid namespace name"),
        (("Billing",), "22023", "invalid namespace name"),
        (("9lives",), "22023", "invalid namespace name"),
        (("has space",), "22023", "invalid namespace name"),
        (("x" * 64,), "22023", "invalid namespace name"),
        (("ok", 0), "22003", "out of range"),
        (("ok", 32768), "22003", "out of range"),
        (("ok", -1), "22003", "out of range"),
        (("ok", None, None, timedelta(0)), "22023", "must be positive"),
        (("ok", None, None, timedelta(seconds=-1)), "22023", "must be positive"),
    ],
)
def test_bad_input_is_rejected_with_sqlstate_and_nothing_changes(db, args, sqlstate, message):
    before = _registry(db.conn)
    padded = (*args, None, None, None)[:4]
    with pytest.raises(psycopg.Error, match=message) as err:
        db.conn.execute("SELECT pglockkit.register_namespace(%s, %s, %s, %s)", padded)
    assert err.value.sqlstate == sqlstate
    assert _registry(db.conn) == before


def test_many_pods_registering_at_once_agree(db):
    """Sixteen connections register the same name at the same instant: one id, no error."""
    barrier = threading.Barrier(16)
    results, errors = [], []

    def pod():
        try:
            with db.connect() as conn:
                barrier.wait()
                results.append(pglockkit.register_namespace(conn, "swarm"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=pod) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [namespace_id("swarm")] * 16
    assert (
        db.conn.execute("SELECT count(*) FROM pglockkit.namespaces WHERE name = 'swarm'").fetchone()[0] == 1
    )


def test_unknown_namespace_is_42704_everywhere(db):
    calls = [
        "SELECT pglockkit.lock_key('nope', 'x')",
        "SELECT pglockkit.lock_key('nope', 1)",
        "SELECT pglockkit.try_lock('nope', 'x')",
        "SELECT pglockkit.unlock('nope', 'x')",
        "SELECT pglockkit.try_xact_lock('nope', 'x')",
        "SELECT pglockkit.xact_lock('nope', 'x')",
        "SELECT pglockkit.xact_lock_all('nope', ARRAY['x'])",
    ]
    for call in calls:
        with pytest.raises(psycopg.errors.UndefinedObject, match='unknown lock namespace "nope"') as err:
            db.conn.execute(call)
        assert "register_namespace('nope')" in err.value.diag.message_hint
    # Nothing was auto-registered on the way.
    assert db.conn.execute("SELECT count(*) FROM pglockkit.namespaces WHERE name = 'nope'").fetchone()[0] == 0


def test_a_registry_change_reaches_plans_cached_before_it(db):
    """The registry is compiled into every plan that names a namespace. A prepared statement and
    a PL/pgSQL function of another session, planned (generic plans) before a change, see the
    change at their next run: a new name, an id changed by hand, a name deleted."""
    with db.connect() as app:
        app.execute("SET plan_cache_mode = force_generic_plan")
        app.execute("PREPARE k AS SELECT pglockkit.lock_key('late', 'x')")
        app.execute(
            "CREATE FUNCTION take_late() RETURNS bigint LANGUAGE plpgsql"
            " AS $$ BEGIN RETURN pglockkit.xact_lock('late', 'x'); END $$"
        )
        for _ in range(3):
            with pytest.raises(psycopg.errors.UndefinedObject):
                app.execute("EXECUTE k")
            with pytest.raises(psycopg.errors.UndefinedObject):
                app.execute("SELECT take_late()")
        db.conn.execute("SELECT pglockkit.register_namespace('late', 77)")
        for _ in range(3):
            assert app.execute("EXECUTE k").fetchone()[0] == pglockkit.lock_key(77, "x")
            assert app.execute("SELECT take_late()").fetchone()[0] == pglockkit.lock_key(77, "x")
        # Ids are permanent through the API; an owner can still edit the table.
        db.conn.execute("UPDATE pglockkit.namespaces SET id = 78 WHERE name = 'late'")
        assert app.execute("EXECUTE k").fetchone()[0] == pglockkit.lock_key(78, "x")
        assert app.execute("SELECT take_late()").fetchone()[0] == pglockkit.lock_key(78, "x")
        db.conn.execute("DELETE FROM pglockkit.namespaces WHERE name = 'late'")
        with pytest.raises(psycopg.errors.UndefinedObject):
            app.execute("EXECUTE k")
        with pytest.raises(psycopg.errors.UndefinedObject):
            app.execute("SELECT take_late()")


def test_a_name_missing_from_the_compiled_registry_is_read_from_the_table(db):
    db.conn.execute("SELECT pglockkit.register_namespace('aside', 91)")
    # What a registration that could not see this one (REPEATABLE READ) would have compiled.
    db.conn.execute(
        "CREATE OR REPLACE FUNCTION pglockkit._ns_registry(ns text) RETURNS smallint"
        " LANGUAGE sql STABLE PARALLEL SAFE BEGIN ATOMIC SELECT NULL::int2; END"
    )
    assert db.conn.execute("SELECT pglockkit.lock_key('aside', 'r')").fetchone()[0] == pglockkit.lock_key(
        91, "r"
    )
    with db.conn.transaction():
        assert db.conn.execute("SELECT pglockkit.xact_lock('aside', 5)").fetchone()[0] == pglockkit.lock_key(
            91, 5
        )
    with pytest.raises(psycopg.errors.UndefinedObject):
        db.conn.execute("SELECT pglockkit.lock_key('absent', 'r')")


def test_compiling_under_repeatable_read_never_keeps_a_deleted_name(db):
    """A registration whose snapshot still shows a name deleted since cannot compile that name
    back into the registry: it fails with a serialization error (retry), and the name stays
    unknown."""
    db.conn.execute("SELECT pglockkit.register_namespace('doomed', 92)")
    with db.connect(autocommit=False) as rr:
        rr.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        assert (
            rr.execute("SELECT count(*) FROM pglockkit.namespaces WHERE name = 'doomed'").fetchone()[0] == 1
        )
        db.conn.execute("DELETE FROM pglockkit.namespaces WHERE name = 'doomed'")
        with pytest.raises(psycopg.errors.SerializationFailure):
            rr.execute("SELECT pglockkit.register_namespace('newcomer', 93)")
        rr.rollback()
        assert pglockkit.register_namespace(rr, "newcomer", 93) == 93
        rr.commit()
    assert db.conn.execute("SELECT pglockkit._ns_registry('doomed')").fetchone()[0] is None
    with pytest.raises(psycopg.errors.UndefinedObject):
        db.conn.execute("SELECT pglockkit.lock_key('doomed', 'r')")
    assert db.conn.execute("SELECT pglockkit.lock_key('newcomer', 'r')").fetchone()[0] == pglockkit.lock_key(
        93, "r"
    )


def test_concurrent_registrations_of_different_names_all_reach_the_compiled_registry(db):
    """Sixteen pods register sixteen names at the same instant: no error (two compilations at
    once would fail with "tuple concurrently updated"), and the compiled registry holds them all."""
    barrier = threading.Barrier(16)
    errors = []

    def pod(i):
        try:
            with db.connect() as conn:
                barrier.wait()
                pglockkit.register_namespace(conn, f"pod{i}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=pod, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rows = db.conn.execute(
        "SELECT n.name, n.id, pglockkit._ns_registry(n.name)"
        " FROM pglockkit.namespaces n WHERE n.name LIKE 'pod%'"
    ).fetchall()
    assert len(rows) == 16
    assert all(compiled == nid for _, nid, compiled in rows), rows


def test_registering_a_name_again_leaves_every_sessions_cached_plans_alone(db):
    """register_namespace is called again and again (every pod at start-up, an agent per task).
    Once a name is registered, another call answers from the table: it must not compile the
    registry again, since replacing _ns_registry invalidates, in every session, each cached plan
    that inlined it (every prepared named lock is planned again), and takes the compiler's lock
    and a catalog write. Before, its INSERT ... ON CONFLICT DO NOTHING fired the statement trigger
    that compiles, whether or not it inserted. A name the compiled registry lacks (a REPEATABLE
    READ registration that could not see it) is still compiled in by registering it again."""

    def compiled_version():
        return db.conn.execute(
            "SELECT xmin::text FROM pg_proc WHERE oid = 'pglockkit._ns_registry'::regproc"
        ).fetchone()[0]

    pglockkit.register_namespace(db.conn, "again", 94)
    before = compiled_version()
    for _ in range(3):
        assert pglockkit.register_namespace(db.conn, "again") == 94
        assert pglockkit.register_namespace(db.conn, "again", 94) == 94
    assert pglockkit.register_namespace(db.conn, "again", description="updated") == 94
    assert compiled_version() == before

    # What a registration that could not see 'again' would have compiled: registering it again mends it.
    db.conn.execute(
        "CREATE OR REPLACE FUNCTION pglockkit._ns_registry(ns text) RETURNS smallint"
        " LANGUAGE sql STABLE PARALLEL SAFE BEGIN ATOMIC SELECT NULL::int2; END"
    )
    assert pglockkit.register_namespace(db.conn, "again") == 94
    assert db.conn.execute("SELECT pglockkit._ns_registry('again')").fetchone()[0] == 94
