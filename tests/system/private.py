"""A PostgreSQL server of a test's own (``PrivateServer``): stopped, restarted and frozen
without touching the session's shared ones; the ``private_server`` fixture is in conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

import pglockkit


class PrivateServer:
    """A server of the same version as ``server``, started for one test only (its own data
    directory and port): a test may stop it, restart it or freeze its backends."""

    OPTIONS = "-c fsync=off -c synchronous_commit=off -c max_connections=60 -c listen_addresses=127.0.0.1"

    def __init__(self, bindir, base):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = base
        self.datadir = base / "data"
        self._pg_ctl = [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "pg_ctl_unprivileged.py"),
            str(bindir / "pg_ctl"),
        ]
        self.pg_ctl("initdb", "-o", "-U postgres -A trust")
        self.start()
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE app")
        pglockkit.install(self.dsn())

    def dsn(self, dbname: str = "app") -> str:
        return make_conninfo(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname)

    def pg_ctl(self, *args: str) -> None:
        subprocess.run(
            [*self._pg_ctl, *args, "-D", str(self.datadir)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )

    def start(self) -> None:
        self.pg_ctl(
            "start", "-w", "-l", str(self.base / "log"),
            "-o", f"-p {self.port} -k {self.base} {self.OPTIONS}",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("stop", "-w", "-m", mode)

    def stop_worker_frozen(
        self, worker, runner, watch, terminate: str, settle: float, within: float
    ) -> tuple[bool, float]:
        """Freeze the server (SIGSTOP to the postmaster: connects hang, open connections work
        on), end the worker's pool connections (``terminate``, run on ``watch``), wait ``settle``
        seconds, then ``worker.stop()``: whether ``runner`` (the thread in ``run``) was still
        alive ``within`` seconds later, and how long it took. The server is thawed, and the
        runner waited for, in any case."""
        postmaster = int((self.datadir / "postmaster.pid").read_text().split()[0])
        os.kill(postmaster, signal.SIGSTOP)
        try:
            watch.execute(terminate)
            time.sleep(settle)
            t0 = time.monotonic()
            worker.stop()
            runner.join(within)
            return runner.is_alive(), time.monotonic() - t0
        finally:
            os.kill(postmaster, signal.SIGCONT)
            runner.join(150)


def wait_for(what: str, check, timeout: float) -> float:
    """Seconds until ``check()`` is true; fails after ``timeout``."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0
