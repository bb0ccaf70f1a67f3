"""Monitoring views against real servers: planted holders, waiters, chains and idle leaks show up
with their namespace; unprivileged monitoring roles can read them."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from scenarios import cli

import pglockkit
from pglockkit import lock_key, monitor, namespace_id


def _wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _wait_until_blocked(db, pid):
    _wait_until(
        lambda: (
            db.conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'", (pid,)
            ).fetchone()[0]
            == 1
        )
    )


def _blocked_waiter(db, sql, params=()):
    """A connection that runs `sql` in a thread (it blocks); returns (conn, thread)."""
    conn = db.connect()
    conn.execute("SET application_name = 'planted waiter'")
    thread = threading.Thread(target=lambda: conn.execute(sql, params), daemon=True)
    thread.start()
    _wait_until_blocked(db, conn.info.backend_pid)
    return conn, thread


def test_idle_holder_and_waiter_are_named(db, ns):
    with db.connect() as holder:
        holder.execute("SET application_name = 'planted holder'")
        holder.execute("SELECT pglockkit.try_lock(%s, 'restock_plan')", (ns,))
        # The holder now idles with a session lock: the pooled-connection leak.
        rows = db.conn.execute(
            "SELECT namespace, key, pid, application_name, state FROM pglockkit.idle_lock_holders"
        ).fetchall()
        key = lock_key(namespace_id(ns), "restock_plan")
        assert rows == [(ns, key, holder.info.backend_pid, "planted holder", "idle")]

        waiter, thread = _blocked_waiter(
            db, "SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'restock_plan'))", (ns,)
        )
        first = db.conn.execute(
            "SELECT granted, blocked_by, wait_time, namespace FROM pglockkit.advisory_locks WHERE pid = %s",
            (waiter.info.backend_pid,),
        ).fetchone()
        assert first[0] is False and first[1] == [holder.info.backend_pid] and first[3] == ns
        time.sleep(0.2)
        later = db.conn.execute(
            "SELECT wait_time FROM pglockkit.advisory_locks WHERE pid = %s", (waiter.info.backend_pid,)
        ).fetchone()[0]
        assert later > first[2]  # the wait grows
        wait = db.conn.execute(
            "SELECT blocked_by, root_blocker, locktype, namespace FROM pglockkit.lock_waits WHERE pid = %s",
            (waiter.info.backend_pid,),
        ).fetchone()
        assert wait == ([holder.info.backend_pid], holder.info.backend_pid, "advisory", ns)
        stats = db.conn.execute(
            "SELECT locks_held, waiters FROM pglockkit.namespace_stats WHERE namespace = %s", (ns,)
        ).fetchone()
        assert stats == (1, 1)
        holder.execute("SELECT pglockkit.unlock(%s, 'restock_plan')", (ns,))
        thread.join(5)
        waiter.close()


def test_chain_of_three_has_one_root_with_two_behind(db, ns):
    with db.connect() as a, db.connect() as b:
        a.execute("SELECT pglockkit.try_lock(%s, 'k1')", (ns,))
        b.execute("SELECT pglockkit.try_lock(%s, 'k2')", (ns,))
        # b waits on k1 (held by a); c waits on k2 (held by b).
        thread_b = threading.Thread(
            target=lambda: b.execute("SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'k1'))", (ns,)),
            daemon=True,
        )
        thread_b.start()
        _wait_until_blocked(db, b.info.backend_pid)
        c, thread_c = _blocked_waiter(db, "SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'k2'))", (ns,))
        rows = db.conn.execute(
            "SELECT pid, root_blocker, sessions_behind_root FROM pglockkit.lock_waits ORDER BY pid"
        ).fetchall()
        assert sorted(rows) == sorted(
            [(b.info.backend_pid, a.info.backend_pid, 2), (c.info.backend_pid, a.info.backend_pid, 2)]
        )
        a.execute("SELECT pg_advisory_unlock_all()")
        thread_b.join(5)
        b.execute("SELECT pg_advisory_unlock_all()")
        thread_c.join(5)
        c.close()


def test_key_forms_and_labels(db, ns):
    with db.connect() as conn:
        conn.execute("SELECT pg_advisory_lock(1, -2), pg_advisory_lock(-5), pg_advisory_lock(72707369)")
        conn.execute("SELECT pglockkit.try_lock(%s, 42)", (ns,))
        rows = db.conn.execute(
            "SELECT namespace, key, key1, key2 FROM pglockkit.advisory_locks WHERE pid = %s",
            (conn.info.backend_pid,),
        ).fetchall()
    assert sorted(rows, key=str) == sorted(
        [
            ("int4 pair", None, 1, -2),
            ("unregistered", -5, None, None),
            ("flyway", 72707369, None, None),
            (ns, lock_key(namespace_id(ns), 42), None, None),
        ],
        key=str,
    )


def test_monitoring_roles_can_read_and_others_cannot(server, db, ns):
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        for role in ("mon_only", "kit_only", "nobody"):
            admin.execute(f"DROP ROLE IF EXISTS {role}")
            admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute("GRANT pg_monitor TO mon_only")
        admin.execute("GRANT pglockkit_user TO kit_only")
    with db.connect() as holder:
        holder.execute("SELECT pglockkit.try_lock(%s, 'planted')", (ns,))
        for role in ("mon_only", "kit_only"):
            with psycopg.connect(make_conninfo(db.dsn, user=role), autocommit=True) as conn:
                for view in (
                    "advisory_locks",
                    "lock_waits",
                    "idle_lock_holders",
                    "namespace_stats",
                    "table_health",
                    "xmin_horizon",
                    "lock_history",
                    "queue_history",
                ):
                    conn.execute(f"SELECT * FROM pglockkit.{view}").fetchall()
                conn.execute("SELECT * FROM pglockkit.contention_report('1 hour')").fetchall()
                rows = conn.execute("SELECT namespace, pid FROM pglockkit.advisory_locks").fetchall()
                assert (ns, holder.info.backend_pid) in rows, role
        with psycopg.connect(make_conninfo(db.dsn, user="nobody"), autocommit=True) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT * FROM pglockkit.advisory_locks")


def test_doctor_finds_each_planted_hazard_and_exits_nonzero(db, ns):
    with db.connect() as leaky:
        leaky_pid = leaky.info.backend_pid
        leaky.execute("SET application_name = 'leaky pool'")
        leaky.execute("SELECT pglockkit.try_lock(%s, 'report')", (ns,))  # idle session lock
        leaky.execute("SELECT pg_advisory_lock(987654321)")  # a key outside every namespace
        job = db.conn.execute("SELECT pglockkit.enqueue_job('mail', max_attempts => 1)").fetchone()[0]
        claimed = db.conn.execute("SELECT id, token FROM pglockkit.claim_job('mail', 'w')").fetchone()
        db.conn.execute("SELECT pglockkit.fail_job(%s, %s, 'smtp down')", claimed)  # dead
        db.conn.execute("SELECT pglockkit.acquire_lease('refresh', 'gone', '10 ms')")
        time.sleep(0.05)
        out = cli("doctor", "--dsn", db.dsn, "--idle-after", "0s")
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert f"pid {leaky_pid} (leaky pool) holds advisory lock {ns}/" in text
    assert "[WARNING] unregistered advisory keys: 1 advisory lock(s)" in text
    assert "[WARNING] dead jobs: queue mail: 1 dead job(s)" in text and job == claimed[0]
    assert "[INFO] expired lease: lease refresh (holder gone" in text
    assert "fix: " in text


def test_doctor_on_a_clean_database_reports_nothing_to_fix(db):
    """A database set up as the docs advise: a lock_timeout, and sample() running. Without the
    sampler, the one note is that hold times are unknown."""
    db.conn.execute(
        sql.SQL("ALTER DATABASE {} SET lock_timeout = '5s'").format(sql.Identifier(db.conn.info.dbname))
    )
    out = cli("doctor", "--dsn", db.dsn, "--fail-on", "info")
    never = "[INFO] sampling: sample() has never run"
    assert out.returncode == 1 and out.stdout.startswith(never), out.stdout
    assert out.stdout.strip().endswith("1 info"), out.stdout
    db.conn.execute("SELECT pglockkit.sample()")
    out = cli("doctor", "--dsn", db.dsn, "--fail-on", "info")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "pglockkit doctor: no findings"


def test_top_once_shows_holder_waiter_and_chain(db, ns):
    with db.connect() as holder:
        holder.execute("SELECT pglockkit.try_lock(%s, 'restock_plan')", (ns,))
        waiter, thread = _blocked_waiter(
            db, "SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'restock_plan'))", (ns,)
        )
        db.conn.execute("SELECT pglockkit.enqueue_job('emails')")
        out = cli("top", "--once", "--dsn", db.dsn)
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert f"{holder.info.backend_pid} HOLD" in text and f"{waiter.info.backend_pid} WAIT" in text
        assert f"blocked by {holder.info.backend_pid}" in text
        assert f"root pid {holder.info.backend_pid}: 1 session(s) behind" in text
        assert "emails" in text
        # Without a terminal (as over a pipe) the frame is 80 columns wide.
        assert max(len(line) for line in out.stdout.splitlines()) <= 80
        holder.execute("SELECT pglockkit.unlock(%s, 'restock_plan')", (ns,))
        thread.join(5)
        waiter.close()


def test_top_shows_rate_limits_and_lists_only_live_leases(db):
    """A throttled key shows with its due jobs and when it may next start one; leases that are
    released or expired are counted, not listed (a service that took many names would fill the
    screen with them), and the live one shows who holds it."""
    conn = db.conn
    conn.execute("SELECT pglockkit.set_rate_limit('emails', 'smtp', 2, '1 minute')")
    conn.execute("SELECT pglockkit.set_rate_limit('emails', 'idle-key', 5, '1 second', 3)")
    conn.execute("SELECT pglockkit.enqueue_job('emails', rate_key => 'smtp') FROM generate_series(1, 5)")
    assert len(conn.execute("SELECT * FROM pglockkit.claim_job('emails', 'w', batch => 5)").fetchall()) == 1
    conn.execute("SELECT pglockkit.acquire_lease('nightly-refresh', 'pod-7', '1 hour')")
    for name in ("old-1", "old-2"):
        token = conn.execute("SELECT pglockkit.acquire_lease(%s, 'pod-1', '1 hour')", (name,)).fetchone()[0]
        assert conn.execute("SELECT pglockkit.release_lease(%s, 'pod-1', %s)", (name, token)).fetchone()[0]
    conn.execute("SELECT pglockkit.acquire_lease('lapsed', 'pod-2', '1 millisecond')")
    time.sleep(0.01)
    out = cli("top", "--once", "--dsn", db.dsn)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "RATE LIMITS (2)" in lines
    smtp = lines[lines.index("RATE LIMITS (2)") + 2].split()  # throttled keys first
    assert smtp[:6] == ["emails", "smtp", "2/60s", "1", "0", "4"], smtp  # no token left, 4 jobs due
    assert smtp[6].endswith("s") and 0 < float(smtp[6][:-1]) <= 30.0, smtp  # its next start
    idle = lines[lines.index("RATE LIMITS (2)") + 3].split()
    assert idle == ["emails", "idle-key", "5/1s", "3", "3", "0", "now"], idle
    assert "LEASES (1 live, 3 free)" in lines
    listed = lines[lines.index("LEASES (1 live, 3 free)") + 2 :]
    assert len(listed) == 1 and listed[0].split()[:3] == ["nightly-refresh", "pod-7", "1"], listed
    assert max(len(line) for line in lines) <= 80


def test_xmin_horizon_names_the_session_that_pins_vacuum(db):
    with db.connect() as pinning:
        pinning.execute("SET application_name = 'forgotten transaction'")
        pinning.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        pinning.execute("SELECT count(*) FROM pglockkit.jobs")  # takes a snapshot, then idles
        db.conn.execute("SELECT pglockkit.enqueue_job('q')")  # advance the xid counter
        rows = db.conn.execute(
            "SELECT kind, holder, application_name, state FROM pglockkit.xmin_horizon ORDER BY xmin_age DESC"
        ).fetchall()
        assert (
            "session",
            str(pinning.info.backend_pid),
            "forgotten transaction",
            "idle in transaction",
        ) in rows
        out = cli("doctor", "--dsn", db.dsn, "--lag-after", "0s")
        assert f"xmin horizon: session {pinning.info.backend_pid} (forgotten transaction) holds" in out.stdout
        pinning.execute("ROLLBACK")


def test_table_health_counts_dead_rows_of_the_queue(db):
    db.conn.execute("SELECT pglockkit.enqueue_jobs('q', array_agg('{}'::jsonb)) FROM generate_series(1, 200)")
    db.conn.execute("DELETE FROM pglockkit.jobs")
    db.conn.execute("SELECT pg_stat_force_next_flush()")
    deadline = time.monotonic() + 5
    while True:
        db.conn.execute("SELECT pg_stat_clear_snapshot()")
        row = db.conn.execute(
            "SELECT dead_rows, dead_ratio, total_bytes > 0 FROM pglockkit.table_health "
            "WHERE table_name = 'jobs'"
        ).fetchone()
        if row[0] >= 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert row[0] >= 200 and row[1] > 0.5 and row[2]


def test_contention_report_names_the_key_that_serialized_the_swarm(db, ns):
    with db.connect() as holder:
        holder.execute("SET application_name = 'slow refresh'")
        holder.execute("SELECT pglockkit.try_lock(%s, 'shared-cache')", (ns,))
        holder.execute("SELECT 'refresh the shared cache'")  # its last query, shown as the holder's
        waiters = [
            _blocked_waiter(db, "SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'shared-cache'))", (ns,))
            for _ in range(3)
        ]
        out = cli("sample", "--dsn", db.dsn, "--every", "100ms", "--count", "2")
        assert out.returncode == 0, out.stderr
        row = db.conn.execute(
            "SELECT key, samples, samples_with_waiters, max_waiters, holder_queries, namespace_sessions, "
            "namespace_parallelism FROM pglockkit.contention_report('1 hour') WHERE namespace = %s",
            (ns,),
        ).fetchone()
        assert row[0] == lock_key(namespace_id(ns), "shared-cache")
        assert row[1:4] == (2, 2, 3)
        assert row[4] == ["SELECT 'refresh the shared cache'"]
        assert row[5] == 4 and float(row[6]) == 0.25  # four sessions, one of them working
        holder.execute("SELECT pg_advisory_unlock_all()")
        for conn, thread in waiters:
            thread.join(5)
            conn.execute("SELECT pg_advisory_unlock_all()")
            conn.close()
    # Retention: a zero retention keeps only the newest sample's rows.
    db.conn.execute("SELECT pglockkit.sample('0')")
    assert db.conn.execute("SELECT count(DISTINCT sampled_at) FROM pglockkit.lock_samples").fetchone()[0] <= 1


@pytest.mark.parametrize(("arg", "sqlstate"), [("NULL", "22004"), ("'-1 day'", "22023")])
def test_sample_bad_input(db, arg, sqlstate):
    with pytest.raises(psycopg.Error) as err:
        db.conn.execute(f"SELECT pglockkit.sample({arg})")
    assert err.value.sqlstate == sqlstate


def _roles_named_for_lock_timeout(text: str) -> set[str]:
    return {line.split()[3] for line in text.splitlines() if line.startswith("[INFO] lock_timeout: role ")}


def test_doctor_names_worker_roles_without_lock_timeout(server, db):
    dbname = db.conn.info.dbname
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        for role in ("lt_none", "lt_role", "lt_here", "lt_zero"):
            admin.execute(f"DROP ROLE IF EXISTS {role}")
            admin.execute(f"CREATE ROLE {role} LOGIN IN ROLE pglockkit_user")
        admin.execute("ALTER ROLE lt_role SET lock_timeout = '5s'")  # everywhere
        admin.execute(
            sql.SQL("ALTER ROLE lt_here IN DATABASE {} SET lock_timeout = 3000").format(
                sql.Identifier(dbname)
            )
        )
        # The database gives 5s to everyone, but this role's own setting wins at login: 0.
        admin.execute(sql.SQL("ALTER DATABASE {} SET lock_timeout = '5s'").format(sql.Identifier(dbname)))
        admin.execute("ALTER ROLE lt_zero SET lock_timeout = 0")
        admin.execute("ALTER ROLE lt_none SET work_mem = '8MB'")  # a setting, but not this one
    try:
        out = cli("doctor", "--dsn", db.dsn, "--fail-on", "info")
        assert out.returncode == 1, out.stdout + out.stderr
        named = _roles_named_for_lock_timeout(out.stdout)
        assert {"lt_zero"} <= named and not {"lt_role", "lt_here", "lt_none"} & named, out.stdout
        assert 'ALTER ROLE "lt_zero" IN DATABASE' in out.stdout
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute(sql.SQL("ALTER DATABASE {} RESET lock_timeout").format(sql.Identifier(dbname)))
        out = cli("doctor", "--dsn", db.dsn, "--fail-on", "info")
        named = _roles_named_for_lock_timeout(out.stdout)
        assert {"lt_zero", "lt_none"} <= named and not {"lt_role", "lt_here"} & named, out.stdout
    finally:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            for role in ("lt_none", "lt_role", "lt_here", "lt_zero"):
                admin.execute(f"DROP OWNED BY {role}")
                admin.execute(f"DROP ROLE {role}")


def test_doctor_finds_queue_lag_expired_job_leases_and_lock_table_pressure(db):
    db.conn.execute("SELECT pglockkit.enqueue_job('slow', run_at => now() - interval '10 minutes')")
    db.conn.execute("SELECT pglockkit.enqueue_job('stuck')")
    db.conn.execute("SELECT pglockkit.claim_job('stuck', 'gone', '10 ms')")  # its worker never returns
    capacity = db.conn.execute(
        "SELECT current_setting('max_locks_per_transaction')::int * (current_setting('max_connections')::int"
        " + current_setting('max_prepared_transactions')::int)"
    ).fetchone()[0]
    with db.connect() as hoarder:
        hoarder.execute(
            "SELECT count(pg_advisory_lock(i)) FROM generate_series(1, %s) i", (capacity // 2 + 100,)
        )
        time.sleep(0.05)
        out = cli("doctor", "--dsn", db.dsn, "--lag-after", "5m")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[WARNING] queue lag: queue slow: the oldest ready job has waited 10.0m" in out.stdout, out.stdout
    assert "[INFO] expired job leases: queue stuck: 1 running job(s) past their lease" in out.stdout
    assert "[WARNING] lock table headroom:" in out.stdout
    # With the hoarder gone, the lock table finding goes too.
    assert "lock table headroom" not in cli("doctor", "--dsn", db.dsn).stdout


# --- who may read whose queries ------------------------------------------------------------------

# Login roles for the visibility tests: a plain worker, an operator (runs sample()), a role whose
# own sessions hold locks, a member of that role, and a member of pg_read_all_stats.
ROLES = {  # for the as_role fixture; a role may be in one listed before it
    "vis_worker": "pglockkit_user",
    "vis_ops": "pglockkit_admin",
    "vis_app": "pglockkit_user",
    "vis_app_peer": "pglockkit_user, vis_app",
    "vis_stats": "pglockkit_user, pg_read_all_stats",
    "vis_monitor": "pg_monitor",
}


def _queries(conn, sql, params=()):
    return {q for (q,) in conn.execute(sql, params).fetchall() if q is not None}


def test_history_shows_a_reader_only_the_queries_the_live_view_shows_them(db, as_role):
    """sample() runs as the installer and sees every query; lock_history and contention_report
    must still show each reader only what advisory_locks shows them live (pg_stat_activity's rule:
    the holder's role's privileges, or pg_read_all_stats)."""
    db.conn.execute("SELECT pglockkit.register_namespace('app')")
    with db.connect() as root_holder, as_role("vis_app") as app_holder:
        root_holder.execute("SELECT pg_advisory_lock(pglockkit.lock_key('app', 'x')), 'root secret: hunter2'")
        app_holder.execute("SELECT pg_advisory_lock(pglockkit.lock_key('app', 'y')), 'app secret: swordfish'")
        pids = [root_holder.info.backend_pid, app_holder.info.backend_pid]
        assert as_role("vis_ops").execute("SELECT pglockkit.sample()").fetchone()[0] == 2

        seen = {}
        for role in ROLES:
            reader = as_role(role)
            live = _queries(reader, "SELECT query FROM pglockkit.advisory_locks WHERE pid = ANY(%s)", (pids,))
            history = _queries(
                reader,
                "SELECT q FROM pglockkit.lock_history, unnest(holder_queries) q WHERE namespace = 'app'",
            )
            report = _queries(
                reader,
                "SELECT q FROM pglockkit.contention_report('1 hour'), unnest(holder_queries) q "
                "WHERE namespace = 'app'",
            )
            assert history == live, role
            assert report == live, role
            seen[role] = history
        hidden = "<insufficient privilege>"
        root_q = "SELECT pg_advisory_lock(pglockkit.lock_key('app', 'x')), 'root secret: hunter2'"
        app_q = "SELECT pg_advisory_lock(pglockkit.lock_key('app', 'y')), 'app secret: swordfish'"
        assert seen == {
            "vis_worker": {hidden},
            "vis_ops": {hidden},
            "vis_app": {hidden, app_q},
            "vis_app_peer": {hidden, app_q},
            "vis_stats": {root_q, app_q},
            "vis_monitor": {root_q, app_q},  # pg_monitor has pg_read_all_stats
        }
        # The installer (a superuser here) still reads everything.
        assert _queries(db.conn, "SELECT q FROM pglockkit.lock_history, unnest(holder_queries) q") == {
            root_q,
            app_q,
        }
    # A sample without holder roles: only pg_read_all_stats reads its queries.
    db.conn.execute(
        "INSERT INTO pglockkit.lock_samples (sampled_at, namespace, holders, waiters, holder_queries) "
        "VALUES (now(), 'old', 1, 0, ARRAY['old secret'])"
    )
    old = "SELECT q FROM pglockkit.lock_history, unnest(holder_queries) q WHERE namespace = 'old'"
    assert _queries(as_role("vis_app"), old) == {"<insufficient privilege>"}
    assert _queries(as_role("vis_stats"), old) == {"old secret"}


def test_advisory_locks_shows_user_and_hides_state_and_query_of_unseen_sessions(db, as_role):
    """What docs/monitoring.md and the view's comment promise for a session the reader may not see: its
    user and application are shown, its state and client are NULL, its query reads
    <insufficient privilege> (as in pg_stat_activity); a reader who may see it gets everything."""
    db.conn.execute("SELECT pglockkit.register_namespace('app')")
    su = db.conn.execute("SELECT current_user").fetchone()[0]
    with db.connect() as holder:
        holder.execute("SET application_name = 'root holder'")
        holder.execute("SELECT pg_advisory_lock(pglockkit.lock_key('app', 'x')), 'root secret'")
        cols = 'namespace, "user", application_name, client_addr, state, state_age, query'
        sql_ = f"SELECT {cols} FROM pglockkit.advisory_locks WHERE pid = %s"
        pid = holder.info.backend_pid
        row = as_role("vis_worker").execute(sql_, (pid,)).fetchone()
        assert row == ("app", su, "root holder", None, None, None, "<insufficient privilege>")
        row = as_role("vis_stats").execute(sql_, (pid,)).fetchone()
        assert row[:3] == ("app", su, "root holder") and row[4] == "idle" and row[5] is not None
        assert "root secret" in row[6]
    comment = db.conn.execute("SELECT obj_description('pglockkit.advisory_locks'::regclass)").fetchone()[0]
    assert "<insufficient privilege>" in comment and "NULL" in comment


def test_lock_waits_shows_another_roles_waiter_to_a_pglockkit_user(db, ns, as_role):
    """docs/monitoring.md: every lock is listed for every reader, and a role with only
    pglockkit_user reads every view and sees the planted locks. advisory_locks lists the waiter
    (from pg_locks); lock_waits must list it too, not only to pg_monitor members: otherwise
    `pglockkit top` shows a WAIT row with an empty LOCK WAITS section, and the
    pglockkit_lock_waits metrics (sql/postgres_exporter.yaml: "pg_monitor (or pglockkit_user)")
    stay 0."""
    reader = as_role("vis_worker")
    with db.connect() as holder:
        holder.execute("SELECT pglockkit.try_lock(%s, 'restock_plan')", (ns,))
        waiter, thread = _blocked_waiter(
            db, "SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'restock_plan'))", (ns,)
        )
        seen_locks = reader.execute(
            "SELECT granted, blocked_by FROM pglockkit.advisory_locks WHERE pid = %s",
            (waiter.info.backend_pid,),
        ).fetchall()
        assert seen_locks == [(False, [holder.info.backend_pid])]  # the lock is listed for this reader
        seen_waits = reader.execute(
            "SELECT pid, root_blocker, namespace FROM pglockkit.lock_waits"
        ).fetchall()
        expected = [(waiter.info.backend_pid, holder.info.backend_pid, ns)]
        holder.execute("SELECT pglockkit.unlock(%s, 'restock_plan')", (ns,))
        thread.join(5)
        waiter.close()
    assert seen_waits == expected


def test_lock_waits_does_not_label_another_databases_waits_with_this_registry(server, db, ns):
    """lock_waits reads pg_stat_activity and pg_locks of the whole server, but decodes advisory
    keys with this database's namespace registry and relation OIDs with this database's catalog.
    A wait in another database (where `graphs` means nothing, or pglockkit is not installed) must
    not be reported here as a wait on this database's `graphs` namespace; advisory_locks, which
    keeps to this database, does not list it."""
    other = server.dsn(server.create_database())
    key = lock_key(namespace_id(ns), "restock_plan")  # the same bigint, taken in the other database
    with psycopg.connect(other, autocommit=True) as holder, psycopg.connect(other, autocommit=True) as waiter:
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        thread = threading.Thread(
            target=lambda: waiter.execute("SELECT pg_advisory_lock(%s)", (key,)), daemon=True
        )
        thread.start()
        _wait_until_blocked(db, waiter.info.backend_pid)
        here = db.conn.execute(
            "SELECT namespace FROM pglockkit.lock_waits WHERE pid = %s", (waiter.info.backend_pid,)
        ).fetchall()
        listed = db.conn.execute(
            "SELECT count(*) FROM pglockkit.advisory_locks WHERE pid = %s", (waiter.info.backend_pid,)
        ).fetchone()[0]
        holder.execute("SELECT pg_advisory_unlock_all()")
        thread.join(5)
    assert listed == 0
    assert (ns,) not in here, f"a wait in another database shown as a wait on namespace {ns}: {here}"


def test_a_prepared_transaction_that_blocks_sessions_is_named_by_the_views_top_and_doctor(db, ns, as_role):
    """A prepared transaction (two-phase commit, as XA transaction managers use) keeps its locks
    until COMMIT/ROLLBACK PREPARED, with no session: pg_locks shows pid NULL, and
    pg_blocking_pids names it 0. Nothing ends it by itself, so the operator must learn which
    one to finish: advisory_locks names its gid, lock_waits the gids that block each waiter (not
    a third one that blocks nobody), `top` prints them (it once crashed on the NULL pid) and
    `doctor` reports them as an error with the statements that end them. A pg_monitor member
    reads the same."""
    db.conn.execute("CREATE TABLE orders (id int PRIMARY KEY, state text)")
    db.conn.execute("INSERT INTO orders VALUES (1, 'new'), (2, 'new')")
    prepared = []
    waiters = []
    try:
        for gid, statement in [
            ("xa-1", f"SELECT pg_advisory_xact_lock(pglockkit.lock_key('{ns}', 'restock_plan'))"),
            ("xa-'2'", "UPDATE orders SET state = 'paid' WHERE id = 1"),
            ("xa-3", "UPDATE orders SET state = 'paid' WHERE id = 2"),  # blocks nobody
        ]:
            with db.connect() as conn:
                conn.execute("BEGIN")
                conn.execute(statement)
                conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(gid))
            prepared.append(gid)
        rows = db.conn.execute(
            "SELECT namespace, granted, pid, prepared_gid FROM pglockkit.advisory_locks"
        ).fetchall()
        assert rows == [(ns, True, None, "xa-1")]
        waiters.append(
            _blocked_waiter(db, "SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'restock_plan'))", (ns,))
        )
        waiters.append(_blocked_waiter(db, "UPDATE orders SET state = 'shipped' WHERE id = 1"))
        pids = [w.info.backend_pid for w, _ in waiters]
        query = (
            "SELECT pid, blocked_by, root_blocker, prepared_blockers FROM pglockkit.lock_waits ORDER BY pid"
        )
        expected = sorted([(pids[0], [0], 0, ["xa-1"]), (pids[1], [0], 0, ["xa-'2'"])])
        assert db.conn.execute(query).fetchall() == expected
        assert as_role("vis_monitor").execute(query).fetchall() == expected
        top = cli("top", "--once", "--dsn", db.dsn)
        doctor = cli("doctor", "--dsn", db.dsn)
    finally:
        for gid in prepared:
            db.conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(gid))
        for conn, thread in waiters:
            thread.join(5)
            conn.close()
    assert top.returncode == 0, top.stderr[-600:]
    assert "ADVISORY LOCKS (2)" in top.stdout and ns in top.stdout
    assert "2PC HOLD prepared" in top.stdout and "prepared transaction 'xa-1'" in top.stdout, top.stdout
    assert "root: prepared transaction 'xa-''2''', 'xa-1': 2 session(s) behind" in top.stdout, top.stdout
    assert f"pid {pids[0]} waits" in top.stdout
    assert "(blocked by prepared transaction 'xa-1')" in top.stdout
    assert f"pid {pids[1]} waits" in top.stdout  # on transactionid: its line is cut at 80 columns
    assert "xa-3" not in top.stdout
    finding = "[ERROR] prepared transaction blocks sessions: prepared transaction 'xa-1' holds locks that 1"
    assert finding in doctor.stdout, doctor.stdout
    assert "ROLLBACK PREPARED 'xa-''2''';" in doctor.stdout and "xa-3" not in doctor.stdout


def test_every_view_with_a_query_hides_another_roles_query_from_a_worker(db, ns, as_role):
    """docs/monitoring.md: the session details follow pg_stat_activity's rule in every view. A
    vis_app session pins the xmin horizon and holds a session lock while idle in transaction, and
    another vis_app session waits behind it; a plain worker (vis_worker) sees them listed in
    xmin_horizon and lock_waits but never their queries, and idle_lock_holders leaves them out;
    a member of vis_app (vis_app_peer) reads the queries."""
    holder = as_role("vis_app")
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'x')), 'secret: hunter2'", (ns,))
    waiter = as_role("vis_app")
    thread = threading.Thread(
        target=lambda: waiter.execute(
            "SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'x')), 'secret: swordfish'", (ns,)
        ),
        daemon=True,
    )
    thread.start()
    _wait_until_blocked(db, waiter.info.backend_pid)
    pids = [holder.info.backend_pid, waiter.info.backend_pid]
    try:
        views = {
            "xmin_horizon": "SELECT query FROM pglockkit.xmin_horizon WHERE holder = %s",
            "lock_waits": "SELECT query FROM pglockkit.lock_waits WHERE pid = %s",
            "advisory_locks": "SELECT query FROM pglockkit.advisory_locks WHERE pid = %s",
            "idle_lock_holders": "SELECT last_query FROM pglockkit.idle_lock_holders WHERE pid = %s",
        }
        pid_of = {
            "xmin_horizon": str(pids[0]),
            "lock_waits": pids[1],
            "advisory_locks": pids[0],
            "idle_lock_holders": pids[0],
        }
        worker, peer = as_role("vis_worker"), as_role("vis_app_peer")
        seen_by_worker = {v: worker.execute(sql, (pid_of[v],)).fetchall() for v, sql in views.items()}
        seen_by_peer = {v: peer.execute(sql, (pid_of[v],)).fetchall() for v, sql in views.items()}
    finally:
        holder.execute("ROLLBACK")
        holder.execute("SELECT pg_advisory_unlock_all()")
        thread.join(5)
    hidden = [("<insufficient privilege>",)]
    assert seen_by_worker == {
        "xmin_horizon": hidden,
        "lock_waits": hidden,
        "advisory_locks": hidden,
        "idle_lock_holders": [],
    }
    assert all(rows and "secret" in rows[0][0] for rows in seen_by_peer.values()), seen_by_peer


def test_a_pg_monitor_role_reads_every_view(server, db):
    """docs/install.md: "pg_monitor may read the registry and the views"; docs/monitoring.md: a
    role with only pg_monitor "can read every view". run_history calls _advisory_held (and
    _run_key) with its reader's rights, and pg_monitor may not execute them: `pglockkit runs` as
    the exporter's role fails with 42501 permission denied for function _advisory_held."""
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS mon_views")
        admin.execute("CREATE ROLE mon_views LOGIN IN ROLE pg_monitor")
    run = db.conn.execute("SELECT pglockkit.start_run('nightly', '2026-01-01', 'pod-a')").fetchone()[0]
    try:
        db.conn.execute("SELECT pglockkit.acquire_lease('refresh', 'pod-a', '1 minute')")
        db.conn.execute("SELECT pglockkit.enqueue_job('q')")
        views = [
            r[0]
            for r in db.conn.execute(
                "SELECT c.relname FROM pg_class c"
                " WHERE c.relnamespace = 'pglockkit'::regnamespace AND c.relkind = 'v' ORDER BY 1"
            )
        ]
        assert "run_history" in views
        failed = {}
        with psycopg.connect(make_conninfo(db.dsn, user="mon_views"), autocommit=True) as conn:
            for view in views:
                try:
                    conn.execute(f"SELECT * FROM pglockkit.{view}").fetchall()
                except psycopg.errors.InsufficientPrivilege as exc:
                    failed[view] = str(exc).splitlines()[0]
            assert failed == {}
            assert conn.execute(
                "SELECT status FROM pglockkit.run_history WHERE id = %s", (run,)
            ).fetchone() == ("running",)
        out = cli("runs", "--dsn", make_conninfo(db.dsn, user="mon_views"))
        assert out.returncode == 0 and "nightly" in out.stdout, out.stderr
    finally:
        db.conn.execute("SELECT pglockkit.finish_run(%s, true)", (run,))
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute("DROP ROLE mon_views")


def test_doctor_does_not_call_a_live_sole_writer_run_once_or_lease_a_leaked_pool_lock(db, ns):
    """sole_writer, run_once and a session-bound Lease hold their session lock on an idle, direct
    connection for the whole block, by design. doctor reported each as "a session lock left on a
    pooled connection?" and proposed pg_terminate_backend of it, which would free the lock mid-run
    and let a second replica run the tick; the exporter's idle-holder gauge (and with it the
    PglockkitIdleLockHolder alert) counted them the same way, for every nightly job longer than a
    minute. They are a note, flagged `dedicated` in idle_lock_holders; a leak still warns."""
    with (
        pglockkit.sole_writer(db.dsn, ns, "restock_plan") as mine,
        pglockkit.run_once(db.dsn, "nightly") as run,
        pglockkit.Lease(db.dsn, "refresh", ttl=30, bind_session=True) as lease,
        db.connect() as leaker,
    ):
        assert mine and run is not None and lease.acquired
        leaker.execute("SELECT pglockkit.try_lock(%s, 'leaked')", (ns,))  # then idles: a leak
        time.sleep(1.5)  # the block, longer than idle_after
        findings = monitor.doctor(db.conn, idle_after=timedelta(seconds=1))
        flags = db.conn.execute(
            "SELECT application_name, dedicated FROM pglockkit.idle_lock_holders ORDER BY 1"
        ).fetchall()
    leaks = [f for f in findings if f.check == "idle lock holder"]
    key = lock_key(namespace_id(ns), "leaked")
    assert len(leaks) == 1 and f"holds advisory lock {ns}/{key} while idle" in leaks[0].message, leaks
    notes = [f.message.split(" holds ")[0] for f in findings if f.check == "dedicated lock holder"]
    assert sorted(n.split(" (", 1)[1] for n in notes) == sorted(
        ["pglockkit sole_writer " + ns + ")", "pglockkit run nightly)", "pglockkit lease refresh)"]
    ), notes
    assert sorted(d for _, d in flags) == [False, True, True, True], flags


def test_doctor_names_a_lease_take_left_open_in_an_idle_transaction_for_what_it_is(db):
    """Since 0018 a transaction that creates a lease (takes a name never used) holds the name's
    take guard, a transaction lock in the pglockkit namespace, until it ends. A handler that took a
    new lease with autocommit off and went on with other work idles in transaction with it: doctor
    called it "a session lock left on a pooled connection?" on a key that is a hash nobody can
    place, and proposed pglockkit.unlock, which cannot release a transaction's lock (before 0018
    the same transaction held no advisory lock and doctor said nothing of it). It names the take
    guard and the fix: end that transaction."""
    with db.connect(autocommit=False) as handler:
        assert pglockkit.acquire_lease(handler, "nightly-refresh", "pod-a", 60) is not None
        pid = handler.info.backend_pid
        time.sleep(1.2)  # the handler works on, its transaction open
        findings = monitor.doctor(db.conn, idle_after=timedelta(seconds=1))
        handler.rollback()
    assert not [f for f in findings if f.check == "idle lock holder"], findings
    takes = [f for f in findings if f.check == "open lease take"]
    assert len(takes) == 1, findings
    assert f"pid {pid} " in takes[0].message
    assert "take guard" in takes[0].message and "idle in transaction" in takes[0].message
    assert "Commit or roll back" in takes[0].fix


def test_lock_holds_tells_how_long_a_lock_has_been_held_whatever_its_session_does(db, ns, as_role):
    """pg_locks does not say when a lock was taken, and a holder's state age restarts at each of
    its transactions. sample() keeps when it first saw each (session, lock): a session lock held
    through many short transactions shows its whole hold time; a lock released is forgotten at
    the next sample, and one taken again starts again."""
    key = lock_key(namespace_id(ns), "nightly")
    assert db.conn.execute("SELECT count(*) FROM pglockkit.sampling").fetchone()[0] == 0  # never ran
    assert [f.check for f in monitor.doctor(db.conn) if f.check == "sampling"] == ["sampling"]
    with db.connect() as holder:
        holder.execute("SELECT pglockkit.try_lock(%s, 'nightly')", (ns,))
        db.conn.execute("SELECT pglockkit.sample()")
        first = db.conn.execute("SELECT max(sampled_at) FROM pglockkit.lock_samples").fetchone()[0]
        assert db.conn.execute("SELECT last_sampled_at FROM pglockkit.sampling").fetchone()[0] == first
        for _ in range(12):  # busy: its state never ages past 0.1 s
            holder.execute("SELECT 1")
            time.sleep(0.1)
        db.conn.execute("SELECT pglockkit.sample()")
        query = "SELECT namespace, key, pid, held_since, held_for, dedicated FROM pglockkit.lock_holds"
        [row] = db.conn.execute(query).fetchall()
        assert row[:4] == (ns, key, holder.info.backend_pid, first)
        assert row[4] >= timedelta(seconds=1.2) and row[5] is False
        assert as_role("vis_monitor").execute(query).fetchall() == [row]  # pg_monitor reads it
        idle = db.conn.execute("SELECT idle_for FROM pglockkit.idle_lock_holders").fetchone()[0]
        assert idle < timedelta(seconds=0.5)  # what the idle check sees of it
        holder.execute("SELECT pglockkit.unlock(%s, 'nightly')", (ns,))
        db.conn.execute("SELECT pglockkit.sample()")
        assert db.conn.execute(query).fetchall() == []
        holder.execute("SELECT pglockkit.try_lock(%s, 'nightly')", (ns,))
        db.conn.execute("SELECT pglockkit.sample()")
        [again] = db.conn.execute(query).fetchall()
        assert again[4] == timedelta(0)
        findings = monitor.doctor(db.conn, held_after=timedelta(seconds=1))
    assert not [f for f in findings if f.check == "long-held lock"]  # held for 0 s since taken again
    assert not [f for f in findings if f.check == "sampling"]  # it just ran


def test_doctor_does_not_report_a_long_hold_whose_lock_is_gone_once_sampling_stopped(db, ns):
    """lock_holds is what the last sample() saw. Once sampling stops (the `pglockkit sample` pod
    gone, the pg_cron job disabled), its rows stay: doctor kept reporting a lock released long
    ago, by a session that has ended, as held 'now', and advised pg_terminate_backend of its pid
    (which the server may have given to another session since). docs/monitoring.md: 'nothing is
    reported where sample() does not run'."""
    with db.connect() as holder:
        pid = holder.info.backend_pid
        holder.execute("SELECT pglockkit.try_lock(%s, 'nightly')", (ns,))
        db.conn.execute("SELECT pglockkit.sample()")
        time.sleep(1.2)
        db.conn.execute("SELECT pglockkit.sample()")  # the last sample: then sampling stops
    deadline = time.monotonic() + 10  # the holder's session has ended, its lock with it
    while db.conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (
        db.conn.execute("SELECT count(*) FROM pglockkit.advisory_locks WHERE pid = %s", (pid,)).fetchone()[0]
        == 0
    )
    findings = monitor.doctor(db.conn, held_after=timedelta(seconds=1))
    stale = [f for f in findings if f.check == "long-held lock"]
    assert stale == [], [(f.message, f.fix) for f in stale]


def test_contention_report_with_a_null_since_is_an_error_not_an_empty_report(db, ns):
    """errors.md: a NULL argument is 22004 (sample(NULL) is). contention_report(NULL), what a
    client sends for an unset `since` (a Node `undefined`, a nil pointer), returned no rows: "no
    contention" on a database whose samples show a key with waiters. It must raise 22004 naming
    since, or report like the default."""
    with db.connect() as holder:
        holder.execute("SELECT pglockkit.try_lock(%s, 'shared-cache')", (ns,))
        conn, thread = _blocked_waiter(
            db, "SELECT pg_advisory_lock(pglockkit.lock_key(%s, 'shared-cache'))", (ns,)
        )
        db.conn.execute("SELECT pglockkit.sample()")
        holder.execute("SELECT pg_advisory_unlock_all()")
        thread.join(5)
        conn.execute("SELECT pg_advisory_unlock_all()")
        conn.close()
    report = "SELECT namespace, samples_with_waiters FROM pglockkit.contention_report({})"
    assert db.conn.execute(report.format("")).fetchall() == [(ns, 1)]
    with pytest.raises(psycopg.errors.NullValueNotAllowed, match="since must not be null"):
        db.conn.execute(report.format("NULL"))
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="since must not be negative"):
        db.conn.execute(report.format("'-1 day'"))
    assert db.conn.execute(report.format("'1 hour'")).fetchall() == [(ns, 1)]  # nothing changed


def test_lock_holds_keeps_a_held_lock_when_its_namespace_is_registered_meanwhile(db):
    """lock_holds joins each sighting to advisory_locks on namespace too, a name read from the
    registry now: a lock of an unregistered namespace id (a key computed with the documented
    formula, or a namespace unregistered and registered again) sampled as 'unregistered' vanishes
    from lock_holds once its namespace is registered, though its session holds it still; and the
    next sample() forgets it and starts its held_since again, so doctor --held-after misses a lock
    held for hours. The key alone (with key1/key2) names the lock."""
    key = (4321 << 48) | 7
    with db.connect() as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        db.conn.execute("SELECT pglockkit.sample()")
        since = "SELECT held_since FROM pglockkit.lock_holds WHERE key = %s"
        first = db.conn.execute(since, (key,)).fetchall()
        assert len(first) == 1
        db.conn.execute("SELECT pglockkit.register_namespace('late_registered', 4321)")
        now = db.conn.execute("SELECT held_since FROM pglockkit.lock_holds WHERE key = %s", (key,)).fetchall()
        assert now == first, "a lock still held left lock_holds when its namespace was registered"
        time.sleep(0.1)
        db.conn.execute("SELECT pglockkit.sample()")
        again = db.conn.execute(since, (key,)).fetchall()
        assert again == first, "the next sample() started the hold's time again"
