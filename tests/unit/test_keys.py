"""Lock keys computed in Python, without a server: the documented examples and the inputs SQL
refuses. That SQL computes the same keys is tests/sql/test_sql_keys.py."""

from __future__ import annotations

import pytest

from pglockkit import lock_key

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
