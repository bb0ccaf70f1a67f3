"""``pglockkit doctor`` and ``pglockkit top``: findings and a live frame, read from the views.

The views in schema pglockkit are the source of truth; this module only selects from them and
formats what it reads.
"""

from __future__ import annotations

import select
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

from pglockkit import _calls
from pglockkit import _format as fmt

SEVERITIES = ("info", "warning", "error")


@dataclass(frozen=True)
class Finding:
    severity: str
    check: str
    message: str
    fix: str

    def rank(self) -> int:
        return SEVERITIES.index(self.severity)


def _rows(conn: psycopg.Connection, sql: str, params: tuple = ()) -> list[dict]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql, params).fetchall()


def doctor(
    conn: psycopg.Connection,
    *,
    idle_after: timedelta = timedelta(seconds=30),
    lag_after: timedelta = timedelta(minutes=5),
    held_after: timedelta = timedelta(minutes=10),
    wait_after: timedelta = timedelta(seconds=5),
) -> list[Finding]:
    """Check a database for lock, queue and pooler hazards; returns findings, most severe first.

    Reads the views once, then runs the checks below in this order, each on the rows it needs.
    A session at the root of a convoy is reported by the convoy, with its waiters, not again as an
    idle or long holder."""
    dbname = conn.info.dbname
    convoys = _rows(conn, CONVOYS, (wait_after,))
    roots = {r["root"] for r in convoys}
    findings = [
        *check_convoys(convoys, dbname),
        *check_idle_lock_holders(
            [r for r in _rows(conn, IDLE_LOCK_HOLDERS) if r["pid"] not in roots], idle_after, dbname
        ),
        *check_long_holds(
            [r for r in _rows(conn, LOCK_HOLDS) if r["pid"] not in roots], held_after, idle_after
        ),
        *check_sampling(_rows(conn, SAMPLING), held_after),
        *check_unregistered_keys(_rows(conn, UNREGISTERED_KEYS)),
        *check_lock_table_headroom(_rows(conn, LOCK_TABLE)[0]),
        *check_queues(_rows(conn, QUEUES), lag_after),
        *check_expired_leases(_rows(conn, EXPIRED_LEASES)),
        *check_xmin_horizon(_rows(conn, XMIN_HORIZON), lag_after),
        *check_prepared_blockers(_rows(conn, PREPARED_BLOCKERS)),
        *check_lock_timeouts(_rows(conn, ROLES_WITHOUT_LOCK_TIMEOUT), dbname),
        *check_pooler(pooler_evidence(conn)),
        *check_replication(_rows(conn, REPLICATION)[0]),
        *check_connections(_rows(conn, CONNECTIONS)[0]),
    ]
    return sorted(findings, key=lambda f: -f.rank())


# --- what the checks read -------------------------------------------------------------------

IDLE_LOCK_HOLDERS = (
    "SELECT namespace, key, key1, key2, pid, application_name, state, idle_for, dedicated "
    "FROM pglockkit.idle_lock_holders ORDER BY idle_for DESC"
)
LOCK_HOLDS = (
    "SELECT h.namespace, h.key, h.key1, h.key2, h.pid, h.application_name, h.state, h.held_since, "
    "h.held_for, h.dedicated, i.idle_for FROM pglockkit.lock_holds h "
    "LEFT JOIN pglockkit.idle_lock_holders i ON i.pid = h.pid AND i.namespace = h.namespace "
    "AND i.key IS NOT DISTINCT FROM h.key AND i.key1 IS NOT DISTINCT FROM h.key1 "
    "AND i.key2 IS NOT DISTINCT FROM h.key2 ORDER BY h.held_for DESC"
)
SAMPLING = "SELECT last_sampled_at, since_last_sample FROM pglockkit.sampling"
UNREGISTERED_KEYS = (
    "SELECT count(*) AS n, array_agg(DISTINCT pid) AS pids FROM pglockkit.advisory_locks "
    "WHERE namespace = 'unregistered' HAVING count(*) > 0"
)
LOCK_TABLE = """
SELECT (SELECT count(*) FROM pg_locks) AS used,
       current_setting('max_locks_per_transaction')::int
         * (current_setting('max_connections')::int
            + current_setting('max_prepared_transactions')::int)
         AS capacity"""
QUEUES = (
    "SELECT queue, ready, dead, expired_leases, oldest_ready_age, paused "
    "FROM pglockkit.queue_stats ORDER BY queue"
)
EXPIRED_LEASES = (
    "SELECT name, holder, token, -expires_in AS expired_for FROM pglockkit.lease_status "
    "WHERE released_at IS NULL AND NOT live ORDER BY name"
)
XMIN_HORIZON = (
    "SELECT kind, holder, application_name, state, xmin_age, xact_age FROM pglockkit.xmin_horizon "
    "ORDER BY xmin_age DESC"
)

# Per root of a wait chain (a session that holds what others wait for and waits for nothing): how
# many sessions wait behind it and the longest of their waits, the locks that the ones it blocks
# itself wait for, and the root's state, how long it has been in it, and its query (as far as the
# reader may see them: pg_stat_activity's rule). Roots whose longest waiter has waited at least
# %s. A prepared transaction (root 0) is check_prepared_blockers'.
CONVOYS = """
SELECT w.root_blocker AS root, count(*) AS waiting, max(w.wait_time) AS longest,
       array_agg(DISTINCT coalesce(al.namespace || '/' || coalesce(al.key::text, al.key1 || ',' || al.key2),
                                   w.relation::text, w.locktype || ' lock'))
         FILTER (WHERE w.root_blocker = ANY (w.blocked_by)) AS locks,
       a.application_name, a.state, clock_timestamp() - a.state_change AS state_for, a.query,
       coalesce(a.application_name ~ '^pglockkit (sole_writer|run|lease) ', false) AS dedicated
  FROM pglockkit.lock_waits w
  LEFT JOIN pglockkit.advisory_locks al ON al.pid = w.pid AND NOT al.granted
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = w.root_blocker
 WHERE w.root_blocker IS NOT NULL AND w.root_blocker <> 0
 GROUP BY w.root_blocker, a.application_name, a.state, a.state_change, a.query
HAVING max(w.wait_time) >= %s
 ORDER BY count(*) DESC, max(w.wait_time) DESC
"""

# Whether this server is a standby, the standbys that stream from it (any role sees how many; their
# sync_state needs pg_read_all_stats), and what this session's commits wait for.
REPLICATION = """
SELECT pg_is_in_recovery() AS in_recovery,
       current_setting('synchronous_standby_names') AS standby_names,
       current_setting('synchronous_commit') AS synchronous_commit,
       (SELECT count(*) FROM pg_stat_replication) AS standbys,
       (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')) AS sync_seen,
       (SELECT count(*) FROM pg_stat_replication WHERE sync_state IS NULL) AS unseen"""

# The server's connection slots, those in use by client sessions (any role sees every session's
# application_name), and the share of pglockkit's workers: a process holds its pool's connections,
# one for LISTEN ("... listen") and one for its heartbeat ("... heartbeat"). (%% is LIKE's %: the
# query is sent with parameters, none.)
CONNECTIONS = """
SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int
         AS usable,
       count(*) FILTER (WHERE backend_type = 'client backend') AS used,
       count(*) FILTER (WHERE application_name LIKE 'pglockkit worker %%') AS workers,
       count(*) FILTER (WHERE application_name LIKE 'pglockkit worker %% listen') AS processes
  FROM pg_catalog.pg_stat_activity"""
# From this share of the slots that roles other than superusers may use, doctor warns.
CONNECTIONS_WARN = 0.8

PREPARED_BLOCKERS = (
    "SELECT g.gid, count(*) AS waiting, max(w.wait_time) AS longest "
    "FROM pglockkit.lock_waits w, unnest(w.prepared_blockers) AS g(gid) GROUP BY g.gid ORDER BY g.gid"
)


# --- the checks: rows in, findings out ------------------------------------------------------


def _key_text(r: dict) -> str:
    """A lock's key as the findings print it: the bigint key, or an int4 pair as (key1, key2)."""
    return str(r["key"]) if r["key"] is not None else f"({r['key1']}, {r['key2']})"


def _is_take_guard(r: dict) -> bool:
    """A lease's take guard (0018): the kit's only integer key in its own namespace (its other keys
    are text keys, bit 47 set), held by a transaction that created a lease's name until it ends."""
    return r["namespace"] == "pglockkit" and r["key"] is not None and not r["key"] & (1 << 47)


def _take_guard_finding(r: dict, how: str) -> Finding:
    return Finding(
        "warning",
        "open lease take",
        f"pid {r['pid']} ({r['application_name'] or '?'}) holds the take guard of a lease it created in a "
        f"transaction still open (advisory lock pglockkit/{r['key']}), {how}: until that transaction "
        "ends, nobody else sees the lease and its rivals get NULL",
        "Commit or roll back that transaction (acquire_lease's guard is a transaction lock: "
        "pglockkit.unlock cannot release it), take leases with autocommit, or end the session: "
        f"SELECT pg_terminate_backend({r['pid']});",
    )


def _in_transaction(state: str | None) -> bool:
    return state is not None and state.startswith("idle in transaction")


def _open_transaction_fix(pid: int, dbname: str) -> str:
    """The fix for a transaction left open: end it where it was opened, have the server end such
    transactions, or end the session."""
    return (
        "Commit or roll back that transaction where it was opened: a transaction lock (xact_lock, "
        "try_xact_lock) is held until its transaction ends, and pglockkit.unlock cannot release it. "
        "Have the server end transactions left open: ALTER DATABASE "
        f"{fmt.sql_ident(dbname) if dbname else '<database>'} SET idle_in_transaction_session_timeout "
        "= '1min'; or end it now: "
        f"SELECT pg_terminate_backend({pid});"
    )


def _idle_session_fix(pid: int) -> str:
    return (
        "Release it where it was taken (pglockkit.unlock), use transaction locks behind a pool, or "
        f"end the session: SELECT pg_terminate_backend({pid});"
    )


def check_idle_lock_holders(rows: list[dict], idle_after: timedelta, dbname: str = "") -> list[Finding]:
    """Sessions holding an advisory lock while idle at least ``idle_after`` (rows of
    ``pglockkit.idle_lock_holders``): a warning, or for a connection a pglockkit client dedicated
    to the lock (``dedicated``), a note. A lease's take guard is named as such. A session idle
    outside a transaction holds a session lock (a transaction's would have ended with it): a leak,
    on a pool above all. One idle in a transaction holds it because the transaction was left open:
    only its end, or the session's, frees a transaction lock."""
    findings = []
    for r in rows:
        if r["idle_for"] is None or r["idle_for"] < idle_after:
            continue
        if _is_take_guard(r):
            findings.append(_take_guard_finding(r, f"{r['state']} for {fmt.age(r['idle_for'])}"))
            continue
        key = _key_text(r)
        who = f"pid {r['pid']} ({r['application_name'] or '?'})"
        if r["dedicated"]:
            # sole_writer, run_once, `once`, a session-bound Lease: idle by design while the block
            # runs. Ending the session would free the lock mid-run (a second replica runs it).
            findings.append(
                Finding(
                    "info",
                    "dedicated lock holder",
                    f"pid {r['pid']} ({r['application_name']}) holds advisory lock {r['namespace']}/{key} "
                    f"for its caller's block, idle by design for {fmt.age(r['idle_for'])}",
                    "Nothing to do while that block runs (do not end the session: the lock would be free "
                    "mid-run). If its process is gone, the server frees the lock once the connection's "
                    "keepalives give up.",
                )
            )
        elif _in_transaction(r["state"]):
            findings.append(
                Finding(
                    "warning",
                    "transaction left open",
                    f"{who} holds advisory lock {r['namespace']}/{key} in a transaction left open "
                    f"({r['state']} for {fmt.age(r['idle_for'])}): its locks are held until it ends",
                    _open_transaction_fix(r["pid"], dbname),
                )
            )
        else:
            findings.append(
                Finding(
                    "warning",
                    "idle lock holder",
                    f"{who} holds advisory lock {r['namespace']}/{key} while idle for "
                    f"{fmt.age(r['idle_for'])}, outside a transaction, so a session lock: one left on a "
                    "pooled connection?",
                    _idle_session_fix(r["pid"]),
                )
            )
    return findings


def check_convoys(rows: list[dict], dbname: str = "") -> list[Finding]:
    """Sessions that others queue behind (rows of ``CONVOYS``: one per root of a wait chain whose
    longest waiter has waited past the threshold): how many wait and how long, what the root
    holds, and what it is doing, with the fix that fits: a transaction left open is ended, an idle
    session's lock released, an active statement shortened or cancelled. No sampling needed."""
    findings = []
    for r in rows:
        pid, state = r["root"], r["state"]
        locks = ", ".join(r["locks"] or ()) or "a lock"
        if state is None:
            doing = "its state is hidden from you (run doctor as a pg_monitor member)"
        else:
            doing = f"it is {state} for {fmt.age(r['state_for'])}" + (
                ": a transaction left open"
                if _in_transaction(state)
                else ", outside a transaction, so it holds a session lock"
                if state == "idle"
                else ""
            )
        said = "last query" if state is not None and state.startswith("idle") else "query"
        query = f"; {said}: {_cut(r['query'], 200)}" if state is not None and r["query"] else ""
        if r["dedicated"]:
            # sole_writer, run_once, `once`, a session-bound Lease: held for the caller's block by
            # design; ending the session would free the lock mid-run.
            fix = (
                "It holds the lock for its caller's block, by design: do not end it (the lock would be "
                "free mid-run). Those waiting for it should not wait: try_lock (as sole_writer's rivals "
                "do), or bound the wait (xact_lock's timeout)."
            )
        elif _in_transaction(state):
            fix = _open_transaction_fix(pid, dbname)
        elif state == "idle":
            fix = _idle_session_fix(pid)
        else:
            fix = (
                "Shorten what runs under the lock, or lock per resource instead of one key for all "
                "(see docs/locks.md); bound the waits (xact_lock's timeout, lock_timeout); or cancel "
                f"its statement: SELECT pg_cancel_backend({pid});"
            )
        findings.append(
            Finding(
                "warning",
                "lock convoy",
                f"{r['waiting']} session(s) wait behind pid {pid} ({r['application_name'] or '?'}), the "
                f"longest for {fmt.age(r['longest'])}, on {locks}; {doing}{query}",
                fix,
            )
        )
    return findings


def check_long_holds(rows: list[dict], held_after: timedelta, idle_after: timedelta) -> list[Finding]:
    """Advisory locks that sample() has seen held at least ``held_after`` by one session (rows of
    ``pglockkit.lock_holds`` with the holder's ``idle_for`` if it idles now). On a busy pool a
    session lock leaked on a server session never idles long: only its hold time shows it. Not
    the connections pglockkit's clients dedicate to a lock, nor a holder the idle check reports."""
    findings = []
    for r in rows:
        if r["dedicated"] or r["held_for"] is None or r["held_for"] < held_after:
            continue
        if r["idle_for"] is not None and r["idle_for"] >= idle_after:
            continue  # an idle lock holder: reported as such
        if _is_take_guard(r):
            findings.append(_take_guard_finding(r, f"for at least {fmt.age(r['held_for'])}"))
            continue
        key = _key_text(r)
        who = f"pid {r['pid']} ({r['application_name'] or '?'})"
        findings.append(
            Finding(
                "warning",
                "long-held lock",
                f"{who} has held advisory lock {r['namespace']}/{key} "
                f"for at least {fmt.age(r['held_for'])} (seen by sample() since {r['held_since']:%H:%M:%S}), "
                f"now {r['state'] or 'in a state hidden from you'}: a stuck job, or a session lock left on a "
                "busy pooled connection?",
                "Find where it was taken (pglockkit.lock_holds, advisory_locks' query); release it there "
                f"(pglockkit.unlock), or end the session: SELECT pg_terminate_backend({r['pid']});",
            )
        )
    return findings


def check_sampling(rows: list[dict], held_after: timedelta) -> list[Finding]:
    """Whether ``sample()`` runs (the row of ``pglockkit.sampling``, none if it never ran): hold
    times and the contention history come from it. A note, not a warning: sampling is optional."""
    fix = (
        "Run it every few seconds, as pglockkit_admin: `pglockkit sample --every 5s`, or from pg_cron "
        "(SELECT pglockkit.sample()); see docs/monitoring.md, contention history."
    )
    if not rows:
        return [
            Finding(
                "info",
                "sampling",
                "sample() has never run in this database: how long locks are held (lock_holds, "
                "--held-after) and the contention history are unknown",
                fix,
            )
        ]
    since = rows[0]["since_last_sample"]
    if since is None or since <= held_after:
        return []
    return [
        Finding(
            "info",
            "sampling",
            f"sample() last ran {fmt.age(since)} ago (at {rows[0]['last_sampled_at']:%Y-%m-%d %H:%M:%S}): "
            "hold times and the contention history are that old; has its sampler stopped?",
            fix,
        )
    ]


def check_unregistered_keys(rows: list[dict]) -> list[Finding]:
    """Advisory locks whose keys belong to no registered namespace (``n`` and ``pids``)."""
    return [
        Finding(
            "warning",
            "unregistered advisory keys",
            f"{r['n']} advisory lock(s) with keys outside any registered namespace (pids {r['pids']})",
            "Take locks through pglockkit.lock_key(namespace, resource), after register_namespace, "
            "so that every key has an owner and a name.",
        )
        for r in rows
        if r["n"]
    ]


def check_lock_table_headroom(row: dict) -> list[Finding]:
    """More than half of the shared lock table in use (``used`` of about ``capacity`` slots)."""
    if row["used"] <= row["capacity"] / 2:
        return []
    return [
        Finding(
            "warning",
            "lock table headroom",
            f"{row['used']} locks in use of about {row['capacity']} slots in the shared lock table",
            "Raise max_locks_per_transaction, or take fewer locks per transaction (xact_lock_all batches).",
        )
    ]


def check_queues(rows: list[dict], lag_after: timedelta) -> list[Finding]:
    """Per queue (rows of ``pglockkit.queue_stats``): a pause, dead jobs, a ready job waiting at
    least ``lag_after`` (not for a paused queue: the pause says why), running jobs past their lease."""
    findings = []
    for r in rows:
        paused = r.get("paused", False)
        if paused:
            findings.append(
                Finding(
                    "info",
                    "paused queue",
                    f"queue {r['queue']} is paused: none of its {r.get('ready', 0)} ready job(s) is claimed",
                    f"When it may run again: {_pglockkit('resume', r['queue'])}  (or SELECT "
                    f"pglockkit.resume_queue({fmt.sql_literal(r['queue'])});)",
                )
            )
        if r["dead"]:
            findings.append(
                Finding(
                    "warning",
                    "dead jobs",
                    f"queue {r['queue']}: {r['dead']} dead job(s)",
                    f"Inspect last_error ({_pglockkit('jobs', r['queue'], '--status', 'dead')}), fix, "
                    f"then SELECT pglockkit.retry_dead_jobs({fmt.sql_literal(r['queue'])});",
                )
            )
        if not paused and r["oldest_ready_age"] is not None and r["oldest_ready_age"] >= lag_after:
            findings.append(
                Finding(
                    "warning",
                    "queue lag",
                    f"queue {r['queue']}: the oldest ready job has waited {fmt.age(r['oldest_ready_age'])}",
                    "Add workers, or look for workers stuck behind a lock (pglockkit.lock_waits).",
                )
            )
        if r["expired_leases"]:
            findings.append(
                Finding(
                    "info",
                    "expired job leases",
                    f"queue {r['queue']}: {r['expired_leases']} running job(s) past their lease "
                    "(worker gone?)",
                    "They are reclaimed when the queue is resumed (resume_queue)."
                    if paused
                    else "They are reclaimed by the next claim_job; if they pile up, no worker is claiming.",
                )
            )
    return findings


def check_expired_leases(rows: list[dict]) -> list[Finding]:
    """Leases neither live nor released (``name, holder, token, expired_for``)."""
    return [
        Finding(
            "info",
            "expired lease",
            f"lease {r['name']} (holder {r['holder']}, token {r['token']}) "
            f"expired {fmt.age(r['expired_for'])} ago",
            "Its holder stopped renewing; the next acquire_lease takes it with a higher token.",
        )
        for r in rows
    ]


def check_xmin_horizon(rows: list[dict], lag_after: timedelta) -> list[Finding]:
    """Transactions open at least ``lag_after``, and inactive replication slots, that hold the
    xmin horizon back (rows of ``pglockkit.xmin_horizon``)."""
    return [
        Finding(
            "warning",
            "xmin horizon",
            f"{r['kind']} {r['holder']} ({r['application_name'] or r['state'] or '?'}) holds the xmin "
            f"horizon back by {r['xmin_age']} transactions"
            + (f" for {fmt.age(r['xact_age'])}" if r["xact_age"] is not None else ""),
            "Vacuum cannot remove the queue's dead rows meanwhile: end that transaction, or drop "
            "the unused slot (see pglockkit.table_health for the damage).",
        )
        for r in rows
        if (r["xact_age"] is not None and r["xact_age"] >= lag_after)
        or (r["kind"] == "replication slot" and r["state"] == "inactive")
    ]


def check_prepared_blockers(rows: list[dict]) -> list[Finding]:
    """Prepared transactions holding locks that sessions wait for (``gid``, ``waiting``, ``longest``:
    rows of ``pglockkit.lock_waits``' prepared_blockers). Nothing ends one but COMMIT or ROLLBACK
    PREPARED: not its session (it has none), not a restart."""
    findings = []
    for r in rows:
        gid = fmt.sql_literal(r["gid"])
        findings.append(
            Finding(
                "error",
                "prepared transaction blocks sessions",
                f"prepared transaction {gid} holds locks that {r['waiting']} session(s) wait for"
                f" (the longest for {fmt.age(r['longest'])})",
                "A prepared transaction outlives its session and a restart: let its transaction manager "
                f"finish it, or by hand (as its owner or a superuser): COMMIT PREPARED {gid}; "
                f"or ROLLBACK PREPARED {gid};",
            )
        )
    return findings


def check_lock_timeouts(rows: list[dict], dbname: str) -> list[Finding]:
    """Roles that take waiting locks with no lock_timeout in database ``dbname`` (``role, why``)."""
    return [
        Finding(
            "info",
            "lock_timeout",
            f"role {r['role']} ({r['why']}) has no lock_timeout in this database: "
            "a blocked statement of it waits forever",
            f"ALTER ROLE {fmt.sql_ident(r['role'])} IN DATABASE {fmt.sql_ident(dbname)} "
            "SET lock_timeout = '5s'; "
            "or set a namespace default (register_namespace(..., lock_timeout => ...)).",
        )
        for r in rows
    ]


# Roles that take waiting locks (members of pglockkit_user, and roles holding or awaiting an advisory
# lock now) whose effective lock_timeout here is 0. Precedence as at login: the role's setting in
# this database, the role's own, the database's, then the server's.
ROLES_WITHOUT_LOCK_TIMEOUT = """
WITH RECURSIVE members AS (
    SELECT m.member FROM pg_catalog.pg_auth_members m
      JOIN pg_catalog.pg_roles g ON g.oid = m.roleid WHERE g.rolname = 'pglockkit_user'
    UNION
    SELECT m.member FROM pg_catalog.pg_auth_members m JOIN members ON m.roleid = members.member
), roles AS (
    SELECT r.oid, r.rolname,
           CASE WHEN r.oid IN (SELECT member FROM members) THEN 'member of pglockkit_user'
                ELSE 'takes advisory locks now' END AS why
      FROM pg_catalog.pg_roles r
     WHERE r.rolcanlogin
       AND (r.oid IN (SELECT member FROM members)
            OR r.rolname IN (SELECT "user" FROM pglockkit.advisory_locks WHERE "user" IS NOT NULL))
), setting AS (
    SELECT s.setdatabase, s.setrole, substr(c, length('lock_timeout=') + 1) AS value
      FROM pg_catalog.pg_db_role_setting s, unnest(s.setconfig) c
     WHERE c LIKE 'lock_timeout=%%'
), here AS (
    SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()
)
SELECT r.rolname AS role, r.why
  FROM roles r
 WHERE coalesce(
         (SELECT value FROM setting, here WHERE setdatabase = here.oid AND setrole = r.oid),
         (SELECT value FROM setting WHERE setdatabase = 0 AND setrole = r.oid),
         (SELECT value FROM setting, here WHERE setdatabase = here.oid AND setrole = 0),
         (SELECT reset_val FROM pg_catalog.pg_settings
           WHERE name = 'lock_timeout' AND source NOT IN ('database', 'user', 'database user')),
         '0') ~ '^\\s*0+\\s*[a-z]*\\s*$'
 ORDER BY r.rolname
"""


@dataclass(frozen=True)
class PoolerEvidence:
    """What ``pooler_evidence`` saw: the pid the connection reported at startup, the server pid
    of its first transactions, every server pid it ran on (probe included), and whether another
    client connection got its server session."""

    client_pid: int
    server_pid: int
    server_pids: frozenset[int]
    shared: bool = False


def pooler_evidence(conn: psycopg.Connection) -> PoolerEvidence:
    """Behind a transaction-mode pooler, consecutive transactions of one client connection can run
    on different server sessions, and session locks break silently.

    A direct connection's startup pid (BackendKeyData) is its server's ``pg_backend_pid()``; a
    pooler or proxy (PgBouncer) hands out a pid of its own. Only then is the pool mode probed:
    a second client connection runs one statement while this one is idle between transactions.
    In transaction mode it gets this connection's last server session (PgBouncer reuses the most
    recently released one), or this connection moves to another one while the probe holds it.
    In session mode the server session stays with this connection."""
    server_pids = set()
    for _ in range(4):
        with conn.transaction():
            server_pids.add(conn.execute("SELECT pg_backend_pid()").fetchone()[0])
    client_pid = conn.info.backend_pid
    last = next(iter(server_pids))
    shared = False
    if len(server_pids) == 1 and client_pid != last:
        probe_pid, moved_to = _probe(conn, last)
        shared = probe_pid == last
        if moved_to is not None:
            server_pids.add(moved_to)
    return PoolerEvidence(client_pid, last, frozenset(server_pids), shared)


def check_pooler(seen: PoolerEvidence) -> list[Finding]:
    """A pooler between the connection and the server: an error if it hands the server session to
    other clients (transaction mode), else information (session mode)."""
    if seen.server_pids == {seen.client_pid}:
        return []  # a direct connection
    if seen.shared or len(seen.server_pids) > 1:
        evidence = (
            f"another client connection ran on its server session {seen.server_pid}"
            if seen.shared
            else f"it ran on {len(seen.server_pids)} server sessions {sorted(seen.server_pids)}"
        )
        return [
            Finding(
                "error",
                "transaction-mode pooler",
                f"a pooler hands this client connection's server session to others (client-side pid "
                f"{seen.client_pid}): {evidence}",
                "Session locks (try_lock, sole_writer, bound leases, start_run) are unsafe here: "
                "connect them directly to PostgreSQL, or use xact_lock / the queue / leases "
                "without binding.",
            )
        ]
    return [
        Finding(
            "info",
            "connection pooler",
            f"a pooler or proxy sits between this connection and the server (client-side pid "
            f"{seen.client_pid}, server pid {seen.server_pid}), and kept it on one server session "
            "(session pooling?)",
            "sole_writer refuses pooled connections: give it a DSN that reaches PostgreSQL directly. "
            "Session locks left by a client that disconnects stay on the server session unless the "
            "pooler's server_reset_query (DISCARD ALL) runs.",
        )
    ]


# What a failover to a standby that had not received the last commits takes with it, and what holds.
ASYNC_LOSS = (
    "a failover to a standby loses the commits it had not received: jobs completed there run again, "
    "leases taken there are free again, runs and schedule slots recorded there may run again; "
    "fencing tokens still never repeat (they carry the timeline, docs/leases.md)"
)


def check_replication(row: dict) -> list[Finding]:
    """What a failover can lose, from the server's replication settings (``REPLICATION``): a
    standby connected to is an error (every write fails), no streaming standby for a
    ``synchronous_standby_names`` is an error (every commit waits), asynchronous standbys a
    warning, synchronous ones information. No standby at all is no finding: a managed service may
    replicate below PostgreSQL, where this cannot see."""
    if row["in_recovery"]:
        return [
            Finding(
                "error",
                "standby",
                "this server is a standby, in recovery: every pglockkit call that writes fails here "
                "(25006 read_only_sql_transaction)",
                "Connect workers and clients to the primary; with several hosts, let libpq find it: "
                "host=a,b target_session_attrs=read-write (it follows a promotion on reconnect).",
            )
        ]
    names, standbys = row["standby_names"].strip(), row["standbys"]
    if names and (not standbys or (not row["unseen"] and not row["sync_seen"])):
        streaming = (
            "no standby streams from this server"
            if not standbys
            else f"none of the {standbys} standby(s) that stream from it matches"
        )
        return [
            Finding(
                "error",
                "replication",
                f"synchronous_standby_names is {fmt.sql_literal(names)} but {streaming}: every commit "
                "that waits for a standby (synchronous_commit on, remote_write or remote_apply) waits "
                "until one connects",
                "Start the standby (its application_name must match), or stop waiting for it: "
                "ALTER SYSTEM SET synchronous_standby_names = ''; SELECT pg_reload_conf();",
            )
        ]
    if not standbys:  # no replication, or one below PostgreSQL (a managed service's): nothing seen
        return []
    if not names:
        return [
            Finding(
                "warning",
                "asynchronous replication",
                f"{standbys} standby(s) stream from this server, all asynchronously: {ASYNC_LOSS}",
                "To lose nothing acknowledged at a failover: ALTER SYSTEM SET synchronous_standby_names "
                "= '*' (or the standbys' names), with synchronous_commit = on, and keep a second standby "
                "so that commits do not wait while one is down.",
            )
        ]
    if row["synchronous_commit"] in ("off", "local"):
        return [
            Finding(
                "warning",
                "asynchronous replication",
                f"synchronous_standby_names is {fmt.sql_literal(names)}, but this session's "
                f"synchronous_commit is {row['synchronous_commit']}: its commits are acknowledged before a "
                f"standby has them, so {ASYNC_LOSS}",
                "Set synchronous_commit = on for the roles and databases of workers and lease holders "
                "(ALTER ROLE ... SET synchronous_commit = on).",
            )
        ]
    seen = (
        f", {row['sync_seen']} of them synchronous now"
        if not row["unseen"]
        else " (their sync_state needs pg_read_all_stats)"
    )
    return [
        Finding(
            "info",
            "synchronous replication",
            f"{standbys} standby(s) stream from this server{seen}; synchronous_standby_names is "
            f"{fmt.sql_literal(names)} and synchronous_commit {row['synchronous_commit']}: a failover to a "
            "synchronous standby loses no acknowledged commit",
            "Nothing to do. A commit in flight at the failover may or may not have reached the standby: "
            "clients see a lost connection and their work is found on the new primary, or done again "
            "(a job after its lease).",
        )
    ]


def check_connections(row: dict) -> list[Finding]:
    """Client connections at ``CONNECTIONS_WARN`` of what the server lets roles that are not
    superusers open (``CONNECTIONS``): a warning, which says how many pglockkit's workers hold.
    Past it, the next worker lane, lease or lock client to connect gets 53300 (too many
    clients), and so does every other client of the server."""
    usable, used, workers = row["usable"], row["used"], row["workers"]
    if usable <= 0 or used < CONNECTIONS_WARN * usable:
        return []
    share = (
        f"; pglockkit workers hold {workers} of them ({row['processes']} process(es), each its "
        "pool of --connections plus 2)"
        if workers
        else ""
    )
    return [
        Finding(
            "warning",
            "connections",
            f"{used} client connections of the {usable} the server allows roles that are not "
            f"superusers (max_connections less superuser_reserved_connections){share}",
            "Lower the workers' --connections (their jobs in flight share the pool) or run fewer "
            "worker processes; put other clients behind "
            "a pooler (transaction locks, the queue and leases work through PgBouncer in transaction "
            "mode); or raise max_connections (a restart).",
        )
    ]


def _pooler_check(conn: psycopg.Connection) -> list[Finding]:
    return check_pooler(pooler_evidence(conn))


def _probe(conn: psycopg.Connection, last: int, wait: float = 2.0) -> tuple[int | None, int | None]:
    """A second connection with ``conn``'s parameters opens a transaction while ``conn`` is idle;
    then ``conn`` runs one statement while that transaction stays open. Returns the probe's server
    pid and, if that is not ``last``, ``conn``'s server pid meanwhile. (None, None) if the probe
    gets no server session within ``wait`` seconds (a full session pool)."""
    params = {o.keyword.decode(): o.val.decode() for o in conn.pgconn.info if o.val is not None}
    params.update(application_name="pglockkit doctor probe", connect_timeout=str(max(2, round(wait))))
    with psycopg.connect(make_conninfo(**params), autocommit=True, prepare_threshold=None) as probe:
        pgconn = probe.pgconn
        pgconn.send_query(b"BEGIN; SELECT pg_backend_pid()")
        deadline = time.monotonic() + wait
        while True:
            pgconn.consume_input()
            if not pgconn.is_busy():
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                probe.close()  # abandons the queued query
                return None, None
            select.select([pgconn.socket], [], [], remaining)
        probe_pid = None
        while (result := pgconn.get_result()) is not None:
            if result.status == pq.ExecStatus.TUPLES_OK:
                probe_pid = int(result.get_value(0, 0))
        moved_to = None
        if probe_pid is not None and probe_pid != last:
            with conn.transaction():
                moved_to = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        probe.execute("ROLLBACK")
        return probe_pid, moved_to


def sample(conn: psycopg.Connection, retention: timedelta = timedelta(days=7)) -> int:
    """Record one contention sample (``pglockkit.sample``), deleting samples older than
    ``retention``; returns how many lock keys it recorded. What ``pglockkit sample`` runs."""
    return _calls.run(conn, _calls.sample(retention))


def _pglockkit(command: str, operand: str, *options: str) -> str:
    """A ``pglockkit`` command line to paste: ``operand`` (a name from the database) as one shell
    word, after ``--`` where it would read as an option."""
    dashes = ("--",) if operand.startswith("-") else ()
    return " ".join(["pglockkit", command, *options, *dashes, fmt.shell_word(operand)])


def render_findings(findings: list[Finding]) -> str:
    """Two lines a finding, whatever the names in it hold: its fix's names are quoted where the
    finding is made, and anything a terminal would not print as itself is escaped here."""
    if not findings:
        return "pglockkit doctor: no findings"
    lines = []
    for f in findings:
        lines.append(f"[{f.severity.upper()}] {f.check}: {fmt.printable(f.message)}")
        lines.append(f"    fix: {fmt.printable(f.fix)}")
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines)


def _cut(text: object, width: int) -> str:
    """``text`` in at most ``width`` columns, escaped (``fmt.printable``): a name or a query may
    hold a newline or a terminal's escape sequence."""
    s = "" if text is None else fmt.printable(text)
    return s if len(s) <= width else s[: width - 1] + "~"


def _pids(pids: list[int], prepared: list[str] | None = None) -> str:
    """Blocking pids as ``pg_blocking_pids`` gives them, where 0 is a prepared transaction:
    ``prepared`` names those (their gids, from ``lock_waits``)."""
    return ", ".join(_prepared(prepared) if p == 0 else str(p) for p in pids)


def _prepared(gids: list[str] | None) -> str:
    if not gids:
        return "a prepared transaction"
    return "prepared transaction " + ", ".join(fmt.sql_literal(g) for g in gids)


def render_top(conn: psycopg.Connection, width: int | None = None) -> str:
    """One frame of ``pglockkit top``: advisory locks, waits with their chains, queues, rate
    limits, live leases."""
    width = width or min(shutil.get_terminal_size((80, 24)).columns, 160)
    now = conn.execute("SELECT clock_timestamp()").fetchone()[0]
    out = [f"pglockkit top  {now:%Y-%m-%d %H:%M:%S}  {fmt.printable(conn.info.dbname)}", ""]

    locks = _rows(
        conn,
        "SELECT namespace, coalesce(key::text, key1 || ',' || key2) AS key, granted, pid, "
        "application_name, state, state_age, wait_time, blocked_by, query, prepared_gid "
        "FROM pglockkit.advisory_locks ORDER BY namespace, key, granted DESC, pid",
    )
    waits = _rows(
        conn,
        "SELECT pid, blocked_by, root_blocker, sessions_behind_root, locktype, namespace, "
        "relation, wait_time, prepared_blockers FROM pglockkit.lock_waits ORDER BY root_blocker, pid",
    )
    prepared = {w["pid"]: w["prepared_blockers"] for w in waits}
    out.append(f"ADVISORY LOCKS ({len(locks)})")
    out.append(f"{'NAMESPACE':<14}{'KEY':<21}{'PID':>7} {'':5}{'STATE':<11}{'FOR':>7}  APP / QUERY")
    for r in locks:
        tag = "HOLD" if r["granted"] else "WAIT"
        age = r["state_age"] if r["granted"] else r["wait_time"]
        tail = f"{r['application_name'] or ''} {r['query'] or ''}".strip()
        # A prepared transaction holds its locks with no session: no pid, no state; its gid.
        pid, state = (r["pid"], r["state"]) if r["pid"] is not None else ("2PC", "prepared")
        if r["pid"] is None and r["prepared_gid"] is not None:
            tail = _prepared([r["prepared_gid"]])
        line = (
            f"{_cut(r['namespace'], 13):<14}{_cut(r['key'], 20):<21}{pid:>7} {tag:<5}"
            f"{_cut(state, 10):<11}{fmt.age(age):>7}  "
        )
        out.append(line + _cut(tail, max(10, width - len(line))))
        if not r["granted"] and r["blocked_by"]:
            out.append(f"{'':>28}`-- blocked by {_pids(r['blocked_by'], prepared.get(r['pid']))}")
    out.extend(["", f"LOCK WAITS ({len(waits)})"])
    for root in sorted({w["root_blocker"] for w in waits if w["root_blocker"] is not None}):
        behind = [w for w in waits if w["root_blocker"] == root]
        gids = sorted({g for w in behind for g in w["prepared_blockers"] or ()})
        who = _prepared(gids) if root == 0 else f"pid {root}"
        out.append(f"root{':' if root == 0 else ''} {who}: {len(behind)} session(s) behind")
        for w in behind:
            what = w["namespace"] or w["relation"] or w["locktype"]
            out.append(
                f"  `-- pid {w['pid']} waits {fmt.age(w['wait_time'])} on {_cut(what, 30)} "
                f"(blocked by {_pids(w['blocked_by'], w['prepared_blockers'])})"
            )
    queues = _rows(
        conn,
        "SELECT queue, ready, scheduled, running, expired_leases, dead, oldest_ready_age, "
        "done_last_minute, paused FROM pglockkit.queue_stats ORDER BY queue",
    )
    out.extend(
        [
            "",
            f"QUEUES ({len(queues)})",
            f"{'QUEUE':<20}{'READY':>7}{'SCHED':>7}{'RUN':>6}{'EXPIRED':>8}{'DEAD':>6}{'LAG':>8}{'DONE/MIN':>9}",
        ]
    )
    for q in queues:
        out.append(
            f"{_cut(q['queue'], 19):<20}{q['ready']:>7}{q['scheduled']:>7}{q['running']:>6}"
            f"{q['expired_leases']:>8}{q['dead']:>6}{fmt.age(q['oldest_ready_age']):>8}{q['done_last_minute']:>9}"
            + ("  PAUSED" if q["paused"] else "")
        )
    limits = _rows(
        conn,
        "SELECT queue, key, rate, per, burst, tokens, waiting, "
        "greatest(next_allowed_at - clock_timestamp(), interval '0') AS next_in "
        "FROM pglockkit.rate_limits ORDER BY waiting DESC, queue, key",
    )
    out.extend(
        [
            "",
            f"RATE LIMITS ({len(limits)})",
            f"{'QUEUE':<16}{'KEY':<20}{'RATE':>12}{'BURST':>6}{'TOKENS':>7}{'WAITING':>8}{'NEXT IN':>9}",
        ]
    )
    for r in limits:
        rate = f"{r['rate']}/{fmt.duration(r['per'])}"
        out.append(
            f"{_cut(r['queue'], 15):<16}{_cut(r['key'], 19):<20}{_cut(rate, 11):>12}{r['burst']:>6}"
            f"{r['tokens']:>7}{r['waiting']:>8}{fmt.age(r['next_in']) if r['next_in'] else 'now':>9}"
        )
    # Live leases only (soonest to expire first); a released or expired lease is anyone's, so it is
    # counted, not listed (a service that once took many names would fill the screen).
    leases = _rows(
        conn,
        "SELECT name, holder, token, expires_in FROM pglockkit.lease_status WHERE live "
        "ORDER BY expires_in, name",
    )
    free = conn.execute("SELECT count(*) FROM pglockkit.lease_status WHERE NOT live").fetchone()[0]
    out.extend(
        [
            "",
            f"LEASES ({len(leases)} live, {free} free)",
            f"{'NAME':<28}{'HOLDER':<24}{'TOKEN':>12}{'EXPIRES IN':>12}",
        ]
    )
    for lease in leases:
        out.append(
            f"{_cut(lease['name'], 27):<28}{_cut(lease['holder'], 23):<24}{lease['token']:>12}"
            f"{fmt.age(lease['expires_in']):>12}"
        )
    return "\n".join(_cut(line, width) if len(line) > width else line for line in out)
