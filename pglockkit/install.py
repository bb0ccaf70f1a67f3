"""Installing pglockkit: yoyo migrations applied under a lock, status, uninstall, the SQL bundle.

Migration state lives in schema ``pglockkit_migrations`` (yoyo's tables), apart from schema
``pglockkit``, so that an ordinary role with only CREATE on the database can install, and so that
uninstalling leaves nothing behind.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from yoyo import read_migrations
from yoyo.backends import get_backend_class
from yoyo.connections import DatabaseURI

from pglockkit.connection import connect
from pglockkit.keys import lock_key, namespace_id

log = logging.getLogger("pglockkit.install")

MIGRATIONS_SCHEMA = "pglockkit_migrations"
BUNDLE_TABLE = f"{MIGRATIONS_SCHEMA}.bundle"
# Computed locally: the database may not have pglockkit yet.
INSTALL_LOCK_KEY = lock_key(namespace_id("pglockkit"), "install")


def migrations_dir() -> Path:
    """The migrations shipped in the wheel, or the checkout's ``migrations/`` in development."""
    packaged = Path(__file__).parent / "_migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "migrations"


def _migrations():
    return read_migrations(str(migrations_dir()))


def _backend(dsn: str):
    args = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    args["schema"] = MIGRATIONS_SCHEMA
    uri = DatabaseURI("postgresql+psycopg", None, None, None, None, args.pop("dbname", None), args)
    backend = get_backend_class("postgresql+psycopg")(uri, "_yoyo_migration")
    backend.init_database()
    return backend


class _InstallLock:
    """A session advisory lock on a dedicated connection: one installer per database at a time.

    yoyo's own lock is a row that outlives a killed installer; an advisory lock dies with it. While
    this lock is held no other pglockkit installer runs, so a leftover yoyo lock row is stale.
    """

    def __init__(self, dsn: str, timeout_s: float):
        self.dsn = dsn
        self.timeout_s = timeout_s

    def __enter__(self) -> psycopg.Connection:
        self.conn = connect(self.dsn, autocommit=True, application_name="pglockkit install")
        try:
            self.conn.execute(
                "SELECT set_config('lock_timeout', %s, false)", (f"{int(self.timeout_s * 1000)}ms",)
            )
            self.conn.execute("SELECT pg_advisory_lock(%s)", (INSTALL_LOCK_KEY,))
            self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {MIGRATIONS_SCHEMA}")
        except BaseException:
            self.conn.close()
            raise
        return self.conn

    def __exit__(self, *exc) -> None:
        try:
            if not self.conn.closed:
                self.conn.execute("SELECT pg_advisory_unlock(%s)", (INSTALL_LOCK_KEY,))
        finally:
            self.conn.close()


def _adopt_bundle(conn: psycopg.Connection, backend, migrations) -> list[str]:
    """Record migrations that ``sql/pglockkit.sql`` applied, so that upgrades continue from there."""
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (BUNDLE_TABLE,)).fetchone()[0]
    if not exists:
        return []
    ids = {r[0] for r in conn.execute(f"SELECT migration_id FROM {BUNDLE_TABLE}")}
    adopt = [m for m in backend.to_apply(migrations) if m.id in ids]
    if adopt:
        backend.mark_migrations(adopt)
    conn.execute(f"DROP TABLE {BUNDLE_TABLE}")
    return [m.id for m in adopt]


def install(dsn: str = "", *, lock_timeout_s: float = 300.0) -> list[str]:
    """Apply pending migrations; returns the ids applied (empty when already up to date).

    Safe to run from many processes at once: they queue on an advisory lock, the first applies,
    the rest find nothing to do. Re-applies grants at the end, so a ``pglockkit_user`` role created
    after the first install gets its privileges.

    >>> install("postgresql://app@db/app")  # doctest: +SKIP
    ['0001_foundation']
    """
    with _InstallLock(dsn, lock_timeout_s) as conn:
        backend = _backend(dsn)
        try:
            backend.break_lock()
            migrations = _migrations()
            adopted = _adopt_bundle(conn, backend, migrations)
            with backend.lock():
                pending = backend.to_apply(migrations)
                backend.apply_migrations(pending)
            conn.execute("SELECT pglockkit._grant_privileges()")
        finally:
            backend.connection.close()
    applied = [m.id for m in pending]
    for mid in adopted:
        log.info("adopted migration %s applied by sql/pglockkit.sql", mid)
    for mid in applied:
        log.info("applied migration %s", mid)
    return applied


@dataclass(frozen=True)
class MigrationState:
    id: str
    applied: bool


def status(dsn: str = "") -> list[MigrationState]:
    """Every known migration, in order, and whether it is applied to the database."""
    with connect(dsn, autocommit=True) as conn:
        has_schema = conn.execute(
            "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = %s)", (MIGRATIONS_SCHEMA,)
        ).fetchone()[0]
    migrations = _migrations()
    if not has_schema:
        return [MigrationState(m.id, False) for m in migrations]
    backend = _backend(dsn)
    try:
        return [MigrationState(m.id, backend.is_applied(m)) for m in migrations]
    finally:
        backend.connection.close()


ROLES = ("pglockkit_user", "pglockkit_admin")


def grant(dsn: str, role: str, *, admin: bool = False, revoke: bool = False) -> str:
    """Give ``role`` pglockkit's worker role (``pglockkit_user``), or with ``admin`` its operator
    role (``pglockkit_admin``: also registers namespaces, prunes, retries dead jobs, samples);
    ``revoke`` takes it back. Returns what was done.

    Needs a role that may grant the group role (its admin, a CREATEROLE role or a superuser).
    The group roles are created first if missing (then the grants in this database are
    re-applied, which needs the installing role).
    """
    group = "pglockkit_admin" if admin else "pglockkit_user"
    with connect(dsn, autocommit=True) as conn:
        if not conn.execute("SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = %s)", (role,)).fetchone()[0]:
            raise ValueError(f"role {role!r} does not exist; create it first (CREATE ROLE ... LOGIN)")
        if role in ROLES:
            raise ValueError(
                f"{role!r} is one of pglockkit's own group roles; name a worker or operator role"
            )
        missing = [
            r
            for r in ROLES
            if not conn.execute("SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = %s)", (r,)).fetchone()[0]
        ]
        if missing and not revoke:
            with conn.transaction():
                for r in missing:
                    conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(r)))
                conn.execute("GRANT pglockkit_user TO pglockkit_admin")
                conn.execute("SELECT pglockkit._grant_privileges()")
        statement = "REVOKE {} FROM {}" if revoke else "GRANT {} TO {}"
        conn.execute(sql.SQL(statement).format(sql.Identifier(group), sql.Identifier(role)))
    return f"{'revoked' if revoke else 'granted'} {group} {'from' if revoke else 'to'} {role}"


def uninstall(dsn: str = "", *, lock_timeout_s: float = 300.0) -> list[str]:
    """Roll back every applied migration and drop the migration state; returns the ids rolled back.

    Leaves no object of pglockkit's in the database. The cluster-wide role ``pglockkit_user``
    stays (other databases may use it).
    """
    with _InstallLock(dsn, lock_timeout_s) as conn:
        backend = _backend(dsn)
        try:
            backend.break_lock()
            with backend.lock():
                applied = backend.to_rollback(_migrations())
                backend.rollback_migrations(applied)
        finally:
            backend.connection.close()
        # A bundle install has no yoyo records: drop its schema directly.
        conn.execute("DROP SCHEMA IF EXISTS pglockkit CASCADE")
        conn.execute(f"DROP SCHEMA {MIGRATIONS_SCHEMA} CASCADE")
    return [m.id for m in applied]


BUNDLE_HEADER = """\
-- pglockkit single-file install, for psql users: psql -v ON_ERROR_STOP=1 -f sql/pglockkit.sql
-- GENERATED by `pglockkit bundle` from migrations/: do not edit; a test checks it is current.
-- It records what it applied, so a later `pglockkit install` upgrades from here.
"""


def render_bundle() -> str:
    """The text of ``sql/pglockkit.sql``: every migration in order, in one transaction."""
    parts = [BUNDLE_HEADER, "\\set ON_ERROR_STOP on\n", "BEGIN;\n"]
    ids = []
    for m in _migrations():
        ids.append(m.id)
        body = Path(m.path).read_text(encoding="utf-8").rstrip()
        parts.append(f"\n-- ==== migration {m.id} ====\n\n{body}\n")
    values = ", ".join(f"('{i}')" for i in ids)
    parts.append(
        "\n-- ==== bookkeeping for `pglockkit install` ====\n\n"
        f"CREATE SCHEMA IF NOT EXISTS {MIGRATIONS_SCHEMA};\n"
        f"CREATE TABLE {BUNDLE_TABLE} (migration_id text PRIMARY KEY);\n"
        f"INSERT INTO {BUNDLE_TABLE} VALUES {values};\n"
        "\nCOMMIT;\n"
    )
    return "".join(parts)
