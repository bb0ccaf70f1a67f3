"""The psql walkthrough (sql/examples/walkthrough.sql) gives exactly sql/examples/walkthrough.out.

It runs with the server's own psql (psql 15 against PostgreSQL 15, psql 18 against 18), with
stderr merged into stdout as pg_regress does, so an error, a notice or a changed result shows up as
a diff. After an intended change, regenerate the expected output from the repository root against
a fresh database with pglockkit installed:

    psql -X -q -v ON_ERROR_STOP=1 -f sql/examples/walkthrough.sql -d "$DSN" \
        > sql/examples/walkthrough.out 2>&1
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "sql/examples/walkthrough.sql"  # relative: psql prints it in error lines
EXPECTED = ROOT / "sql" / "examples" / "walkthrough.out"


def _psql(bindir: Path) -> str:
    own = bindir / "psql"
    if own.exists():
        return str(own)
    found = shutil.which("psql")
    if found is None:
        pytest.fail(f"no psql in {bindir} nor on PATH: install postgresql-client")
    return found


def test_walkthrough_output_is_exactly_the_expected_file(db):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PSQL"))}
    env.update(LC_ALL="C", PGCLIENTENCODING="UTF8")
    proc = subprocess.run(
        [_psql(db.server.bindir), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", SCRIPT, "-d", db.dsn],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    expected = EXPECTED.read_text()
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            proc.stdout.splitlines(keepends=True),
            fromfile="sql/examples/walkthrough.out",
            tofile=f"psql output on PostgreSQL {db.server.version}",
        )
    )
    assert proc.returncode == 0, f"psql exited {proc.returncode}:\n{proc.stdout}"
    assert proc.stdout == expected, f"walkthrough output differs:\n{diff}"
    # The one intended error is the stale fencing token, and the walkthrough went on to the end.
    assert proc.stdout.count("ERROR:") == 1 and "ERROR:  PK001" in proc.stdout
    assert proc.stdout.rstrip().endswith("(1 row)")
