"""Lock keys: the SQL and Python implementations agree bit for bit, on the documented examples
and on arbitrary unicode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pglockkit import lock_key, namespace_id
from pglockkit.keys import pg_locks_ids

# (namespace id, resource, key): the examples fixed in DESIGN.md and docs/locks.md.
VECTORS = [
    (1, "restock_plan", 458487468674308),
    (7301, "tenant:42", 2055230974443318157),
    (2, "", 828861615000702),
    (3, 42, 844424930132010),
]


@pytest.mark.parametrize(("ns_id", "resource", "key"), VECTORS)
def test_python_key_matches_documented_vectors(ns_id, resource, key):
    assert lock_key(ns_id, resource) == key


@pytest.mark.parametrize(("ns_id", "resource", "key"), VECTORS)
def test_sql_key_matches_documented_vectors(db, ns_id, resource, key):
    db.conn.execute("SELECT pglockkit.register_namespace(%s, %s)", (f"ns{ns_id}", ns_id))
    assert db.conn.execute("SELECT pglockkit.lock_key(%s, %s)", (f"ns{ns_id}", resource)).fetchone()[0] == key


def test_python_rejects_what_sql_rejects():
    with pytest.raises(ValueError, match="out of range"):
        lock_key(3, -1)
    with pytest.raises(ValueError, match="out of range"):
        lock_key(3, 1 << 47)
    with pytest.raises(ValueError, match="namespace id"):
        lock_key(0, "x")
    with pytest.raises(ValueError, match="NUL"):
        lock_key(1, "a\x00b")
    with pytest.raises(TypeError):
        lock_key(1, 1.5)  # type: ignore[arg-type]


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
