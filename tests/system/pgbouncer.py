"""A real PgBouncer in front of a test server, for tests that prove behaviour through a pooler.

``PgBouncer(target_dsn, pool_mode=...)`` writes a config into a temp dir, starts Debian's
``pgbouncer`` on a free loopback port (as root, as the unprivileged test OS user, through
``pg_ctl_unprivileged.py``: pgbouncer refuses to run as root), waits until it accepts
connections, and stops it with SIGTERM. A missing pgbouncer is an error, never a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pg_ctl_unprivileged
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

TESTS = Path(__file__).resolve().parents[1]  # tests/: pg_ctl_unprivileged.py
EXECUTABLE = os.environ.get("PGLOCKKIT_PGBOUNCER", "/usr/sbin/pgbouncer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgBouncer:
    """One pgbouncer process; ``dsn()`` reaches the target database through it."""

    def __init__(
        self,
        target_dsn: str,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 4,
        **settings: str | int,
    ):
        if not Path(EXECUTABLE).is_file():
            raise FileNotFoundError(f"pgbouncer not found at {EXECUTABLE} (apt-get install pgbouncer)")
        target = conninfo_to_dict(target_dsn)
        self.user = target["user"]
        self.dbname = target["dbname"]
        self.pool_mode = pool_mode
        self.dir = Path(tempfile.mkdtemp(prefix="pglockkit-pgbouncer-"))
        self.port = free_port()
        self.log_path = self.dir / "pgbouncer.log"
        config = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": self.dir / "users.txt",
            "admin_users": self.user,
            "pool_mode": pool_mode,
            "default_pool_size": pool_size,
            "min_pool_size": 0,
            "reserve_pool_size": 0,
            "max_client_conn": 200,
            "pidfile": self.dir / "pgbouncer.pid",
            **settings,
        }
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        lines = [
            "[databases]",
            f"{self.dbname} = host={target['host']} port={target['port']} dbname={self.dbname}",
            "[pgbouncer]",
            *(f"{k} = {v}" for k, v in config.items()),
        ]
        self.ini = self.dir / "pgbouncer.ini"
        self.ini.write_text("\n".join(lines) + "\n")
        command = [EXECUTABLE, str(self.ini)]
        if os.geteuid() == 0:
            pw = pg_ctl_unprivileged._user()
            for path in self.dir.iterdir():
                os.chown(path, pw.pw_uid, pw.pw_gid)
            pg_ctl_unprivileged._hand_over(self.dir, pw)
            command = [sys.executable, str(TESTS / "pg_ctl_unprivileged.py"), *command]
        with open(self.log_path, "wb") as log:  # pgbouncer logs to stderr in the foreground
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        self._wait_ready()

    def dsn(self, **extra: object) -> str:
        return make_conninfo(host="127.0.0.1", port=self.port, user=self.user, dbname=self.dbname, **extra)

    def connect(self, **kwargs: object) -> psycopg.Connection:
        """A client connection through the pooler. Prepared statements off: PgBouncer 1.18 cannot
        route them in transaction mode (psycopg prepares a query after its 5th run)."""
        kwargs.setdefault("autocommit", True)
        kwargs.setdefault("prepare_threshold", None)
        return psycopg.connect(self.dsn(), **kwargs)

    def admin(self, command: str) -> list[tuple]:
        """Run a console command (``SHOW POOLS``, ``SHOW CONFIG``...) on pgbouncer's admin DB."""
        dsn = make_conninfo(self.dsn(), dbname="pgbouncer")
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
            cur = conn.cursor()
            cur.execute(command, prepare=False)
            return cur.fetchall()

    def clients(self) -> int:
        """Client connections to the target database (the admin console's own not counted)."""
        return sum(1 for row in self.admin("SHOW CLIENTS") if row[2] == self.dbname)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not accept connections: {exc}\n{self.log()}") from exc
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
