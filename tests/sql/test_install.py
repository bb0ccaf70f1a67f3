"""Installing: idempotent, concurrent, as an ordinary role; a fresh install (sql/schema/), the
bundle and the migration chain build the same schema; an upgrade loses nothing."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pglockkit
from pglockkit import lock_key
from pglockkit.errors import PreReleaseInstall
from pglockkit.install import _backend, _migrations, migrations_dir, render_bundle

ROOT = Path(__file__).resolve().parents[2]
ALL = sorted(p.stem for p in migrations_dir().glob("*.sql"))
BUNDLE = ROOT / "sql" / "pglockkit.sql"


def _after(migration: str) -> list[str]:
    """The migrations an install applies to a database that has the chain up to ``migration``
    (the probe's too, where the ``probe`` fixture put them in the chain)."""
    return [m.id for m in _migrations() if m.id > migration]


def _objects(dsn: str) -> list[tuple]:
    """Every schema-level object of pglockkit's in the database (schemas, relations, functions, types)."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            """SELECT 'schema', nspname FROM pg_namespace WHERE nspname LIKE 'pglockkit%'
               UNION ALL SELECT 'relation', c.oid::regclass::text FROM pg_class c
                 JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname LIKE 'pglockkit%'
               UNION ALL SELECT 'function', p.oid::regprocedure::text FROM pg_proc p
                 JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname LIKE 'pglockkit%'
               UNION ALL SELECT 'type', t.oid::regtype::text FROM pg_type t
                 JOIN pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname LIKE 'pglockkit%'
               ORDER BY 1, 2"""
        ).fetchall()


def test_migrations_are_a_baseline_then_numbered_deltas_without_rollbacks():
    files = sorted(p.name for p in migrations_dir().iterdir())
    assert files and files[0] == "0001_baseline.sql", files
    for number, name in enumerate(files, start=1):
        assert re.fullmatch(r"\d{4}_[a-z0-9_]+\.sql", name), f"{name}: a forward migration, no rollback"
        assert int(name[:4]) == number, f"{name}: migrations must be numbered 0001, 0002, ... without gaps"


def test_install_twice_is_a_no_op(empty_db):
    assert pglockkit.install(empty_db) == ALL
    objects = _objects(empty_db)
    assert pglockkit.install(empty_db) == []
    assert _objects(empty_db) == objects
    assert all(s.applied for s in pglockkit.status(empty_db))


def test_status_before_install_lists_everything_pending(empty_db):
    states = pglockkit.status(empty_db)
    assert states and not any(s.applied for s in states)
    assert _objects(empty_db) == []  # status creates nothing


def test_eight_installers_at_once_all_succeed(empty_db):
    code = "import sys, pglockkit; print(len(pglockkit.install(sys.argv[1])))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, empty_db], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(8)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [err for _, err in results]
    applied = sorted(int(out.strip()) for out, _ in results)
    assert applied == [0] * 7 + [len(ALL)]  # one applied the migrations, seven found nothing to do
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT pglockkit.lock_key('pglockkit', 'x') > 0").fetchone()[0]


def test_uninstall_leaves_nothing_and_reinstall_works(empty_db):
    pglockkit.install(empty_db)
    done = pglockkit.uninstall(empty_db)
    assert done.migrations == ALL[::-1] and done.schemas == ["pglockkit", "pglockkit_migrations"]
    assert _objects(empty_db) == []
    assert pglockkit.uninstall(empty_db).schemas == []  # nothing left to drop
    assert pglockkit.install(empty_db) == ALL
    assert _objects(empty_db) != []


def test_install_as_ordinary_role_with_only_create_on_database(server, empty_db):
    dbname = conninfo_to_dict(empty_db)["dbname"]
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS app_deployer")
        conn.execute("DROP ROLE IF EXISTS app_owner")
        conn.execute("CREATE ROLE app_owner LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB")
        conn.execute(f'GRANT CREATE, CONNECT ON DATABASE "{dbname}" TO app_owner')
        conn.execute("CREATE ROLE app_deployer LOGIN IN ROLE app_owner")  # a member of the owner
    dsn = make_conninfo(empty_db, user="app_owner")
    assert pglockkit.install(dsn) == ALL
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert (
            conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0] is False
        )
        assert pglockkit.register_namespace(conn, "billing") > 0
        with conn.transaction():
            assert pglockkit.try_xact_lock(conn, "billing", "x")
        owner = conn.execute(
            "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pglockkit'"
        ).fetchone()
        assert owner == ("app_owner",)
    # Not only the owner: a member of its role may run install again (the owner check lets it).
    assert pglockkit.install(make_conninfo(empty_db, user="app_deployer")) == []
    assert pglockkit.uninstall(dsn).migrations == ALL[::-1]
    assert _objects(empty_db) == []


def _kit_works(dsn: str) -> None:
    """Every migration recorded, and a job goes through enqueue, claim and complete."""
    assert all(s.applied for s in pglockkit.status(dsn))
    with psycopg.connect(dsn, autocommit=True) as conn:
        job = conn.execute("SELECT pglockkit.enqueue_job('q', '{}')").fetchone()[0]
        claimed = conn.execute("SELECT id, token FROM pglockkit.claim_job('q', 'w', '1 minute')").fetchall()
        assert [c[0] for c in claimed] == [job]
        assert conn.execute("SELECT pglockkit.complete_job(%s, %s)", claimed[0]).fetchone()[0] is True


USER_OBJECTS = {
    "view": (
        "CREATE VIEW public.my_stats AS SELECT * FROM pglockkit.queue_stats",
        "view public.my_stats (uses view pglockkit.queue_stats)",
    ),
    "column-default": (
        "CREATE TABLE public.accounts (id int, k bigint DEFAULT pglockkit.lock_key('pglockkit', 'x'))",
        "default value for column k of table public.accounts (uses function pglockkit.lock_key(text,text))",
    ),
    "foreign-key": (
        "CREATE TABLE public.audit (job bigint REFERENCES pglockkit.jobs (id))",
        "constraint audit_job_fkey on table public.audit (uses ",
    ),
    "extension": ("CREATE EXTENSION cube SCHEMA pglockkit", "extension cube (uses schema pglockkit)"),
}


@pytest.mark.parametrize("kind", USER_OBJECTS)
def test_uninstall_refuses_while_user_objects_depend_on_the_kit_and_changes_nothing(db, kind):
    ddl, named = USER_OBJECTS[kind]
    db.conn.execute(ddl)
    before = _objects(db.dsn)
    with pytest.raises(pglockkit.PglockkitError) as err:
        pglockkit.uninstall(db.dsn)
    assert err.value.sqlstate == "2BP01"
    assert [o for o in err.value.objects if o.startswith(named)] == err.value.objects, err.value.objects
    assert named in str(err.value) and "cascade" in err.value.hint
    assert _objects(db.dsn) == before  # all or nothing: nothing
    _kit_works(db.dsn)


def test_uninstall_with_cascade_drops_the_dependent_objects_and_names_them(db):
    for ddl, _ in USER_OBJECTS.values():
        db.conn.execute(ddl)
    result = pglockkit.uninstall(db.dsn, cascade=True)
    assert result.migrations == ALL[::-1]
    assert len(result.dropped) == len(USER_OBJECTS)
    for _, named in USER_OBJECTS.values():
        assert any(d.startswith(named) for d in result.dropped), (named, result.dropped)
    assert _objects(db.dsn) == []
    assert db.conn.execute("SELECT to_regclass('public.my_stats')").fetchone()[0] is None
    # The tables stay, without the default and the foreign key that used the kit.
    assert db.conn.execute("SELECT pg_get_expr(adbin, adrelid) FROM pg_attrdef").fetchall() == []
    db.conn.execute("INSERT INTO public.accounts VALUES (1)")
    db.conn.execute("INSERT INTO public.audit VALUES (42)")


def test_an_uninstall_that_fails_midway_leaves_the_kit_intact(db):
    """A worker's open transaction holds a lock on the registry, which the last step drops: the
    uninstall times out there, and every step before it is undone with it."""
    before = _objects(db.dsn)
    with db.connect(autocommit=False) as worker:
        worker.execute("SELECT count(*) FROM pglockkit.namespaces")  # holds ACCESS SHARE
        with pytest.raises(psycopg.errors.LockNotAvailable):
            pglockkit.uninstall(make_conninfo(db.dsn, options="-c lock_timeout=1s"), lock_timeout_s=1)
    assert _objects(db.dsn) == before
    _kit_works(db.dsn)


def test_uninstall_of_a_bundle_install(server):
    dsn = server.dsn(server.create_database())
    _psql_file(server, dsn, BUNDLE)
    assert pglockkit.uninstall(dsn).migrations == ALL[::-1]
    assert _objects(dsn) == []


# Functions that change what every worker works with, or delete history: pglockkit_admin only.
ADMIN_ONLY = {
    "pglockkit.register_namespace",
    "pglockkit.list_jobs",
    "pglockkit.prune_jobs",
    "pglockkit.prune_leases",
    "pglockkit.prune_runs",
    "pglockkit.retry_dead_jobs",
    "pglockkit.sample",
    "pglockkit.schedule",
    "pglockkit.set_max_payload_bytes",
    "pglockkit.unschedule",
    "pglockkit.set_rate_limit",
    "pglockkit.remove_rate_limit",
    "pglockkit.pause_queue",
    "pglockkit.resume_queue",
}


def test_functions_pin_search_path_have_comments_and_are_not_public(db):
    rows = db.conn.execute(
        """SELECT p.oid::regprocedure::text, p.proconfig, obj_description(p.oid, 'pg_proc'),
                  coalesce(p.proacl::text, ''), p.prosecdef, p.prosqlbody IS NOT NULL
             FROM pg_proc p WHERE p.pronamespace = 'pglockkit'::regnamespace"""
    ).fetchall()
    assert len(rows) > 20
    # Without a SET clause so that the planner inlines them into their callers: BEGIN ATOMIC bodies
    # (bound when created, under the installer's pinned search path), or these, whose text is
    # fully qualified; test_search_path_hijack_changes_nothing checks both kinds.
    inlined_text = {
        "pglockkit._lease_session_key(text)",
        "pglockkit._lease_session_key(text,integer)",
        "pglockkit._run_key(text,text)",
    }
    atomic = {sig for sig, *_, is_atomic in rows if is_atomic}
    assert {"pglockkit.xact_lock(text,text,interval)", "pglockkit.lock_key(text,text)"} <= atomic
    for sig, config, comment, acl, _, is_atomic in rows:
        if sig in inlined_text or is_atomic:
            assert config is None, sig
        else:
            assert config and any(c.startswith("search_path=pg_catalog") for c in config), sig
        assert comment, f"{sig} has no COMMENT"
        assert not re.search(r"(^|[{,])=X", acl), f"{sig} is executable by PUBLIC: {acl}"
        if sig.split("(")[0] in ADMIN_ONLY:
            assert "pglockkit_admin=X" in acl and "pglockkit_user=X" not in acl, f"{sig}: {acl}"
        elif not sig.startswith("pglockkit._grant_privileges"):
            assert "pglockkit_user=X" in acl, f"{sig} not granted to pglockkit_user: {acl}"
    definers = sorted(sig for sig, _, _, _, secdef, _ in rows if secdef)
    # The functions that write the kit's tables, _lock_jobs (it locks job rows for a worker's
    # group), and list_jobs (pglockkit_admin reads the jobs through it: no role has privileges on
    # the table), and no others.
    assert definers == [
        "pglockkit._lock_jobs(bigint[],bigint[])",
        "pglockkit.acquire_lease(text,text,interval,boolean)",
        "pglockkit.cancel_job(bigint)",
        "pglockkit.check_fence(text,bigint)",
        "pglockkit.claim_job(text,text,interval,integer)",
        "pglockkit.complete_job(bigint,bigint)",
        "pglockkit.complete_jobs(bigint[],bigint[])",
        "pglockkit.enqueue_job(text,jsonb,timestamp with time zone,integer,text,integer,text,integer,text)",
        "pglockkit.enqueue_jobs(text,jsonb[],timestamp with time zone,integer,integer,text)",
        "pglockkit.extend_job(bigint,bigint,interval)",
        "pglockkit.extend_jobs(bigint[],bigint[],interval)",
        "pglockkit.fail_job(bigint,bigint,text,interval)",
        "pglockkit.finish_run(bigint,boolean,text)",
        "pglockkit.list_jobs(text,text,integer)",
        "pglockkit.next_rate_token(text)",
        "pglockkit.pause_queue(text)",
        "pglockkit.prune_jobs(interval,text,boolean)",
        "pglockkit.prune_leases(interval)",
        "pglockkit.prune_runs(interval)",
        "pglockkit.register_namespace(text,integer,text,interval)",
        "pglockkit.release_job(bigint,bigint)",
        "pglockkit.release_lease(text,text,bigint)",
        "pglockkit.remove_rate_limit(text,text)",
        "pglockkit.renew_lease(text,text,bigint,interval)",
        "pglockkit.resume_queue(text)",
        "pglockkit.retry_dead_jobs(text,bigint[])",
        "pglockkit.sample(interval)",
        "pglockkit.schedule(text,text,text,jsonb,text,integer,integer,integer)",
        "pglockkit.set_max_payload_bytes(integer)",
        "pglockkit.set_rate_limit(text,text,integer,interval,integer)",
        "pglockkit.start_run(text,text,text)",
        "pglockkit.tick_schedules(timestamp with time zone)",
        "pglockkit.unschedule(text)",
    ]


def test_bundle_is_current():
    assert BUNDLE.read_text(encoding="utf-8") == render_bundle(), "run `python3 tools/bundle.py`"


def _pg_dump_schema(server, dsn: str) -> str:
    out = subprocess.run(
        [str(server.bindir / "pg_dump"), "--schema-only", "--schema=pglockkit", "--no-owner", dsn],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # pg_dump's per-run \restrict key and version banner are not schema.
    return "\n".join(
        line for line in out.splitlines() if not line.startswith(("\\restrict", "\\unrestrict", "-- Dumped"))
    )


def _psql_file(server, dsn: str, path: Path) -> None:
    subprocess.run(
        [str(server.bindir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", str(path)],
        check=True,
        capture_output=True,
        text=True,
    )


def _apply_chain(dsn: str, upto: str | None = None) -> None:
    """The migration chain alone, as an upgrade runs it (a fresh install runs sql/schema/)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS pglockkit_migrations")
    backend = _backend(dsn)
    try:
        migrations = _migrations()
        if upto is not None:
            migrations = migrations.filter(lambda m: m.id <= upto)
        with backend.lock():
            backend.apply_migrations(backend.to_apply(migrations))
    finally:
        backend.connection.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pglockkit._grant_privileges()")


def test_schema_bundle_and_migration_chain_build_the_same_schema(server):
    """sql/schema/ (a fresh install), sql/pglockkit.sql (psql) and the migration chain (the
    baseline, then every delta) build identical schemas: the domain files and the migrations cannot
    drift apart."""
    from_schema, from_bundle, from_chain = (server.dsn(server.create_database()) for _ in range(3))
    assert pglockkit.install(from_schema) == ALL
    _psql_file(server, from_bundle, BUNDLE)
    _apply_chain(from_chain)
    dumps = [_pg_dump_schema(server, dsn) for dsn in (from_schema, from_bundle, from_chain)]
    assert "CREATE FUNCTION pglockkit.xact_lock" in dumps[0]
    assert dumps[1] == dumps[0], "the bundle is not sql/schema/: run `python3 tools/bundle.py`"
    assert dumps[2] == dumps[0], "the migration chain does not build sql/schema/: a delta is missing"
    assert all(s.applied for s in pglockkit.status(from_chain))


def test_an_upgrade_from_the_baseline_while_workers_drain_and_leases_are_held_loses_nothing(server):
    """A database built at the baseline, with jobs, leases and runs in it, is upgraded to the newest
    migration while a worker drains its queue and a lease holder renews: every job is done once,
    the lease and run rows survive, and tokens keep increasing. (With no delta after the baseline
    yet, the upgrade applies nothing; the first delta migration gives this test its teeth.)"""
    dsn = server.dsn(server.create_database())
    _apply_chain(dsn, upto="0001_baseline")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE done_log (job_id bigint)")
        conn.execute("SELECT pglockkit.enqueue_jobs('up', array_fill('{}'::jsonb, ARRAY[400]))")
        first = conn.execute("SELECT pglockkit.acquire_lease('up', 'holder', '30 seconds')").fetchone()[0]
        run = conn.execute("SELECT pglockkit.start_run('nightly', '2026-12-01', 'pod-a')").fetchone()[0]
        conn.execute("SELECT pglockkit.finish_run(%s, true)", (run,))

    def handler(job, conn):
        conn.execute("INSERT INTO done_log VALUES (%s)", (job.id,))
        time.sleep(0.002)

    worker = pglockkit.Worker(dsn, "up", handler, concurrency=2)
    drained = threading.Thread(target=worker.run, kwargs={"exit_when_idle": True})
    drained.start()
    with psycopg.connect(dsn, autocommit=True) as holder:
        renew = "SELECT pglockkit.renew_lease('up', 'holder', %s, '30 seconds')"
        assert holder.execute(renew, (first,)).fetchone()[0] is True
        pglockkit.install(dsn)  # the upgrade, while the worker drains and the lease is held
        assert holder.execute(renew, (first,)).fetchone()[0] is True
        assert holder.execute("SELECT pglockkit.release_lease('up', 'holder', %s)", (first,)).fetchone()[0]
        later = holder.execute("SELECT pglockkit.acquire_lease('up', 'other', '1 second')").fetchone()[0]
        assert later > first
    drained.join(60)
    assert not drained.is_alive()
    assert all(s.applied for s in pglockkit.status(dsn))
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT job_id) FROM done_log").fetchone() == (400, 400)
        by_status = "SELECT status, count(*) FROM pglockkit.jobs GROUP BY 1"
        assert conn.execute(by_status).fetchall() == [("done", 400)]
        runs = "SELECT count(*) FROM pglockkit.runs WHERE status = 'succeeded'"
        assert conn.execute(runs).fetchone()[0] == 1
        tokens = [r[0] for r in conn.execute("SELECT token FROM pglockkit.jobs ORDER BY token")]
        assert len(set(tokens)) == 400


def test_a_pre_release_install_is_refused_with_what_to_do(server):
    dsn = server.dsn(server.create_database())
    pglockkit.install(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:  # as a build before the baseline left it
        conn.execute(
            "INSERT INTO pglockkit_migrations._yoyo_migration (migration_hash, migration_id, applied_at_utc) "
            "VALUES ('x', '0001_foundation', now())"
        )
    with pytest.raises(PreReleaseInstall, match=r"does not know \(0001_foundation\)") as err:
        pglockkit.install(dsn)
    assert "pglockkit uninstall --yes" in err.value.hint
    cli = subprocess.run(
        [sys.executable, "-m", "pglockkit.cli", "install", "--dsn", dsn], capture_output=True, text=True
    )
    assert cli.returncode == 1 and "Traceback" not in cli.stderr
    assert "0001_foundation" in cli.stderr and "pglockkit uninstall --yes" in cli.stderr


def test_install_adopts_a_bundle_install(server):
    dsn = server.dsn(server.create_database())
    _psql_file(server, dsn, BUNDLE)
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT pglockkit.register_namespace('kept')")
    assert pglockkit.install(dsn) == []  # adopted, nothing re-applied
    assert all(s.applied for s in pglockkit.status(dsn))
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('pglockkit_migrations.bundle')").fetchone()[0] is None
        assert (
            conn.execute("SELECT count(*) FROM pglockkit.namespaces WHERE name = 'kept'").fetchone()[0] == 1
        )


@pytest.mark.parametrize("dsn_source", ["argument", "environment"])
def test_dsn_resolution(server, empty_db, monkeypatch, dsn_source):
    if dsn_source == "environment":
        monkeypatch.setenv("PGLOCKKIT_DSN", empty_db)
        assert pglockkit.resolve_dsn(None) == empty_db
    else:
        monkeypatch.setenv("PGLOCKKIT_DSN", "dbname=wrong")
        assert pglockkit.resolve_dsn(empty_db) == empty_db


def test_search_path_hijack_changes_nothing(db):
    """A role that shadows the functions and operators pglockkit uses, and puts its schema first
    on its search_path (before pg_catalog), changes no key and no lock behaviour."""
    db.conn.execute("SELECT pglockkit.register_namespace('billing', 42)")
    expected = db.conn.execute("SELECT pglockkit.lock_key('billing', 'invoice:7')").fetchone()[0]
    db.conn.execute("CREATE SCHEMA evil")
    for ddl in [
        "CREATE FUNCTION evil.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$ SELECT '\\x00'::bytea $$",
        "CREATE FUNCTION evil.encode(bytea, text) RETURNS text LANGUAGE sql AS $$ SELECT 'ffffffffffff' $$",
        "CREATE FUNCTION evil.substr(bytea, int, int) RETURNS bytea"
        " LANGUAGE sql AS $$ SELECT '\\x01'::bytea $$",
        "CREATE FUNCTION evil.pg_try_advisory_xact_lock(bigint) RETURNS boolean"
        " LANGUAGE sql AS $$ SELECT true $$",
        "CREATE FUNCTION evil.concat_evil(text, text) RETURNS text LANGUAGE sql AS $$ SELECT 'x0' $$",
        "CREATE OPERATOR evil.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.concat_evil)",
        "CREATE FUNCTION evil.shr(bigint, int) RETURNS bigint LANGUAGE sql AS $$ SELECT 0::bigint $$",
        "CREATE OPERATOR evil.>> (LEFTARG = bigint, RIGHTARG = int, FUNCTION = evil.shr)",
    ]:
        db.conn.execute(ddl)
    db.conn.execute("SET search_path = evil, pg_catalog, public")
    assert db.conn.execute("SELECT pglockkit.lock_key('billing', 'invoice:7')").fetchone()[0] == expected
    assert db.conn.execute("SELECT pglockkit._key(42::smallint, 'invoice:7')").fetchone()[0] == expected
    with db.connect() as other:
        assert other.execute("SELECT pglockkit.try_lock('billing', 'invoice:7')").fetchone()[0]
        db.conn.execute("BEGIN")
        assert (
            db.conn.execute("SELECT pglockkit.try_xact_lock('billing', 'invoice:7')").fetchone()[0] is False
        )
        db.conn.execute("ROLLBACK")


def test_search_path_hijack_does_not_reach_the_inlined_lock_calls(db):
    """The lock calls are inlined into the caller's statement, which is planned under the caller's
    search_path. Their BEGIN ATOMIC bodies were bound when they were created, so shadowing every
    function and operator they use changes neither the key nor whether the lock is really taken."""
    db.conn.execute("SELECT pglockkit.register_namespace('billing', 42)")
    expected = lock_key(42, "invoice:7")
    db.conn.execute("CREATE SCHEMA evil")
    for signature, body in [
        ("pg_try_advisory_xact_lock(bigint) RETURNS boolean", "SELECT true"),
        ("pg_try_advisory_lock(bigint) RETURNS boolean", "SELECT true"),
        ("array_position(text[], text) RETURNS int", "SELECT 1"),
        ("convert_to(text, name) RETURNS bytea", "SELECT '\\x00'::bytea"),
        ("or_evil(bigint, bigint) RETURNS bigint", "SELECT 1::bigint"),
        ("shl(bigint, int) RETURNS bigint", "SELECT 0::bigint"),
        ("ge(bigint, int) RETURNS boolean", "SELECT false"),
    ]:
        db.conn.execute(f"CREATE FUNCTION evil.{signature} LANGUAGE sql AS $$ {body} $$")
    for op, right, func in [("|", "bigint", "or_evil"), ("<<", "int", "shl"), (">=", "int", "ge")]:
        db.conn.execute(
            f"CREATE OPERATOR evil.{op} (LEFTARG = bigint, RIGHTARG = {right}, FUNCTION = evil.{func})"
        )
    db.conn.execute("SET search_path = evil, pg_catalog, public")
    assert db.conn.execute("SELECT pglockkit.key(42, 'invoice:7')").fetchone()[0] == expected
    assert db.conn.execute("SELECT pglockkit.key(42, 7::bigint)").fetchone()[0] == lock_key(42, 7)

    def one(conn, query, *args):
        return conn.execute(query, args).fetchone()[0]

    with db.connect() as other:
        db.conn.execute("BEGIN")
        assert one(db.conn, "SELECT pglockkit.xact_lock('billing', 'invoice:7')") == expected
        assert one(db.conn, "SELECT pglockkit.xact_lock('billing', 7::bigint)") == lock_key(42, 7)
        assert not one(other, "SELECT pg_try_advisory_xact_lock(%s)", expected)
        assert not one(other, "SELECT pg_try_advisory_xact_lock(%s)", lock_key(42, 7))
        db.conn.execute("ROLLBACK")
        assert one(other, "SELECT pglockkit.try_lock('billing', 'invoice:7')")
        db.conn.execute("BEGIN")
        assert one(db.conn, "SELECT pglockkit.try_xact_lock('billing', 'invoice:7')") is False
        db.conn.execute("ROLLBACK")
        assert one(db.conn, "SELECT pglockkit.try_lock('billing', 'invoice:7')") is False


def test_search_path_hijack_does_not_reach_the_inlined_run_key_of_run_history(db):
    """run_history calls _run_key, an inlined LANGUAGE sql function without BEGIN ATOMIC: its body
    is parsed under the reader's search_path. Its comment says "Inlined; fully qualified", but it
    casts with an unqualified `::text`: a type `text` of the reader's schema before pg_catalog (a
    domain over varchar(1)) changes the key for a job name of 10 characters or more, and a run
    whose starter is alive and holds its slot reads 'abandoned'."""
    run = db.conn.execute("SELECT pglockkit.start_run('nightly-report', '2026-01-01', 'pod-a')").fetchone()[0]
    with db.connect() as reader:
        status = "SELECT status FROM pglockkit.run_history WHERE id = %s"
        assert reader.execute(status, (run,)).fetchone()[0] == "running"
        reader.execute("CREATE SCHEMA evil")
        reader.execute("CREATE DOMAIN evil.text AS varchar(1)")
        reader.execute("SET search_path = evil, pg_catalog, public")
        assert reader.execute(status, (run,)).fetchone()[0] == "running"


@pytest.mark.parametrize("upto", ALL)
def test_an_upgrade_from_every_migration_keeps_the_stored_state_working(server, probe, upto):
    """Jobs (claimed, keyed, rate-limited, in a paused queue), leases (bound and not), runs and
    schedules written under an earlier version, with their sessions still open across the upgrade,
    keep working after `install` upgrades the database (the real deltas after ``upto``, then the
    probe's, so that every start point has something to apply)."""
    dsn = server.dsn(server.create_database())
    _apply_chain(dsn, upto=upto)
    with psycopg.connect(dsn, autocommit=True) as s:  # a session that lives across the upgrade
        q = lambda sql, *a: s.execute(sql, a).fetchone()  # noqa: E731
        q("SELECT pglockkit.register_namespace('app')")
        assert q("SELECT pglockkit.try_lock('app', 'r')")[0] is True
        keyed = [
            q("SELECT pglockkit.enqueue_job('q', '{}', concurrency_key => 'k', concurrency_limit => 1)")[0]
            for _ in range(2)
        ]
        claimed = s.execute("SELECT id, token FROM pglockkit.claim_job('q', 'w', '1 minute')").fetchall()
        assert [c[0] for c in claimed] == keyed[:1]
        free = q("SELECT pglockkit.acquire_lease('free', 'h', '1 minute')")[0]
        bound = q("SELECT pglockkit.acquire_lease('bound', 'h', '1 minute', true)")[0]
        run = q("SELECT pglockkit.start_run('nightly', 's1', 'pod')")[0]
        q("SELECT pglockkit.schedule('sch', '* * * * *', 'sq')")
        q("SELECT pglockkit.set_rate_limit('rq', 'api', 1, '1 hour')")
        for _ in range(2):
            q("SELECT pglockkit.enqueue_job('rq', '{}', rate_key => 'api')")
        q("SELECT pglockkit.pause_queue('pq')")
        q("SELECT pglockkit.enqueue_job('pq', '{}')")

        assert pglockkit.install(dsn) == _after(upto) and probe[-1] in _after(upto)

        assert q("SELECT pglockkit.complete_job(%s, %s)", *claimed[0])[0] is True
        again = s.execute("SELECT id FROM pglockkit.claim_job('q', 'w', '1 minute')").fetchall()
        assert [r[0] for r in again] == keyed[1:], "the key's running count survived the upgrade"
        assert q("SELECT pglockkit.renew_lease('free', 'h', %s, '1 minute')", free)[0] is True
        assert q("SELECT pglockkit.renew_lease('bound', 'h', %s, '1 minute')", bound)[0] is True
        assert q("SELECT pglockkit.finish_run(%s, true)", run)[0] is True
        q("SELECT pglockkit.unlock('app', 'r')")
        assert q("SELECT count(*) FROM pglockkit.schedules WHERE name = 'sch'")[0] == 1
        due = "date_trunc('minute', now()) - interval '1 minute'"
        s.execute(f"UPDATE pglockkit.job_schedules SET next_run = {due}")
        assert q("SELECT pglockkit.tick_schedules()")[0] == 1
        rq = s.execute("SELECT * FROM pglockkit.claim_job('rq', 'w', '1 minute', 10)").fetchall()
        assert len(rq) == 1, "the rate limit survived the upgrade"
        assert s.execute("SELECT * FROM pglockkit.claim_job('pq', 'w')").fetchall() == []
        q("SELECT pglockkit.resume_queue('pq')")
        assert len(s.execute("SELECT * FROM pglockkit.claim_job('pq', 'w')").fetchall()) == 1
    _kit_works(dsn)


def test_an_upgrade_blocked_by_a_long_worker_transaction_does_not_stall_every_claim(server, probe):
    """A delta that alters pglockkit.jobs (the probe's first takes its lock). A worker whose
    handler runs in a transaction (handler(job, conn))
    holds a lock on jobs until it commits; an upgrade that waits for that lock without a timeout
    queues every other claimer behind it, of every queue, for as long as the handler runs, and
    `install(lock_timeout_s=...)` does not bound the wait."""
    dsn = server.dsn(server.create_database())
    last = ALL[-1]
    _apply_chain(dsn, upto=last)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pglockkit.enqueue_job('slow', '{}')")
        conn.execute("SELECT pglockkit.enqueue_job('other', '{}')")
    handler = psycopg.connect(dsn)  # a handler's transaction: its claim, its writes, not committed yet
    handler.execute("SELECT * FROM pglockkit.claim_job('slow', 'w1', '1 minute')").fetchall()
    outcome: list = []

    def upgrade():
        try:
            outcome.append(pglockkit.install(dsn, lock_timeout_s=2))
        except Exception as exc:  # what it raised is the finding
            outcome.append(exc)

    t = threading.Thread(target=upgrade, daemon=True)
    t.start()
    try:
        time.sleep(1.5)  # the upgrade is now waiting for the handler's lock on jobs
        with psycopg.connect(dsn, autocommit=True) as other:
            other.execute("SET statement_timeout = '5s'")
            started = time.monotonic()
            try:
                other.execute("SELECT * FROM pglockkit.claim_job('other', 'w2', '1 minute')").fetchall()
                blocked = None
            except psycopg.errors.QueryCanceled as exc:
                blocked = exc
            waited = time.monotonic() - started
        t.join(15)
        assert blocked is None, f"a claim of another queue waited {waited:.1f}s behind the upgrade"
        assert not t.is_alive(), "install is still waiting for the handler's transaction after 15 s"
    finally:
        handler.rollback()
        handler.close()
        t.join(60)
    [error] = outcome
    assert isinstance(error, pglockkit.LockTimeout) and error.sqlstate == "55P03", error
    assert f"migration {probe[0]} could not take a lock" in str(error)
    assert "pglockkit.lock_waits" in error.hint
    # Nothing of the probe was applied; once the handler's transaction has ended, install finishes.
    assert pglockkit.install(dsn) == _after(last) == probe
    _kit_works(dsn)


def test_status_of_a_bundle_install_shows_every_migration_applied(server):
    """After `psql -f sql/pglockkit.sql` the whole schema is installed and the bundle records the
    migrations it stands for (uninstall reads them); `pglockkit status` read only yoyo's table and
    said "0 applied, 13 pending"."""
    dsn = server.dsn(server.create_database())
    _psql_file(server, dsn, BUNDLE)
    states = pglockkit.status(dsn)
    assert [s.id for s in states if not s.applied] == []
    cli = subprocess.run(
        [sys.executable, "-m", "pglockkit.cli", "status", "--dsn", dsn], capture_output=True, text=True
    )
    assert f"{len(ALL)} applied, 0 pending (at release 0.1.0" in cli.stdout


def test_an_upgrade_honours_pgoptions_as_the_install_connection_does(server, probe, monkeypatch):
    """libpq's environment is how install may be pointed at a database (docs/install.md), and
    PGOPTIONS="-c role=OWNER" is how a login role installs objects owned by the role that owns
    the kit. _backend now always passes an `options` connection parameter (lock_timeout), which
    replaces PGOPTIONS for yoyo's connections only: the migrations run as the login role, and
    _grant_privileges, on the install's own connection (which does honour PGOPTIONS), then fails
    on the objects they created (42501), the upgrade half done."""
    owner = "pgk_owner_pgoptions"
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute(f"DROP ROLE IF EXISTS {owner}")
        admin.execute(f"CREATE ROLE {owner} NOLOGIN")
    try:
        name = server.create_database()
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" OWNER TO {owner}')
        dsn = server.dsn(name)
        _apply_chain(make_conninfo(dsn, options=f"-c role={owner}"), upto=ALL[-1])
        monkeypatch.setenv("PGOPTIONS", f"-c role={owner}")
        assert pglockkit.install(dsn) == probe
        with psycopg.connect(dsn, autocommit=True) as conn:
            owners = conn.execute(
                "SELECT DISTINCT proowner::regrole::text FROM pg_proc"
                " WHERE pronamespace = 'pglockkit'::regnamespace"
            ).fetchall()
        assert owners == [(owner,)]
    finally:
        monkeypatch.delenv("PGOPTIONS", raising=False)
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.execute(f"DROP ROLE IF EXISTS {owner}")


@pytest.mark.parametrize("upgrader", ["superuser", "member"])
def test_an_upgrade_run_by_a_member_of_the_owner_or_a_superuser_leaves_definers_working(
    server, empty_db, probe, upgrader
):
    """NotOwner (2840f89) lets 'the owner, a member of its role, or a superuser' install, and
    docs/install.md says a member of the owner's role runs every later install. Without SET ROLE
    to the owner, what a migration creates is owned by whoever ran it: a delta's new table, which
    a SECURITY DEFINER function of the owner's writes (as 0017's lock_sightings was for sample(),
    before 0.1.0), fails that function with 42501 for every caller after an upgrade by a
    superuser or a member. The probe's first delta is such a table and function."""
    dbname = conninfo_to_dict(empty_db)["dbname"]
    owner, deployer = f"up_owner_{upgrader}", f"up_deployer_{upgrader}"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP ROLE IF EXISTS {deployer}")
        conn.execute(f"DROP ROLE IF EXISTS {owner}")
        conn.execute(f"CREATE ROLE {owner} LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB")
        conn.execute(f'GRANT CREATE, CONNECT ON DATABASE "{dbname}" TO {owner}')
        conn.execute(f"CREATE ROLE {deployer} LOGIN IN ROLE {owner}")
    try:
        owner_dsn = make_conninfo(empty_db, user=f"{owner}")
        _apply_chain(owner_dsn, upto=ALL[-1])  # installed by the owner, before the probe
        upgrade_dsn = empty_db if upgrader == "superuser" else make_conninfo(empty_db, user=f"{deployer}")
        assert pglockkit.install(upgrade_dsn) == probe
        with psycopg.connect(owner_dsn, autocommit=True) as conn:
            owners = conn.execute(
                "SELECT relname, relowner::regrole::text FROM pg_class "
                "WHERE relnamespace = 'pglockkit'::regnamespace AND relname = 'upgrade_probe'"
            ).fetchall()
            assert owners == [("upgrade_probe", owner)]
            try:
                assert conn.execute("SELECT pglockkit.upgrade_probe()").fetchone()[0] == 2
                conn.execute("SELECT pglockkit.sample()")
            except psycopg.errors.InsufficientPrivilege as exc:
                pytest.fail(f"a definer after an upgrade by the {upgrader}: {exc}; owners {owners}")
    finally:
        with psycopg.connect(empty_db, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {deployer}, {owner}")
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {deployer}, {owner}")
            conn.execute(f"DROP ROLE {deployer}")
            conn.execute(f"DROP ROLE {owner}")


def _apply_chain_as_connected(dsn: str, upto: str) -> None:
    """The migrations up to ``upto`` as install applied them before it ran as the owner (dcef8a9):
    a plain yoyo backend, no SET ROLE, so what they create is the connected role's."""
    from yoyo.backends import get_backend_class
    from yoyo.connections import DatabaseURI

    args = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    args["schema"] = "pglockkit_migrations"
    uri = DatabaseURI("postgresql+psycopg", None, None, None, None, args.pop("dbname", None), args)
    backend = get_backend_class("postgresql+psycopg")(uri, "_yoyo_migration")
    backend.init_database()
    try:
        with backend.lock():
            backend.apply_migrations(backend.to_apply(_migrations().filter(lambda m: m.id <= upto)))
    finally:
        backend.connection.close()


@pytest.mark.parametrize("action", ["install", "uninstall"])
@pytest.mark.parametrize("upgrader", ["superuser", "member"])
def test_install_and_uninstall_as_the_owner_on_a_kit_an_earlier_upgrade_left_partly_theirs(
    server, empty_db, probe, upgrader, action
):
    """Before dcef8a9 an upgrade by a superuser or a member of the owner's role left what its
    migrations created theirs (the very case 0017's lock_sightings showed). install now SETs ROLE
    to the owner first: the next migration that replaces one of those functions, and uninstall's
    ALTER VIEW ... OWNER TO of such a view, run as the owner and are refused (42501), although the
    role running them could do both, and did the upgrade that made them."""
    dbname = conninfo_to_dict(empty_db)["dbname"]
    owner, deployer = f"mix_owner_{upgrader}_{action}", f"mix_deployer_{upgrader}_{action}"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP ROLE IF EXISTS {deployer}")
        conn.execute(f"DROP ROLE IF EXISTS {owner}")
        conn.execute(f"CREATE ROLE {owner} LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB")
        conn.execute(f'GRANT CREATE, CONNECT ON DATABASE "{dbname}" TO {owner}')
        conn.execute(f"CREATE ROLE {deployer} LOGIN IN ROLE {owner}")
    try:
        owner_dsn = make_conninfo(empty_db, user=owner)
        upgrade_dsn = empty_db if upgrader == "superuser" else make_conninfo(empty_db, user=deployer)
        _apply_chain(owner_dsn, upto=ALL[-1])
        _apply_chain_as_connected(upgrade_dsn, upto=probe[0])
        with psycopg.connect(empty_db, autocommit=True) as conn:
            theirs = conn.execute(
                "SELECT count(*) FROM pg_proc WHERE pronamespace = 'pglockkit'::regnamespace"
                " AND proowner::regrole::text <> %s",
                (owner,),
            ).fetchone()[0]
        assert theirs > 0, "the setup made nothing of the upgrader's"
        try:
            if action == "install":
                assert pglockkit.install(upgrade_dsn) == probe[1:]
                with psycopg.connect(owner_dsn, autocommit=True) as conn:
                    assert conn.execute("SELECT pglockkit.upgrade_probe()").fetchone()[0] == 2
                    conn.execute("SELECT pglockkit.sample()")
            else:
                assert pglockkit.uninstall(upgrade_dsn).schemas == ["pglockkit", "pglockkit_migrations"]
        except psycopg.errors.InsufficientPrivilege as exc:
            pytest.fail(f"{action} by the {upgrader} after its own earlier upgrade: {exc}")
    finally:
        with psycopg.connect(empty_db, autocommit=True) as conn:
            conn.execute("DROP SCHEMA IF EXISTS pglockkit, pglockkit_migrations CASCADE")
            conn.execute(f"DROP OWNED BY {deployer}, {owner}")
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {deployer}, {owner}")
            conn.execute(f"DROP ROLE {deployer}")
            conn.execute(f"DROP ROLE {owner}")


def test_a_member_that_may_not_set_role_to_the_owner_installs_or_is_refused_with_not_owner(server, empty_db):
    """PostgreSQL 16 and later: a member granted the owner's role WITH SET FALSE has its privileges
    (pg_has_role USAGE, which _require_owner accepts) but may not SET ROLE to it. install then
    fails in _act_as_owner with psycopg's bare 'permission denied to set role', after
    _require_owner let it through: it should either run (as before dcef8a9) or be refused up
    front by NotOwner naming the owner and what the member lacks. (PostgreSQL 15 has no SET option:
    there a NOINHERIT member, which has neither the privileges nor SET ROLE by default, is refused
    the same way.)"""
    dbname = conninfo_to_dict(empty_db)["dbname"]
    owner, deployer = "noset_owner", "noset_deployer"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP ROLE IF EXISTS {deployer}")
        conn.execute(f"DROP ROLE IF EXISTS {owner}")
        conn.execute(f"CREATE ROLE {owner} LOGIN")
        conn.execute(f'GRANT CREATE, CONNECT ON DATABASE "{dbname}" TO {owner}')
        if server.version >= 16:
            conn.execute(f"CREATE ROLE {deployer} LOGIN")
            conn.execute(f"GRANT {owner} TO {deployer} WITH INHERIT TRUE, SET FALSE")
        else:
            conn.execute(f"CREATE ROLE {deployer} LOGIN NOINHERIT")
            conn.execute(f"GRANT {owner} TO {deployer}")
    try:
        pglockkit.install(make_conninfo(empty_db, user=owner))
        with pytest.raises(pglockkit.errors.NotOwner, match=f"install must run as {owner}") as refused:
            pglockkit.install(make_conninfo(empty_db, user=deployer))
        assert "may SET ROLE to it" in refused.value.hint
    finally:
        with psycopg.connect(empty_db, autocommit=True) as conn:
            conn.execute("DROP SCHEMA IF EXISTS pglockkit, pglockkit_migrations CASCADE")
            conn.execute(f"DROP OWNED BY {deployer}, {owner}")
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {deployer}, {owner}")
            conn.execute(f"DROP ROLE {deployer}")
            conn.execute(f"DROP ROLE {owner}")
