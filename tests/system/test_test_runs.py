"""The test suite itself: a second pytest session, started while this one runs (a developer's one
test in a second terminal, a short run beside the full one), leaves this session's servers
alone."""

from __future__ import annotations

import getpass
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

SECOND_SESSION = """
def test_uses_pytests_own_temp_directory(tmp_path):
    assert tmp_path.exists()
"""


def test_a_second_pytest_session_started_mid_run_leaves_this_runs_servers_reachable(server, tmp_path):
    """As root, the servers run as an unprivileged OS user under pytest's base temp directory.
    It was ``pytest-of-USER``, and every new pytest session of the same user sets that back to
    mode 700: the servers lost their data directories, and the next checkpoint PANICked
    (``could not open file ".../global/pg_control": Permission denied``). The suite's sessions
    now each have a base directory of their own, outside it."""
    temproot = Path(tempfile.gettempdir()).resolve()
    assert not tmp_path.resolve().is_relative_to(temproot / f"pytest-of-{_user()}"), tmp_path
    with tempfile.TemporaryDirectory() as elsewhere:  # no conftest of ours: pytest's defaults
        (Path(elsewhere) / "test_second.py").write_text(SECOND_SESSION)
        second = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", elsewhere],
            cwd=elsewhere,
            env={k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PGLOCKKIT_"))},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert second.returncode == 0, second.stdout + second.stderr
    shared = temproot / f"pytest-of-{_user()}"
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700  # what the second session did to it
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("CHECKPOINT")  # reads and writes global/pg_control
        conn.execute("CREATE TABLE after_second_session (n int)")  # a new relation file
        conn.execute("INSERT INTO after_second_session VALUES (1)")
        conn.execute("CHECKPOINT")
        assert conn.execute("SELECT count(*) FROM after_second_session").fetchone() == (1,)
        conn.execute("DROP TABLE after_second_session")
    with psycopg.connect(server.dsn(), autocommit=True) as conn:  # and new sessions still start
        assert conn.execute("SELECT 1").fetchone() == (1,)


def _user() -> str:
    return getpass.getuser()
