"""A failover performed by pg_auto_failover (Debian's ``postgresql-15-auto-failover`` and
``pg-auto-failover-cli``), the HA manager an operator would run, on PostgreSQL 15.

The test starts a monitor and two data nodes with ``pg_autoctl``, each keeper in a process group
of its own, as the unprivileged test OS user (``pg_ctl_unprivileged.py``). The monitor's health
checks are made faster than its defaults (about 30 s to notice a dead primary), so that it fails
over in a few seconds. Workers connect through the URI ``pg_autoctl show uri`` gives
(``target_session_attrs=read-write`` over both nodes). With two nodes, pg_auto_failover
replicates synchronously (``ANY 1 (...)``): nothing acknowledged is lost.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from pgbouncer import TESTS, free_port
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from scenarios import assert_done_once, stop_workers, worker_proc

import pglockkit
from pglockkit import queue as q

PG_BIN = Path("/usr/lib/postgresql/15/bin")
EXTENSION = Path("/usr/share/postgresql/15/extension/pgautofailover.control")
# The monitor's health checks, in ms: a node unreachable for about 2 s is unhealthy.
FAST_CHECKS = {
    "health_check_period": 500,
    "health_check_timeout": 1000,
    "health_check_max_retries": 1,
    "health_check_retry_delay": 500,
    "node_considered_unhealthy_timeout": 2000,
}


def _os_user() -> str:
    if os.geteuid() == 0:
        return os.environ.get("PGLOCKKIT_TEST_OS_USER", "pglockkit_pg")
    import getpass

    return getpass.getuser()


class Formation:
    """A pg_auto_failover monitor and its data nodes, in one short directory (unix sockets live
    there: their paths must stay under 108 bytes)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pgaf-"))
        self.env = {
            **os.environ,
            "XDG_CONFIG_HOME": str(self.root / "config"),
            "XDG_DATA_HOME": str(self.root / "data"),
            "XDG_RUNTIME_DIR": str(self.root / "run"),
            # pg_autoctl's own knob for the unix socket directory (its test suite's).
            "PG_REGRESS_SOCK_DIR": str(self.root),
        }
        self.keepers: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.user = _os_user()

    def _command(self, *args: str) -> list[str]:
        return [sys.executable, str(TESTS / "pg_ctl_unprivileged.py"), shutil.which("pg_autoctl"), *args]

    def autoctl(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            self._command(*args), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"pg_autoctl {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def _keeper(self, name: str, *args: str) -> None:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 (closed with the formation)
        self.keepers[name] = subprocess.Popen(
            self._command(*args), env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_monitor(self) -> None:
        self.ports["monitor"] = free_port()
        self.autoctl(
            "create", "monitor", "--pgdata", str(self.root / "monitor"),
            "--pgport", str(self.ports["monitor"]), "--hostname", "127.0.0.1", "--auth", "trust",
            "--no-ssl", "--pgctl", str(PG_BIN / "pg_ctl"),
        )  # fmt: skip
        self._keeper("monitor", "run", "--pgdata", str(self.root / "monitor"))
        self._wait(lambda: self.monitor_sql("SELECT 1"), "the monitor to accept connections")
        for setting, value in FAST_CHECKS.items():
            self.monitor_sql(f"ALTER SYSTEM SET pgautofailover.{setting} = {value}")
        self.monitor_sql("SELECT pg_reload_conf()")

    def monitor_sql(self, sql: str) -> list[tuple]:
        dsn = make_conninfo(
            host="127.0.0.1",
            port=self.ports["monitor"],
            user=self.user,
            dbname="pg_auto_failover",
            connect_timeout=3,
        )
        with psycopg.connect(dsn, autocommit=True) as conn:
            cur = conn.execute(sql)
            return cur.fetchall() if cur.description else []

    def add_node(self, name: str) -> None:
        self.ports[name] = free_port()
        monitor = (
            f"postgres://autoctl_node@127.0.0.1:{self.ports['monitor']}/pg_auto_failover?sslmode=disable"
        )
        self._keeper(
            name,
            "create", "postgres", "--pgdata", str(self.root / name), "--pghost", str(self.root),
            "--pgport", str(self.ports[name]), "--hostname", "127.0.0.1", "--name", name, "--auth", "trust",
            "--no-ssl", "--monitor", monitor, "--pgctl", str(PG_BIN / "pg_ctl"), "--run",
        )  # fmt: skip

    def states(self) -> dict[str, tuple[str, str]]:
        """Each node's (reported, assigned) state, as the monitor has them."""
        return {
            n: (r, g)
            for n, r, g in self.monitor_sql(
                "SELECT nodename, reportedstate, goalstate FROM pgautofailover.node"
            )
        }

    def wait_for_states(self, wanted: dict[str, str], timeout: float = 120) -> None:
        self._wait(
            lambda: all(self.states().get(n) == (s, s) for n, s in wanted.items()),
            f"the formation to reach {wanted}",
            timeout,
        )

    def uri(self) -> str:
        """The formation's URI, as ``pg_autoctl show uri`` gives it to applications (as the test
        OS user, who owns the nodes)."""
        shown = self.autoctl(
            "show", "uri", "--pgdata", str(self.root / "monitor"), "--formation", "default"
        ).strip()
        return make_conninfo(shown, user=self.user, connect_timeout="3")

    def crash(self, name: str) -> None:
        """SIGKILL a node's keeper and its PostgreSQL (postmaster and backends): the host is gone."""
        self._kill([name])

    def _kill(self, names: list[str]) -> None:
        """SIGKILL the keepers of ``names`` and their servers: each server's processes are found
        first, since killing a keeper's process group kills the postmaster it started and leaves
        its children to init (not all of them end with it: the monitor's health check worker
        outlives it)."""
        pids = [pid for name in names for pid in _server_pids(self.root / name)]
        for name in names:  # first, so that none starts its server again
            if name in self.keepers:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.keepers[name].pid, signal.SIGKILL)
                self.keepers[name].wait(10)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for name in names:  # its pid may be another process's by the next look
            (self.root / name / "postmaster.pid").unlink(missing_ok=True)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def stop(self) -> None:
        self._kill(sorted({"monitor", *self.keepers}))
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _wait(check, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except psycopg.OperationalError:
                pass
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)


def _server_pids(pgdata: Path) -> list[int]:
    """The postmaster of ``pgdata``, if it runs, and its children."""
    try:
        postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True).stdout.split()
    return [postmaster, *map(int, children)]


@pytest.fixture
def formation():
    missing = [p for p in (shutil.which("pg_autoctl"), EXTENSION) if not p or not Path(p).exists()]
    if missing:
        pytest.fail(
            "pg_auto_failover is not installed (pg_autoctl and the pgautofailover extension for PostgreSQL "
            "15): scripts/test installs Debian's pg-auto-failover-cli and postgresql-15-auto-failover"
        )
    f = Formation()
    try:
        f.start_monitor()
        f.add_node("a")
        f.wait_for_states({"a": "single"})
        f.add_node("b")
        f.wait_for_states({"a": "primary", "b": "secondary"})
        yield f
    except BaseException:
        for name in ("monitor", "a", "b"):
            print(f"--- {name} ---\n{f.log(name)}")
        raise
    finally:
        f.stop()


@pytest.mark.slow
def test_workers_go_on_through_a_failover_performed_by_pg_auto_failover(formation):
    """Two worker processes drain 2,000 jobs through the formation's URI; the primary's host dies
    (keeper and PostgreSQL SIGKILLed); pg_auto_failover promotes the secondary. Every job is done
    once, with its handler's row, on the new primary, and the workers get there by themselves. A
    lease token after the failover carries the new timeline."""
    total = 2000
    uri = formation.uri()
    assert conninfo_to_dict(uri)["target_session_attrs"] == "read-write"
    pglockkit.install(uri)
    with psycopg.connect(uri, autocommit=True) as conn:
        conn.execute("CREATE TABLE done_log (job_id bigint, token bigint, pid int)")
        q.enqueue_many(conn, "w", [{"sleep": 0.002}] * total)
        assert conn.execute("SELECT current_setting('synchronous_standby_names')").fetchone()[0] != ""
        before = pglockkit.acquire_lease(conn, "nightly", "pod-a", 3600)
    workers = [worker_proc(uri, "--batch", "5", "--lease", "2s", "--poll", "0.2") for _ in range(2)]
    try:
        with psycopg.connect(uri, autocommit=True) as conn:
            deadline = time.monotonic() + 60
            while conn.execute("SELECT count(*) FROM done_log").fetchone()[0] < total * 3 // 10:
                assert time.monotonic() < deadline, "the workers did not start draining"
                time.sleep(0.02)
        formation.crash("a")
        formation.wait_for_states({"b": "wait_primary"}, timeout=90)

        with psycopg.connect(uri, autocommit=True) as conn:
            assert conn.info.port == formation.ports["b"]
            deadline = time.monotonic() + 90
            while conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE status <> 'done'").fetchone()[0]:
                assert time.monotonic() < deadline, "the queue was not drained on the new primary"
                assert all(w.poll() is None for w in workers), "a worker exited instead of following"
                time.sleep(0.1)
            assert_done_once(conn, total)
            # The lease survived (synchronous), its holder keeps its token; a new name's token is on
            # the new timeline, above every token of the old one.
            assert pglockkit.acquire_lease(conn, "nightly", "pod-a", 3600) == before
            after = pglockkit.acquire_lease(conn, "other", "pod-b", 3600)
            assert after >> 47 >= 1 and after > before
    finally:
        outputs = stop_workers(workers)
    for code, err in outputs:
        assert code == 0, err[-3000:]
        assert "connection lost" in err and "reconnecting in" in err, err[-3000:]
