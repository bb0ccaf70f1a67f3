"""Least privilege: workers (pglockkit_user) work only through the functions, cannot take over
another worker's job or lease, and cannot change the registry or delete history; operators
(pglockkit_admin) can."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest
from psycopg import errors
from psycopg.conninfo import make_conninfo
from scenarios import cli

import pglockkit

# The login roles the shared as_role fixture (tests/conftest.py) creates: name -> group role.
ROLES = {"worker_a": "pglockkit_user", "worker_b": "pglockkit_user", "ops": "pglockkit_admin"}


def test_install_creates_the_admin_role_inside_the_user_role(db):
    assert db.conn.execute("SELECT pg_has_role('pglockkit_admin', 'pglockkit_user', 'MEMBER')").fetchone()[0]


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE pglockkit.jobs SET status = 'done'",
        "SELECT payload FROM pglockkit.jobs",
        "DELETE FROM pglockkit.leases",
        "INSERT INTO pglockkit.namespaces (id, name) VALUES (999, 'mine')",
        "UPDATE pglockkit.runs SET status = 'done'",
        "SELECT setval('pglockkit.job_tokens', 1)",
    ],
)
def test_a_worker_cannot_touch_the_tables(db, as_role, statement):
    db.conn.execute("SELECT pglockkit.enqueue_job('q', '{\"secret\": 1}')")
    before = db.conn.execute("SELECT status, token FROM pglockkit.jobs").fetchall()
    with pytest.raises(errors.InsufficientPrivilege):
        as_role("worker_a").execute(statement)
    assert db.conn.execute("SELECT status, token FROM pglockkit.jobs").fetchall() == before


def test_a_worker_cannot_complete_or_fail_a_job_it_did_not_claim(db, as_role):
    a, b = as_role("worker_a"), as_role("worker_b")
    job = a.execute("SELECT pglockkit.enqueue_job('q')").fetchone()[0]
    claimed = a.execute("SELECT id, token FROM pglockkit.claim_job('q', 'worker_a', '1 minute')").fetchone()
    assert claimed[0] == job
    token = claimed[1]
    for guess in (token - 1, token + 1, 0):
        assert b.execute("SELECT pglockkit.complete_job(%s, %s)", (job, guess)).fetchone()[0] is False
        assert b.execute("SELECT pglockkit.fail_job(%s, %s, 'hijack')", (job, guess)).fetchone()[0] == "stale"
        assert b.execute("SELECT pglockkit.extend_job(%s, %s, '1 hour')", (job, guess)).fetchone()[0] is False
        assert b.execute("SELECT pglockkit.release_job(%s, %s)", (job, guess)).fetchone()[0] is False
    row = db.conn.execute("SELECT status, token, attempt, last_error FROM pglockkit.jobs").fetchone()
    assert row == ("running", token, 1, None)
    assert a.execute("SELECT pglockkit.complete_job(%s, %s)", (job, token)).fetchone()[0] is True


def test_a_worker_cannot_renew_release_or_take_another_holders_lease(db, as_role):
    a, b = as_role("worker_a"), as_role("worker_b")
    token = a.execute("SELECT pglockkit.acquire_lease('refresh', 'worker_a', '1 minute')").fetchone()[0]
    assert (
        b.execute("SELECT pglockkit.acquire_lease('refresh', 'worker_b', '1 minute')").fetchone()[0] is None
    )
    assert (
        b.execute("SELECT pglockkit.renew_lease('refresh', 'worker_b', %s, '1 hour')", (token,)).fetchone()[0]
        is False
    )
    assert (
        b.execute("SELECT pglockkit.release_lease('refresh', 'worker_b', %s)", (token,)).fetchone()[0]
        is False
    )
    with pytest.raises(psycopg.Error) as stale:
        b.execute("SELECT pglockkit.check_fence('refresh', %s)", (token - 1,))
    assert stale.value.sqlstate == "PK001"
    row = db.conn.execute(
        "SELECT holder, token, released_at FROM pglockkit.leases WHERE name = 'refresh'"
    ).fetchone()
    assert row == ("worker_a", token, None)


@pytest.mark.parametrize(
    "call",
    [
        "pglockkit.register_namespace('mine')",
        "pglockkit.prune_jobs('0 s')",
        "pglockkit.prune_leases('0 s')",
        "pglockkit.prune_runs('0 s')",
        "pglockkit.retry_dead_jobs('q')",
        "pglockkit.sample('0 s')",
        "pglockkit.set_max_payload_bytes(4096)",
        # What every worker may claim: rate limits and pauses (each function's ACL: test_install).
        "pglockkit.set_rate_limit('q', 'k', 10, '1 s', 5), pglockkit.remove_rate_limit('q', 'k')",
        "pglockkit.pause_queue('q'), pglockkit.resume_queue('q')",
    ],
)
def test_only_the_admin_role_changes_the_registry_or_deletes_history(db, as_role, call):
    with pytest.raises(errors.InsufficientPrivilege):
        as_role("worker_a").execute(f"SELECT {call}")
    as_role("ops").execute(f"SELECT {call}")  # granted


def test_docs_name_every_admin_only_function(db):
    # docs/install.md says which functions pglockkit_admin "alone may" call: every one of them.
    text = (Path(__file__).resolve().parents[2] / "docs" / "install.md").read_text()
    admin = re.search(r"- `pglockkit_admin`.*?(?=\n- |\n\n)", text, re.S).group(0)
    named = set(re.findall(r"`([a-z_]+)`", admin))
    only = db.conn.execute(
        "SELECT array_agg(DISTINCT p.proname::text) FROM pg_proc p"
        " WHERE p.pronamespace = 'pglockkit'::regnamespace AND pglockkit._admin_only(p.proname)"
    ).fetchone()[0]
    assert len(only) >= 13 and sorted(set(only) - named) == []


def test_the_admin_role_can_do_what_workers_do(db, as_role):
    ops = as_role("ops")
    ops.execute("SELECT pglockkit.register_namespace('billing')")
    assert ops.execute("SELECT pglockkit.try_lock('billing', 'invoice:1')").fetchone()[0] is True
    job = ops.execute("SELECT pglockkit.enqueue_job('q')").fetchone()[0]
    assert ops.execute("SELECT id FROM pglockkit.claim_job('q', 'ops')").fetchone()[0] == job


def test_monitoring_alone_cannot_call_the_functions_that_write(server, db):
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS watcher")
        admin.execute("CREATE ROLE watcher LOGIN IN ROLE pg_monitor")
    try:
        with psycopg.connect(make_conninfo(db.dsn, user="watcher"), autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM pglockkit.queue_stats").fetchone()[0] == 0
            for call in (
                "pglockkit.enqueue_job('q')",
                "pglockkit.claim_job('q', 'w')",
                "pglockkit.try_lock('x', 1)",
            ):
                with pytest.raises(errors.InsufficientPrivilege):
                    conn.execute(f"SELECT {call}")
    finally:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute("DROP ROLE watcher")


def test_pglockkit_grant_gives_and_takes_back_the_roles(server, db):
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS newcomer")
        admin.execute("CREATE ROLE newcomer LOGIN")
    try:
        newcomer = make_conninfo(db.dsn, user="newcomer")
        with psycopg.connect(newcomer, autocommit=True) as conn, pytest.raises(errors.InsufficientPrivilege):
            conn.execute("SELECT pglockkit.enqueue_job('q')")
        out = cli("grant", "newcomer", "--dsn", db.dsn)
        assert out.returncode == 0 and out.stdout.strip() == "granted pglockkit_user to newcomer", out.stderr
        with psycopg.connect(newcomer, autocommit=True) as conn:
            conn.execute("SELECT pglockkit.enqueue_job('q')")
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute("SELECT pglockkit.register_namespace('theirs')")
        assert cli("grant", "newcomer", "--admin", "--dsn", db.dsn).returncode == 0
        with psycopg.connect(newcomer, autocommit=True) as conn:
            conn.execute("SELECT pglockkit.register_namespace('theirs')")
        for extra in (["--admin"], []):
            assert cli("grant", "newcomer", "--revoke", *extra, "--dsn", db.dsn).returncode == 0
        with psycopg.connect(newcomer, autocommit=True) as conn, pytest.raises(errors.InsufficientPrivilege):
            conn.execute("SELECT pglockkit.enqueue_job('q')")
    finally:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute("DROP ROLE newcomer")


@pytest.mark.parametrize("role", ["no_such_role", "pglockkit_user"])
def test_pglockkit_grant_refuses_unknown_and_group_roles(db, role):
    out = cli("grant", role, "--dsn", db.dsn)
    assert out.returncode == 2 and role in out.stderr, out.stderr


def test_the_admin_role_can_list_the_dead_jobs_it_may_retry(db, as_role):
    """pglockkit_admin is the operators' role: it alone may retry_dead_jobs(queue, ids), and
    `pglockkit doctor` tells whoever reads a dead-jobs finding to "Inspect last_error (pglockkit
    jobs QUEUE --status dead)". No role has table privileges (docs/install.md), and `pglockkit
    jobs` (queue.jobs) selects from the table pglockkit.jobs, so an operator can neither read
    last_error nor learn the ids to retry: 42501 permission denied for table jobs."""
    as_role("ops")  # creates the roles
    job = db.conn.execute("SELECT pglockkit.enqueue_job('mail', max_attempts => 1)").fetchone()[0]
    claimed = db.conn.execute("SELECT id, token FROM pglockkit.claim_job('mail', 'w')").fetchone()
    db.conn.execute("SELECT pglockkit.fail_job(%s, %s, 'smtp down')", claimed)
    out = cli("jobs", "mail", "--status", "dead", "--dsn", make_conninfo(db.dsn, user="ops"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert str(job) in out.stdout and "smtp down" in out.stdout


def test_pglockkit_grant_revoke_does_not_report_a_revoke_that_left_the_access(server, db):
    """docs/install.md: "`pglockkit grant ops --admin`; `--revoke` takes either back." An operator
    granted with --admin (a member of pglockkit_admin, which is in pglockkit_user) and then
    `pglockkit grant ops --revoke` is told "revoked pglockkit_user from ops", exit 0, while ops
    keeps every privilege of both roles: REVOKE of a membership the role does not have directly is
    only a WARNING. The command must not claim a revoke that left the role its access."""
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS leaver")
        admin.execute("CREATE ROLE leaver LOGIN")
    try:
        assert cli("grant", "leaver", "--admin", "--dsn", db.dsn).returncode == 0
        out = cli("grant", "leaver", "--revoke", "--dsn", db.dsn)
        # Asked of the owner's session: once revoked, leaver may not even look into schema pglockkit.
        enqueue = "pglockkit.enqueue_job(text,jsonb,timestamptz,int,text,int,text,int,text)"
        still = db.conn.execute(
            "SELECT has_function_privilege('leaver', %s, 'EXECUTE')", (enqueue,)
        ).fetchone()[0]
        if out.returncode == 0:
            # Reported as done: then it must be done.
            assert not still, f"{out.stdout.strip()!r}, exit 0, but leaver can still enqueue"
        else:
            assert "pglockkit_admin" in out.stderr, out.stderr
        # Plain --revoke takes the kit back, both roles (docs/install.md).
        assert (out.returncode, out.stdout.strip()) == (0, "revoked pglockkit_admin from leaver"), out.stderr
        out = cli("grant", "leaver", "--revoke", "--dsn", db.dsn)
        assert (out.returncode, out.stdout.strip()) == (0, "leaver has no pglockkit role to revoke")
    finally:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute("DROP ROLE leaver")


def test_pglockkit_grant_revoke_names_the_role_through_which_the_access_stays(server, db):
    """A role that has the kit through a group of its own (app_team, granted pglockkit_user) keeps
    it after `pglockkit grant ROLE --revoke`: exit 2, naming the group and the statements that
    take it back; what could be taken back directly is taken back and said."""
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS member_of_team")
        admin.execute("DROP ROLE IF EXISTS app_team")
        admin.execute("CREATE ROLE app_team NOLOGIN IN ROLE pglockkit_user")
        admin.execute("CREATE ROLE member_of_team LOGIN IN ROLE app_team")
    try:
        assert cli("grant", "member_of_team", "--dsn", db.dsn).returncode == 0
        out = cli("grant", "member_of_team", "--revoke", "--dsn", db.dsn)
        assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
        assert out.stderr.strip() == (
            "pglockkit grant: revoked pglockkit_user from member_of_team, but member_of_team is still a "
            'member of pglockkit_user through app_team: REVOKE "app_team" FROM "member_of_team", or '
            'REVOKE pglockkit_user FROM "app_team"'
        )
        # --admin: it never had pglockkit_admin, by any path.
        out = cli("grant", "member_of_team", "--revoke", "--admin", "--dsn", db.dsn)
        assert (out.returncode, out.stdout.strip()) == (0, "member_of_team has no pglockkit role to revoke")
    finally:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute("DROP ROLE member_of_team")
            admin.execute("DROP ROLE app_team")


def test_pglockkit_grant_to_a_noinherit_role_lets_it_use_the_kit_or_says_it_does_not(server, db):
    """README: `pglockkit grant worker` lets role worker use the kit. For a role created NOINHERIT
    it prints "granted pglockkit_user to ..." and exits 0, and the role still gets 42501
    (permission denied for schema pglockkit): the membership carries no privileges. On PostgreSQL
    16 and later GRANT ... WITH INHERIT TRUE would give them; before, the command should say so."""
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS careful")
        admin.execute("CREATE ROLE careful LOGIN NOINHERIT")
    try:
        out = cli("grant", "careful", "--dsn", db.dsn)
        with psycopg.connect(make_conninfo(db.dsn, user="careful"), autocommit=True) as conn:
            usable = conn.execute("SELECT has_schema_privilege('pglockkit', 'USAGE')").fetchone()[0]
            member = conn.execute("SELECT pg_has_role('pglockkit_user', 'MEMBER')").fetchone()[0]
        said = (out.returncode, out.stdout, out.stderr)
        assert usable or "INHERIT" in (out.stdout + out.stderr).upper(), said
        if server.version >= 16:  # GRANT ... WITH INHERIT TRUE
            assert usable and out.returncode == 0, said
            assert out.stdout.strip() == "granted pglockkit_user to careful"
        else:  # refused, nothing granted, and what to do
            assert out.returncode == 2 and not member, said
            assert "pglockkit grant: role 'careful' is NOINHERIT" in out.stderr
            assert 'ALTER ROLE "careful" INHERIT' in out.stderr and "SET ROLE pglockkit_user" in out.stderr
    finally:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute("DROP ROLE careful")


def test_install_again_as_a_worker_role_is_a_no_op_or_names_the_installing_role(db, as_role):
    """docs/install.md: "Running `install` again is a no-op", and many pods may run it at once:
    pods run as their app role, a pglockkit_user member. On an up-to-date database that role gets
    `pglockkit: error [42501]: permission denied for database tests` (it first runs CREATE SCHEMA IF
    NOT EXISTS for the migration state; with CREATE on the database it fails next on schema
    pglockkit_migrations): nothing says that install must run as the role that owns the kit."""
    as_role("worker_a")
    owner = db.conn.execute("SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pglockkit'")
    owner = owner.fetchone()[0]
    out = cli("install", "--dsn", make_conninfo(db.dsn, user="worker_a"))
    assert out.returncode == 0 or owner in out.stderr, out.stderr
    assert out.stderr.startswith(
        f"pglockkit: error [42501]: install must run as {owner} (the role that owns schema pglockkit), "
        "not as worker_a"
    ), out.stderr
    # status reads the owner's migration state: the same clear refusal, not a bare 42501.
    out = cli("status", "--dsn", make_conninfo(db.dsn, user="worker_a"))
    assert out.returncode == 1
    assert out.stderr.startswith(f"pglockkit: error [42501]: status must run as {owner} "), out.stderr
    with pytest.raises(pglockkit.NotOwner) as raised:
        pglockkit.install(make_conninfo(db.dsn, user="worker_a"))
    assert raised.value.sqlstate == "42501"
    # The owner still installs (a no-op).
    assert cli("install", "--dsn", db.dsn).returncode == 0
