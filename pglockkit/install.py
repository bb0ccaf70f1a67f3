"""Installing pglockkit: a fresh install, upgrades by yoyo migrations, status, uninstall, the
SQL bundle.

A fresh install runs the schema of ``sql/schema/`` (the current definition of every object, one
file per domain) in one transaction and records every migration as applied: the baseline and
the deltas after it are already in that schema. A database installed earlier gets the delta
migrations it lacks. A test checks that both ways build the same schema.

Migration state lives in schema ``pglockkit_migrations`` (yoyo's tables), apart from schema
``pglockkit``, so that an ordinary role with only CREATE on the database can install, and so that
uninstalling leaves nothing behind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from yoyo import read_migrations
from yoyo.backends import get_backend_class
from yoyo.connections import DatabaseURI

from pglockkit.connection import connect
from pglockkit.errors import DependentObjects, LockTimeout, NotOwner, PreReleaseInstall
from pglockkit.keys import lock_key, namespace_id
from pglockkit.retry import RECONNECT_BASE, backoff

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


def schema_dir() -> Path:
    """The schema files shipped in the wheel, or the checkout's ``sql/schema/`` in development."""
    packaged = Path(__file__).parent / "_schema"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "sql" / "schema"


def _migrations():
    return read_migrations(str(migrations_dir()))


def render_schema() -> str:
    """Every object's current definition: the domain files of ``sql/schema/`` in order."""
    paths = sorted(schema_dir().glob("*.sql"))
    if not paths:
        raise FileNotFoundError(f"no schema files in {schema_dir()}: a broken checkout or package")
    parts = []
    for path in paths:
        text = path.read_text(encoding="utf-8").rstrip()
        parts.append(f"\n-- ==== sql/schema/{path.name} ====\n\n{text}\n")
    return "".join(parts)


def _bookkeeping(ids: list[str]) -> str:
    """What a schema install records, so that ``install`` later applies only newer migrations."""
    values = ", ".join(f"('{i}')" for i in ids)
    return (
        "\n-- ==== bookkeeping for `pglockkit install` ====\n\n"
        f"CREATE SCHEMA IF NOT EXISTS {MIGRATIONS_SCHEMA};\n"
        f"CREATE TABLE {BUNDLE_TABLE} (migration_id text PRIMARY KEY);\n"
        f"INSERT INTO {BUNDLE_TABLE} VALUES {values};\n"
    )


# How long one statement of a migration waits for a lock (the migration is then rolled back and
# tried again after a pause): a migration waiting for a table that a long transaction uses (a job
# handler's) queues every later user of that table behind it, claims of every queue included.
MIGRATION_LOCK_WAIT_MS = 500


class _MigrationBackend(get_backend_class("postgresql+psycopg")):
    """yoyo's psycopg backend, with ``MIGRATION_LOCK_WAIT_MS`` on every connection it makes: it
    applies each migration on a connection of its own. (Not an ``options`` connection parameter:
    that would replace PGOPTIONS and a service file's options, which the install honours.)"""

    def init_connection(self, connection) -> None:
        super().init_connection(connection)
        connection.execute(f"SET lock_timeout = {MIGRATION_LOCK_WAIT_MS}")
        _act_as_owner(connection)


def _backend(dsn: str):
    args = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    args["schema"] = MIGRATIONS_SCHEMA
    uri = DatabaseURI("postgresql+psycopg", None, None, None, None, args.pop("dbname", None), args)
    backend = _MigrationBackend(uri, "_yoyo_migration")
    backend.init_database()
    return backend


class _InstallLock:
    """A session advisory lock on a dedicated connection: one installer per database at a time.

    yoyo's own lock is a row that outlives a killed installer; an advisory lock dies with it. While
    this lock is held no other pglockkit installer runs, so a leftover yoyo lock row is stale.
    """

    def __init__(self, dsn: str, timeout_s: float, *, create_schema: bool = True, verb: str = "install"):
        self.dsn = dsn
        self.timeout_s = timeout_s
        self.create_schema = create_schema  # uninstall: not on a database that never had it
        self.verb = verb

    def __enter__(self) -> psycopg.Connection:
        self.conn = connect(self.dsn, autocommit=True, application_name="pglockkit install")
        try:
            # A role that does not own the kit (a worker's app role, on pods that all run install)
            # is refused with the owner's name, before it waits for the lock or creates anything.
            _require_owner(self.conn, self.verb)
            self.conn.execute(
                "SELECT set_config('lock_timeout', %s, false)", (f"{int(self.timeout_s * 1000)}ms",)
            )
            self.conn.execute("SELECT pg_advisory_lock(%s)", (INSTALL_LOCK_KEY,))
            _require_owner(self.conn, self.verb)  # another role may have installed it meanwhile
            if self.create_schema:
                self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {MIGRATIONS_SCHEMA}")
            _act_as_owner(self.conn)
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


def _kit_owner(conn: psycopg.Connection) -> str | None:
    """The role that owns schema pglockkit if the current role is neither it nor a member with its
    privileges that may also become it (SET ROLE, which install does: a superuser may); None
    otherwise, and when the kit is not installed."""
    # PostgreSQL 16 grants membership with a SET option of its own: without it, no SET ROLE.
    may_set = " AND pg_catalog.pg_has_role(n.nspowner, 'SET')" if conn.info.server_version >= 160000 else ""
    row = conn.execute(
        "SELECT n.nspowner::pg_catalog.regrole::text, pg_catalog.pg_has_role(n.nspowner, 'USAGE')"
        + may_set
        + "  FROM pg_catalog.pg_namespace n WHERE n.nspname = 'pglockkit'"
    ).fetchone()
    return None if row is None or row[1] else row[0]


def _not_owner(owner: str, verb: str, conn: psycopg.Connection) -> NotOwner:
    return NotOwner(
        f"{verb} must run as {owner} (the role that owns schema pglockkit), not as {conn.info.user}",
        hint=f"connect as {owner}, or a member of it that may SET ROLE to it, to run `pglockkit {verb}`; "
        "workers need pglockkit_user only (`pglockkit grant ROLE`), not install",
    )


def _require_owner(conn: psycopg.Connection, verb: str) -> None:
    """``NotOwner`` (42501, naming the owner) unless the current role may change schema pglockkit.
    Without this, a worker's role running ``install`` on an installed database failed with
    "permission denied for database ..." on the migration schema, which named nobody."""
    owner = _kit_owner(conn)
    if owner is not None:
        raise _not_owner(owner, verb, conn)


def _act_as_owner(conn: psycopg.Connection) -> None:
    """Once the kit exists, run as the role that owns it (``SET ROLE``) when that is another: a
    superuser or a member of the owner's role may install and upgrade, but what a migration
    creates (a table, a function) would be theirs, and the kit's SECURITY DEFINER functions, which
    run as the owner, could not use it (0017's lock_sightings: sample() failed with 42501)."""
    row = conn.execute(
        "SELECT n.nspowner::pg_catalog.regrole::text FROM pg_catalog.pg_namespace n"
        " WHERE n.nspname = 'pglockkit' AND n.nspowner <> (SELECT r.oid FROM pg_catalog.pg_roles r"
        "  WHERE r.rolname = current_user)"
    ).fetchone()
    if row is None:
        return
    # What an earlier upgrade by this role left its own (install did not SET ROLE before 0017)
    # goes to the owner first, while this role still may give it away: else the owner's grants
    # fail on it (42501), and its SECURITY DEFINER functions cannot use it.
    for (statement,) in conn.execute(_GIVE_TO_OWNER, (row[0],)).fetchall():
        conn.execute(statement)
    conn.execute(f"SET ROLE {row[0]}")  # regrole's text is the name quoted as needed


# ALTER ... OWNER TO the kit's owner for each object of the kit's schemas that another role owns
# and the current role may give away (its own, or any for a superuser). Indexes, sequences owned
# by a column and a table's row type follow their table.
_GIVE_TO_OWNER = """
SELECT pg_catalog.format('ALTER %%s %%s OWNER TO %%s', o.kind, o.name, %s::text)
  FROM (SELECT CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                              WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END AS kind,
               c.oid::pg_catalog.regclass::text AS name, c.relowner AS owner, c.relnamespace AS nsp
          FROM pg_catalog.pg_class c
         WHERE c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
           AND NOT (c.relkind = 'S' AND EXISTS (
                   SELECT FROM pg_catalog.pg_depend d
                    WHERE d.objid = c.oid AND d.deptype IN ('a', 'i')
                      AND d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass))
        UNION ALL
        SELECT CASE p.prokind WHEN 'p' THEN 'PROCEDURE' WHEN 'a' THEN 'AGGREGATE' ELSE 'FUNCTION' END,
               p.oid::pg_catalog.regprocedure::text, p.proowner, p.pronamespace
          FROM pg_catalog.pg_proc p
        UNION ALL
        SELECT CASE t.typtype WHEN 'd' THEN 'DOMAIN' ELSE 'TYPE' END,
               t.oid::pg_catalog.regtype::text, t.typowner, t.typnamespace
          FROM pg_catalog.pg_type t
         WHERE t.typtype IN ('c', 'e', 'd', 'r')
           AND (t.typrelid = 0
                OR (SELECT c.relkind FROM pg_catalog.pg_class c WHERE c.oid = t.typrelid) = 'c')
       ) o
  JOIN pg_catalog.pg_namespace n ON n.oid = o.nsp AND n.nspname IN ('pglockkit', 'pglockkit_migrations')
 WHERE o.owner <> n.nspowner AND pg_catalog.pg_has_role(o.owner, 'USAGE')
 ORDER BY 1
"""


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
    """Install the current schema into a database without pglockkit, or apply the migrations a
    database installed earlier lacks; returns the ids of the migrations now recorded (empty when
    already up to date).

    Safe to run from many processes at once: they queue on an advisory lock, the first applies,
    the rest find nothing to do. Re-applies grants at the end, so a ``pglockkit_user`` role created
    after the first install gets its privileges. A migration that waits for a lock held by
    another transaction is tried again until ``lock_timeout_s``, then ``LockTimeout`` (55P03).

    >>> install("postgresql://app@db/app")  # doctest: +SKIP
    ['0001_baseline', ...]
    >>> install("postgresql://app@db/app")  # doctest: +SKIP
    []
    """
    with _InstallLock(dsn, lock_timeout_s) as conn:
        backend = _backend(dsn)
        try:
            backend.break_lock()
            migrations = _migrations()
            _refuse_unknown_migrations(conn, migrations)
            fresh = (
                not _applied_migrations(conn)
                and not conn.execute(
                    "SELECT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = 'pglockkit')"
                ).fetchone()[0]
            )
            if fresh:  # the current schema, and the record that every migration is in it: one commit
                with conn.transaction():
                    conn.execute(render_schema() + _bookkeeping([m.id for m in migrations]))
            adopted = _adopt_bundle(conn, backend, migrations)
            pending = _apply_waiting_briefly(backend, migrations, lock_timeout_s)
            conn.execute("SELECT pglockkit._grant_privileges()")
        finally:
            backend.connection.close()
    applied = [m.id for m in pending]
    if fresh:
        log.info("installed the schema (migrations %s)", ", ".join(adopted))
        return adopted
    for mid in adopted:
        log.info("adopted migration %s applied by sql/pglockkit.sql", mid)
    for mid in applied:
        log.info("applied migration %s", mid)
    return applied


def _apply_waiting_briefly(backend, migrations, timeout_s: float) -> list:
    """Apply what is pending; returns it. A migration whose statement waited its lock out
    (``MIGRATION_LOCK_WAIT_MS``) was rolled back whole; it is tried again after a pause
    (``retry.backoff``), for ``timeout_s`` in all, then ``LockTimeout``."""
    deadline, pending, attempt = time.monotonic() + timeout_s, None, 0
    while True:
        try:
            with backend.lock():
                left = backend.to_apply(migrations)
                pending = left if pending is None else pending
                backend.apply_migrations(left)
            return pending
        except psycopg.errors.LockNotAvailable as exc:
            waiting, pause = backend.to_apply(migrations), backoff(attempt, base=RECONNECT_BASE)
            attempt += 1
            if time.monotonic() + pause > deadline:
                raise LockTimeout(
                    f"migration {waiting[0].id if waiting else '?'} could not take a lock it needs: "
                    f"another transaction held it for the {timeout_s:g} s the install waits "
                    "(lock_timeout_s); that migration and the ones after it were not applied",
                    hint="A long transaction on pglockkit's tables holds it (a job handler's, or a "
                    "session idle in transaction: SELECT * FROM pglockkit.lock_waits). Run install "
                    "again once it has ended, or with a longer lock timeout.",
                ) from exc
            log.warning(
                "a migration waits for a lock held by another transaction; trying again in %.1fs", pause
            )
            time.sleep(pause)


def _refuse_unknown_migrations(conn: psycopg.Connection, migrations) -> None:
    known = {m.id for m in migrations}
    unknown = sorted(set(_applied_migrations(conn)) - known)
    if unknown:
        raise PreReleaseInstall(
            f"this database has pglockkit migrations this version does not know ({', '.join(unknown)}): "
            "it was installed by a pre-release build whose migrations were folded into the baseline",
            hint="uninstall it (`pglockkit uninstall --yes`, with `--embedded` for the local server; "
            "the kit's data goes with it), then install again",
        )


@dataclass(frozen=True)
class MigrationState:
    id: str
    applied: bool


def status(dsn: str = "") -> list[MigrationState]:
    """Every known migration, in order, and whether it is applied to the database: recorded by
    ``install`` or by ``sql/pglockkit.sql`` (a psql install). Reads only."""
    with connect(dsn, autocommit=True) as conn:
        try:
            applied = set(_applied_migrations(conn))
        except psycopg.errors.InsufficientPrivilege as exc:
            # The migration state is the owner's: a role that may not read it learns whose it is.
            owner = _kit_owner(conn)
            if owner is None:
                raise
            raise _not_owner(owner, "status", conn) from exc
    return [MigrationState(m.id, m.id in applied) for m in _migrations()]


ROLES = ("pglockkit_user", "pglockkit_admin")


def grant(dsn: str, role: str, *, admin: bool = False, revoke: bool = False) -> str:
    """Give ``role`` pglockkit's worker role (``pglockkit_user``), or with ``admin`` its operator
    role (``pglockkit_admin``: also registers namespaces, lists every queue's jobs, prunes, retries
    dead jobs, samples, sets the payload limit, schedules, sets rate limits and pauses queues);
    ``revoke`` takes the kit back: both roles, or with ``admin`` the operator role only. Returns
    what was done.

    Needs a role that may grant the group role (its admin, a CREATEROLE role or a superuser).
    The group roles are created first if missing (then the grants in this database are
    re-applied, which needs the installing role). A role created NOINHERIT gets the privileges
    with its grant on PostgreSQL 16 and later (``WITH INHERIT TRUE``); on 15 it would get none
    without SET ROLE, so this refuses (``ValueError``, nothing granted). A revoke that leaves
    ``role`` the access (a membership through another role, or one granted by another role)
    raises ``ValueError`` naming it.

    >>> grant(dsn, "worker")  # doctest: +SKIP
    'granted pglockkit_user to worker'
    """
    group = "pglockkit_admin" if admin else "pglockkit_user"
    with connect(dsn, autocommit=True) as conn:
        if not conn.execute("SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = %s)", (role,)).fetchone()[0]:
            raise ValueError(f"role {role!r} does not exist; create it first (CREATE ROLE ... LOGIN)")
        if role in ROLES:
            raise ValueError(
                f"{role!r} is one of pglockkit's own group roles; name a worker or operator role"
            )
        if revoke:
            return _revoke(conn, role, group)
        missing = [
            r
            for r in ROLES
            if not conn.execute("SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = %s)", (r,)).fetchone()[0]
        ]
        inherits = conn.execute("SELECT rolinherit FROM pg_roles WHERE rolname = %s", (role,)).fetchone()[0]
        # Before PostgreSQL 16 a NOINHERIT role uses a group's privileges only after SET ROLE: the
        # grant would be reported done and every call of the role would still get 42501.
        if not inherits and conn.info.server_version < 160000:
            raise ValueError(
                f"role {role!r} is NOINHERIT: as a member of {group} it would get none of its "
                f"privileges until it runs SET ROLE {group}; nothing was granted. Run ALTER ROLE "
                f'"{role}" INHERIT, then this again; or keep it NOINHERIT, GRANT {group} TO "{role}" '
                f"and have each of its sessions run SET ROLE {group} (PostgreSQL 16 and later grant "
                "the privileges to a NOINHERIT role: this command does that there)"
            )
        if missing:
            with conn.transaction():
                for r in missing:
                    conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(r)))
                conn.execute("GRANT pglockkit_user TO pglockkit_admin")
                conn.execute("SELECT pglockkit._grant_privileges()")
        # From PostgreSQL 16 a grant carries its own INHERIT option, by default the role's: give it
        # the privileges whatever the role's default, as the command says it does.
        statement = (
            "GRANT {} TO {} WITH INHERIT TRUE" if conn.info.server_version >= 160000 else "GRANT {} TO {}"
        )
        conn.execute(sql.SQL(statement).format(sql.Identifier(group), sql.Identifier(role)))
    return f"granted {group} to {role}"


def _revoke(conn: psycopg.Connection, role: str, group: str) -> str:
    """``grant(..., revoke=True)``: take back ``group`` and, for pglockkit_user, pglockkit_admin
    too (a member of it is one of pglockkit_user). ``ValueError`` if ``role`` is still a member."""
    targets = [group] if group == "pglockkit_admin" else list(ROLES)
    held = [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT g.rolname FROM pg_catalog.pg_auth_members m"
            "  JOIN pg_catalog.pg_roles g ON g.oid = m.roleid JOIN pg_catalog.pg_roles u ON u.oid = m.member"
            " WHERE u.rolname = %s AND g.rolname = ANY (%s) ORDER BY 1 DESC",
            (role, targets),
        )
    ]
    for g in held:
        conn.execute(sql.SQL("REVOKE {} FROM {}").format(sql.Identifier(g), sql.Identifier(role)))
    # REVOKE of a membership the role has only through another role, or (PostgreSQL 16 and later)
    # one that another role granted, is a WARNING and changes nothing: check what is left.
    via = conn.execute(
        "SELECT g.rolname, pg_catalog.pg_get_userbyid(m.grantor) FROM pg_catalog.pg_auth_members m"
        "  JOIN pg_catalog.pg_roles g ON g.oid = m.roleid JOIN pg_catalog.pg_roles u ON u.oid = m.member"
        " WHERE u.rolname = %s AND pg_catalog.pg_has_role(g.oid, %s, 'MEMBER') ORDER BY 1, 2",
        (role, group),
    ).fetchall()
    gone = [g for g in held if g not in {through for through, _ in via}]
    if not via:
        return (
            f"revoked {' and '.join(gone)} from {role}" if gone else f"{role} has no pglockkit role to revoke"
        )
    done = f"revoked {' and '.join(gone)} from {role}" if gone else "nothing was revoked"
    ways = []
    for through, grantor in via:
        if through in ROLES:
            ways.append(
                f'{through}, granted by {grantor}: REVOKE {through} FROM "{role}" GRANTED BY "{grantor}" '
                f"(as {grantor} or a superuser)"
            )
        else:
            ways.append(f'{through}: REVOKE "{through}" FROM "{role}", or REVOKE {group} FROM "{through}"')
    raise ValueError(f"{done}, but {role} is still a member of {group} through " + "; through ".join(ways))


@dataclass(frozen=True)
class Uninstalled:
    """What ``uninstall`` removed: the migrations that were applied (newest first), the objects
    outside pglockkit's schemas that ``cascade=True`` dropped with them, and the kit's schemas it
    dropped (none: pglockkit was not installed)."""

    migrations: list[str]
    dropped: list[str]
    schemas: list[str] = field(default_factory=list)


KIT_SCHEMAS = ("pglockkit", MIGRATIONS_SCHEMA)

# The schema of each object in pg_depend; rules, column defaults, triggers and policies have none of
# their own and count as their table's, an operator family's members as the family's. Objects
# without a schema (an extension, a cast, a publication's table) count as outside.
_SCHEMA_OF = """
    coalesce(
        CASE {cls}
            WHEN 'pg_catalog.pg_namespace'::pg_catalog.regclass THEN {oid}
            WHEN 'pg_catalog.pg_rewrite'::pg_catalog.regclass THEN
                (SELECT c.relnamespace FROM pg_catalog.pg_rewrite r
                   JOIN pg_catalog.pg_class c ON c.oid = r.ev_class WHERE r.oid = {oid})
            WHEN 'pg_catalog.pg_attrdef'::pg_catalog.regclass THEN
                (SELECT c.relnamespace FROM pg_catalog.pg_attrdef a
                   JOIN pg_catalog.pg_class c ON c.oid = a.adrelid WHERE a.oid = {oid})
            WHEN 'pg_catalog.pg_trigger'::pg_catalog.regclass THEN
                (SELECT c.relnamespace FROM pg_catalog.pg_trigger t
                   JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid WHERE t.oid = {oid})
            WHEN 'pg_catalog.pg_policy'::pg_catalog.regclass THEN
                (SELECT c.relnamespace FROM pg_catalog.pg_policy p
                   JOIN pg_catalog.pg_class c ON c.oid = p.polrelid WHERE p.oid = {oid})
            WHEN 'pg_catalog.pg_amop'::pg_catalog.regclass THEN
                (SELECT f.opfnamespace FROM pg_catalog.pg_amop o
                   JOIN pg_catalog.pg_opfamily f ON f.oid = o.amopfamily WHERE o.oid = {oid})
            WHEN 'pg_catalog.pg_amproc'::pg_catalog.regclass THEN
                (SELECT f.opfnamespace FROM pg_catalog.pg_amproc o
                   JOIN pg_catalog.pg_opfamily f ON f.oid = o.amprocfamily WHERE o.oid = {oid})
            WHEN 'pg_catalog.pg_default_acl'::pg_catalog.regclass THEN
                (SELECT a.defaclnamespace FROM pg_catalog.pg_default_acl a WHERE a.oid = {oid})
        END,
        (SELECT n.oid FROM pg_catalog.pg_namespace n
          WHERE n.nspname = (pg_catalog.pg_identify_object({cls}, {oid}, 0)).schema))
"""

# Objects outside pglockkit's schemas that depend on an object inside them (a view on one of its
# views, a column default calling one of its functions, a foreign key to one of its tables, an
# extension installed into its schema), each named once with what it uses. Internal dependencies
# (a table's TOAST table, in pg_toast) are parts of the kit's own objects. A view is named as
# itself rather than as its rewrite rule. Run with search_path = pg_catalog, so names are qualified.
_DEPENDENTS = f"""
WITH kit AS (
    SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = ANY (%s)
), edges AS (
    SELECT d.classid, d.objid, d.objsubid, d.refclassid, d.refobjid,
           {_SCHEMA_OF.format(cls="d.classid", oid="d.objid")} AS dep_schema,
           {_SCHEMA_OF.format(cls="d.refclassid", oid="d.refobjid")} AS ref_schema
      FROM pg_catalog.pg_depend d
     WHERE d.deptype NOT IN ('i', 'e', 'x')  -- internal: part of the object it depends on
), outside AS (
    SELECT CASE WHEN e.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass AND r.rulename = '_RETURN'
                THEN pg_catalog.pg_describe_object('pg_catalog.pg_class'::pg_catalog.regclass, r.ev_class, 0)
                ELSE pg_catalog.pg_describe_object(e.classid, e.objid, e.objsubid) END AS what,
           pg_catalog.pg_describe_object(e.refclassid, e.refobjid, 0) AS uses
      FROM edges e
      LEFT JOIN pg_catalog.pg_rewrite r
        ON e.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass AND r.oid = e.objid
     WHERE e.ref_schema IN (SELECT oid FROM kit)
       AND (e.dep_schema IS NULL OR e.dep_schema NOT IN (SELECT oid FROM kit))
)
SELECT what || ' (uses ' || string_agg(DISTINCT uses, ', ' ORDER BY uses) || ')'
  FROM outside GROUP BY what ORDER BY what
"""


def _applied_migrations(conn: psycopg.Connection) -> list[str]:
    """The ids of the applied migrations, newest first: yoyo's records, or a bundle install's."""
    ids: set[str] = set()
    for table in (f"{MIGRATIONS_SCHEMA}._yoyo_migration", BUNDLE_TABLE):
        if conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()[0]:
            ids.update(r[0] for r in conn.execute(f"SELECT migration_id FROM {table}"))
    return sorted(ids, reverse=True)


def uninstall(dsn: str = "", *, cascade: bool = False, lock_timeout_s: float = 300.0) -> Uninstalled:
    """Drop schemas ``pglockkit`` and ``pglockkit_migrations`` in one transaction: all or nothing.

    Refuses with ``DependentObjects`` (2BP01), changing nothing, when objects outside those schemas
    depend on pglockkit (a view on ``pglockkit.queue_stats``, a column default calling
    ``pglockkit.lock_key``, a foreign key to one of its tables), unless ``cascade``: then those are
    dropped too, and listed in the result. The cluster-wide roles ``pglockkit_user`` and
    ``pglockkit_admin`` stay (other databases may use them).
    """
    with _InstallLock(dsn, lock_timeout_s, create_schema=False, verb="uninstall") as conn, conn.transaction():
        conn.execute("SET LOCAL search_path = pg_catalog")
        applied = _applied_migrations(conn)
        schemas = [
            r[0]
            for r in conn.execute(
                "SELECT nspname FROM unnest(%s::text[]) WITH ORDINALITY AS k(nspname, i) "
                "WHERE to_regnamespace(nspname) IS NOT NULL ORDER BY i",
                (list(KIT_SCHEMAS),),
            )
        ]
        # The locks DROP SCHEMA would take anyway, taken before the check: no view or foreign key on
        # the kit's tables and views can be created between the check and the drop. (A view is
        # locked alone by a no-op ALTER VIEW ... OWNER TO its owner: LOCK TABLE would lock the
        # catalog views it reads too.) Nothing locks a function: a column default calling one,
        # created in that instant, would go with the drop unnamed.
        for rel, kind, owner in conn.execute(
            "SELECT c.oid::regclass::text, c.relkind, pg_get_userbyid(c.relowner) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = ANY (%s) AND c.relkind IN ('r', 'p', 'v') ORDER BY c.oid",
            (list(KIT_SCHEMAS),),
        ).fetchall():
            if kind == "v":
                conn.execute(sql.SQL("ALTER VIEW {} OWNER TO {}").format(sql.SQL(rel), sql.Identifier(owner)))
            else:
                conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.SQL(rel)))
        dependents = [r[0] for r in conn.execute(_DEPENDENTS, (list(KIT_SCHEMAS),))]
        if dependents and not cascade:
            raise DependentObjects(dependents)
        for schema in KIT_SCHEMAS:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    for name in dependents:
        log.info("uninstall dropped %s", name)
    return Uninstalled(applied, dependents, schemas)


BUNDLE_HEADER = """\
-- pglockkit single-file install, for psql users: psql -v ON_ERROR_STOP=1 -f sql/pglockkit.sql
-- GENERATED by `python3 tools/bundle.py` from sql/schema/: do not edit; a test checks it is
-- current. It records the migrations it stands for, so a later `pglockkit install` upgrades
-- from here.
"""


def render_bundle() -> str:
    """The text of ``sql/pglockkit.sql``: the schema and its bookkeeping, in one transaction."""
    ids = [m.id for m in _migrations()]
    head = [BUNDLE_HEADER, "\\set ON_ERROR_STOP on\n", "BEGIN;\n"]
    return "".join([*head, render_schema(), _bookkeeping(ids), "\nCOMMIT;\n"])
