"""A real primary and a real streaming standby, for the failover tests.

``Node.primary(bindir, workdir)`` runs ``initdb`` and starts a server on a free loopback port;
``primary.standby(workdir)`` makes a standby of it with ``pg_basebackup -R`` (streaming, a
replication slot so that it can be stopped and catch up later) and starts it. ``kill()`` SIGKILLs a
server's postmaster and its backends (a crash: no shutdown checkpoint), ``promote()`` ends a
standby's recovery. As root, every binary runs as the unprivileged test OS user through
``pg_ctl_unprivileged.py`` (``initdb`` and ``postgres`` refuse root). Servers are TCP only, on
127.0.0.1, with trust authentication. A node left running is stopped by ``stop()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from pgbouncer import TESTS, free_port
from psycopg.conninfo import make_conninfo

SETTINGS = (
    "-c listen_addresses=127.0.0.1 -c unix_socket_directories= -c fsync=off -c full_page_writes=off"
    " -c max_connections=100 -c max_wal_senders=4 -c max_replication_slots=4 -c wal_keep_size=256MB"
)


def _run(bindir: Path, program: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``program`` from ``bindir``, as the unprivileged user when root (``-D`` is handed to it)."""
    real = str(bindir / program)
    command = [sys.executable, str(TESTS / "pg_ctl_unprivileged.py"), real, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{program} {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done


class Node:
    """One server: its data directory, port and log."""

    def __init__(self, bindir: Path, datadir: Path, port: int, name: str):
        self.bindir, self.datadir, self.port, self.name = bindir, datadir, port, name
        self.log = datadir.parent / f"{name}.log"

    @classmethod
    def primary(cls, bindir: Path, workdir: Path, settings: str = "") -> Node:
        node = cls(bindir, workdir / "primary", free_port(), "primary")
        _run(bindir, "pg_ctl", "initdb", "-D", str(node.datadir), "-o", "-A trust -U postgres --no-sync")
        node.start(settings)
        return node

    def standby(self, workdir: Path, name: str = "standby", settings: str = "") -> Node:
        """A streaming standby of this primary, caught up and running, on a slot of its own."""
        with self.connect() as conn:
            conn.execute("SELECT pg_create_physical_replication_slot(%s)", (name,))
        node = Node(self.bindir, workdir / name, free_port(), name)
        _run(
            self.bindir,
            "pg_basebackup",
            "-D", str(node.datadir), "-R", "-X", "stream", "-S", name, "--no-sync", "-c", "fast",
            "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
        )  # fmt: skip
        node.start(f"-c primary_slot_name={name} {settings}")
        return node

    def dsn(self, dbname: str = "postgres", **extra: str) -> str:
        return make_conninfo(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, **extra)

    def connect(self, dbname: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(self.dsn(dbname), autocommit=True, connect_timeout=5)

    def start(self, settings: str = "") -> None:
        self.settings = settings or getattr(self, "settings", "")
        _run(
            self.bindir,
            "pg_ctl", "start", "-w", "-t", "60", "-D", str(self.datadir), "-l", str(self.log),
            "-o", f"-p {self.port} {SETTINGS} {self.settings}",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        if (self.datadir / "postmaster.pid").exists():
            _run(self.bindir, "pg_ctl", "stop", "-w", "-m", mode, "-D", str(self.datadir))

    def kill(self) -> None:
        """SIGKILL the postmaster and every process of the server: a crash, as a host loses power."""
        pid = int((self.datadir / "postmaster.pid").read_text().split()[0])
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        for p in [pid, *map(int, children)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pid):
            assert time.monotonic() < deadline, "the killed postmaster did not go"
            time.sleep(0.05)
        (self.datadir / "postmaster.pid").unlink(missing_ok=True)

    def promote(self) -> None:
        _run(self.bindir, "pg_ctl", "promote", "-w", "-t", "60", "-D", str(self.datadir))
        deadline = time.monotonic() + 30
        while True:
            with self.connect() as conn:
                if not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
                    return
            assert time.monotonic() < deadline, "the standby did not leave recovery"
            time.sleep(0.05)

    def wait_caught_up(self, standby: Node, timeout: float = 30) -> None:
        """Until ``standby`` has replayed everything this primary has written so far."""
        with self.connect() as conn:
            target = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        deadline = time.monotonic() + timeout
        with standby.connect() as conn:
            while not conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)).fetchone()[0]:
                assert time.monotonic() < deadline, f"{standby.name} did not catch up"
                time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by its parent, pg_ctl long gone) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
