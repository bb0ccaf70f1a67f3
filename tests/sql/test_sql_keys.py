"""Lock keys: the SQL and Python implementations agree bit for bit, on the documented examples,
the vectors file (tests/vectors/lock_keys.json) and arbitrary unicode."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pglockkit import lock_key, namespace_id
from pglockkit.keys import pg_locks_ids

VECTORS_FILE = Path(__file__).resolve().parents[1] / "vectors" / "lock_keys.json"
FILE_VECTORS = json.loads(VECTORS_FILE.read_text(encoding="ascii"))["vectors"]


def _resource(row: dict) -> str | int:
    return row["resource"] if row["resource_type"] == "text" else int(row["resource"])


def _label(row: dict) -> str:
    resource = row["resource"] if len(row["resource"]) < 40 else row["resource"][:40] + "..."
    return f"{row['namespace']}/{resource!r} ({row['note']})"


# (namespace id, resource, key): the examples fixed in DESIGN.md and docs/locks.md.
VECTORS = [
    (1, "restock_plan", 458487468674308),
    (7301, "tenant:42", 2055230974443318157),
    (2, "", 828861615000702),
    (3, 42, 844424930132010),
]


@pytest.mark.parametrize(("ns_id", "resource", "key"), VECTORS)
def test_sql_key_matches_documented_vectors(db, ns_id, resource, key):
    db.conn.execute("SELECT pglockkit.register_namespace(%s, %s)", (f"ns{ns_id}", ns_id))
    assert db.conn.execute("SELECT pglockkit.lock_key(%s, %s)", (f"ns{ns_id}", resource)).fetchone()[0] == key


def test_sql_keys_match_vectors(db):
    failures = []
    namespaces = {(r["namespace"], r["namespace_id"], r["derived_id"]) for r in FILE_VECTORS}
    for name, nid, derived in sorted(namespaces):
        got_id = db.conn.execute(
            "SELECT pglockkit.register_namespace(%s, %s)", (name, None if derived else nid)
        ).fetchone()[0]
        assert got_id == nid, f"register_namespace({name!r}) gave id {got_id}, the file says {nid}"
    for row in FILE_VECTORS:
        cast = "text" if row["resource_type"] == "text" else "bigint"
        try:
            got = str(
                db.conn.execute(
                    f"SELECT pglockkit.lock_key(%s, %s::{cast})", (row["namespace"], _resource(row))
                ).fetchone()[0]
            )
        except psycopg.Error as exc:
            got = exc.sqlstate
        if got != row.get("key", row.get("error")):
            failures.append(f"{_label(row)}: SQL {got}, file {row.get('key', row.get('error'))}")
    assert not failures, "\n".join(failures)


# Text PostgreSQL can store: anything but NUL (and surrogates, which UTF-8 cannot encode).
pg_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=300)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(resource=pg_text | st.text(max_size=5000).filter(lambda s: "\x00" not in s and s.isascii()))
def test_sql_and_python_text_keys_agree(db, resource):
    sql_key, sql_h = db.conn.execute(
        "SELECT pglockkit.lock_key('pglockkit', %s), pglockkit._h47(%s)", (resource, resource)
    ).fetchone()
    assert sql_key == lock_key(namespace_id("pglockkit"), resource)
    assert 0 <= sql_h < 1 << 47


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(resource=st.integers(min_value=0, max_value=(1 << 47) - 1))
def test_sql_and_python_integer_keys_agree(db, resource):
    sql_key = db.conn.execute("SELECT pglockkit.lock_key('pglockkit', %s::bigint)", (resource,)).fetchone()[0]
    assert sql_key == lock_key(namespace_id("pglockkit"), resource)


def test_very_long_resource_agrees(db):
    resource = "é" * 1_000_000  # 2 MB of UTF-8
    sql_key = db.conn.execute("SELECT pglockkit.lock_key('pglockkit', %s)", (resource,)).fetchone()[0]
    assert sql_key == lock_key(namespace_id("pglockkit"), resource)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.from_regex(r"[a-z][a-z0-9_.:-]{0,62}", fullmatch=True))
def test_derived_namespace_ids_agree(db, name):
    assert db.conn.execute("SELECT pglockkit._ns_id_from_name(%s)", (name,)).fetchone()[0] == namespace_id(
        name
    )


def test_decode_key_names_namespace_form_and_bits(db):
    db.conn.execute("SELECT pglockkit.register_namespace('billing', 42)")
    key = lock_key(42, "invoice:7")
    assert db.conn.execute("SELECT * FROM pglockkit.decode_key(%s)", (key,)).fetchone() == (
        42,
        "billing",
        "text",
        key & ((1 << 47) - 1),
    )
    assert db.conn.execute("SELECT * FROM pglockkit.decode_key(%s)", (lock_key(42, 9),)).fetchone() == (
        42,
        "billing",
        "integer",
        9,
    )
    # An id nobody registered, and keys pglockkit never makes.
    assert db.conn.execute(
        "SELECT namespace, form FROM pglockkit.decode_key(%s)", (lock_key(999, 1),)
    ).fetchone() == (None, "integer")
    assert db.conn.execute("SELECT namespace_id, form FROM pglockkit.decode_key(-5)").fetchone() == (
        None,
        "foreign",
    )


def test_decode_key_from_pg_locks_row(db):
    """A held lock, read back from pg_locks by classid/objid, decodes to its namespace."""
    db.conn.execute("SELECT pglockkit.register_namespace('graphs')")
    assert db.conn.execute("SELECT pglockkit.try_lock('graphs', 'restock_plan')").fetchone()[0]
    key = db.conn.execute("SELECT pglockkit.lock_key('graphs', 'restock_plan')").fetchone()[0]
    row = db.conn.execute(
        """SELECT l.classid, l.objid, d.namespace, d.form
             FROM pg_locks l, pglockkit.decode_key(l.classid, l.objid) d
            WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.pid = pg_backend_pid()"""
    ).fetchone()
    assert (row[0], row[1]) == pg_locks_ids(key)
    assert row[2:] == ("graphs", "text")


def test_key_by_namespace_id_matches_the_vectors_without_a_registry(db):
    """pglockkit.key(ns_id, resource), the hot-loop form, is the same formula with no lookup: it
    agrees with the vectors file for ids that are not registered in this database at all."""
    failures = []
    for row in FILE_VECTORS:
        cast = "text" if row["resource_type"] == "text" else "bigint"
        try:
            got = str(
                db.conn.execute(
                    f"SELECT pglockkit.key(%s, %s::{cast})", (row["namespace_id"], _resource(row))
                ).fetchone()[0]
            )
        except psycopg.Error as exc:
            got = exc.sqlstate
        if got != row.get("key", row.get("error")):
            failures.append(f"{_label(row)}: SQL {got}, file {row.get('key', row.get('error'))}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("ns_id", "resource", "sqlstate", "message"),
    [
        ("0", "'x'::text", "22003", "namespace id 0 is out of range"),
        ("32768", "1::bigint", "22003", "namespace id 32768 is out of range"),
        ("NULL::int", "'x'::text", "22004", "namespace id must not be null"),
        ("1", "NULL::text", "22004", "lock resource must not be null"),
        ("1", "NULL::bigint", "22004", "lock resource must not be null"),
        ("1", "-1::bigint", "22003", "integer lock resource -1 is out of range"),
        ("1", "140737488355328::bigint", "22003", "is out of range"),
    ],
)
def test_key_by_namespace_id_rejects_bad_input(db, ns_id, resource, sqlstate, message):
    # As constants (checked when the statement is planned) and as columns (row by row).
    for call in (
        f"SELECT pglockkit.key({ns_id}, {resource})",
        f"SELECT pglockkit.key(a, b) FROM (VALUES ({ns_id}, {resource})) v(a, b)",
    ):
        with pytest.raises(psycopg.Error, match=message) as err:
            db.conn.execute(call)
        assert err.value.sqlstate == sqlstate, call
    # The checks of good rows next to it raise nothing: only the bad row fails.
    kind = resource.split("::")[1]
    good = "'y'::text" if kind == "text" else "7::bigint"
    assert (
        db.conn.execute(
            f"SELECT count(pglockkit.key(a, b)) FROM (VALUES (1, {good}), (2, {good})) v(a, b)"
        ).fetchone()[0]
        == 2
    )


def test_an_integer_id_sent_untyped_locks_the_text_key_and_cast_locks_the_integer_one(db):
    """docs/locks.md: node-postgres, PHP's pg_query_params, Ruby's pg and any libpq client that
    passes no parameter types send every parameter untyped (oid 0), and the server resolves
    ``try_lock('orders', $1)`` to the text overload: the lock of '42', not of the integer 42 that
    a Python worker (psycopg sends an int typed) or psql takes. ``$1::bigint`` locks the same key
    as the typed integer, so the two exclude each other."""
    db.conn.execute("SELECT pglockkit.register_namespace('orders')")
    with db.connect() as python_worker, db.connect() as node_worker:
        assert python_worker.execute("SELECT pglockkit.try_lock('orders', %s)", (42,)).fetchone()[0]

        def untyped(query: bytes) -> bytes:
            res = node_worker.pgconn.exec_params(query, [b"orders", b"42"])  # paramTypes NULL
            assert res.status == psycopg.pq.ExecStatus.TUPLES_OK, res.error_message
            return res.get_value(0, 0)

        assert (
            untyped(b"SELECT pglockkit.lock_key($1, $2)")
            == str(lock_key(namespace_id("orders"), "42")).encode()
        )
        assert untyped(b"SELECT pglockkit.try_lock($1, $2::bigint)") == b"f"  # the Python worker holds it
        assert untyped(b"SELECT pglockkit.try_lock($1, $2)") == b"t"  # '42': another lock


def test_xact_lock_all_with_an_untyped_array_takes_the_cast_docs_locks_md_gives(db):
    """docs/locks.md, "Any client, any language": a driver that sends parameters untyped
    (node-postgres turns a JS array into an array literal, oid 0) cannot call
    ``xact_lock_all('orders', $1)``: text[] and bigint[] are both arrays, so the server cannot
    choose (42725, "is not unique"), text ids included. The section says to cast the array, and
    the cast call locks the same keys as a typed caller's."""
    db.conn.execute("SELECT pglockkit.register_namespace('orders')")
    section = (Path(__file__).resolve().parents[2] / "docs" / "locks.md").read_text()
    section = section.split("## Any client, any language", 1)[1].split("\n## ", 1)[0]
    assert "$2::text[]" in section and "$2::bigint[]" in section
    with db.connect() as node_worker, db.connect() as python_worker:
        node_worker.execute("BEGIN")

        def untyped(query: bytes, ids: bytes) -> psycopg.pq.PGresult:
            return node_worker.pgconn.exec_params(query, [b"orders", ids, b"1s"])

        res = untyped(b"SELECT pglockkit.xact_lock_all($1, $2, $3)", b'{"acct:9","acct:3"}')
        assert res.error_field(psycopg.pq.DiagnosticField.SQLSTATE) == b"42725"
        node_worker.execute("ROLLBACK")
        node_worker.execute("BEGIN")
        for query, ids in [
            (b"SELECT pglockkit.xact_lock_all($1, $2::text[], $3)", b'{"acct:9","acct:3"}'),
            (b"SELECT pglockkit.xact_lock_all($1, $2::bigint[], $3)", b"{9,3}"),
        ]:
            res = untyped(query, ids)
            assert res.status == psycopg.pq.ExecStatus.TUPLES_OK, res.error_message
        for resource in ("acct:9", "acct:3", 9, 3):  # held by the untyped caller, as typed keys
            held = python_worker.execute("SELECT pglockkit.try_xact_lock('orders', %s)", (resource,))
            assert held.fetchone()[0] is False, resource
        node_worker.execute("ROLLBACK")


def test_decode_key_calls_a_namespace_0_key_foreign_and_a_null_key_nothing(db):
    """decode_key's COMMENT: form is 'foreign' for keys pglockkit never makes. It never makes a
    key of namespace id 0 (ids are 1..32767), and that is every key of an application's own
    pg_advisory_lock(42) (0 < key < 2^48); decode_key(42) answered namespace_id 0, form
    'integer', as if pglockkit had locked id 42. A NULL key decoded as form 'integer' too."""
    assert db.conn.execute("SELECT namespace_id, form FROM pglockkit.decode_key(42)").fetchone() == (
        None,
        "foreign",
    )
    assert db.conn.execute("SELECT form FROM pglockkit.decode_key(NULL::bigint)").fetchone() == (None,)
