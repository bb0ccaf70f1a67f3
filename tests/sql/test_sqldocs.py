"""docs/sql.md is generated from the catalog (every public function and view with its signature
and COMMENT): it must be current on both servers, so the reference cannot drift from the code."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import sqldocs  # noqa: E402 - tools/ is not a package


def test_sql_reference_is_current(db):
    current = sqldocs.TARGET.read_text(encoding="utf-8")
    assert current == sqldocs.render(db.conn), "docs/sql.md is stale: run `python3 tools/sqldocs.py`"


def test_sql_reference_lists_every_public_function_with_its_comment(db):
    text = sqldocs.TARGET.read_text(encoding="utf-8")
    rows = db.conn.execute(
        "SELECT p.proname, obj_description(p.oid, 'pg_proc') FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = 'pglockkit' AND left(p.proname, 1) <> '_'"
    ).fetchall()
    assert len(rows) > 30
    for name, comment in rows:
        assert f"### `{name}`" in text and comment and comment in text, name
