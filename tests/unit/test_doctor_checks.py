"""The checks of ``pglockkit doctor``, each alone on rows as the views give them (no server)."""

from __future__ import annotations

from datetime import datetime, timedelta

from pglockkit import monitor
from pglockkit.monitor import (
    Finding,
    PoolerEvidence,
    check_connections,
    check_convoys,
    check_expired_leases,
    check_idle_lock_holders,
    check_lock_table_headroom,
    check_long_holds,
    check_pooler,
    check_queues,
    check_replication,
    check_sampling,
    check_xmin_horizon,
)


def idle(pid: int, seconds: float, key: int | None = 42) -> dict:
    return {
        "namespace": "billing",
        "key": key,
        "key1": 1,
        "key2": 2,
        "pid": pid,
        "application_name": "",
        "state": "idle",
        "idle_for": timedelta(seconds=seconds),
        "dedicated": False,
    }


def test_idle_lock_holders_from_the_threshold_on():
    rows = [idle(7, 120), idle(8, 30), idle(9, 29.9, key=None)]
    findings = check_idle_lock_holders(rows, timedelta(seconds=30))
    assert [f.severity for f in findings] == ["warning", "warning"]
    assert findings[0].message.startswith("pid 7 (?) holds advisory lock billing/42 while idle for 2.0m")
    assert "pg_terminate_backend(7)" in findings[0].fix
    assert "pid 8 " in findings[1].message and "for 30.0s" in findings[1].message
    # A two-int key reads as a pair; a NULL idle time is no finding.
    [pair] = check_idle_lock_holders([idle(9, 60, key=None)], timedelta(seconds=30))
    assert "billing/(1, 2) " in pair.message
    assert check_idle_lock_holders([{**idle(5, 0), "idle_for": None}], timedelta(0)) == []
    # A connection a pglockkit client holds the lock on while its block runs: a note, never the
    # advice to end it (that would free the lock mid-run).
    [note] = check_idle_lock_holders(
        [{**idle(6, 90), "dedicated": True, "application_name": "pglockkit run nightly"}],
        timedelta(seconds=30),
    )
    assert (note.severity, note.check) == ("info", "dedicated lock holder")
    assert note.message.startswith(
        "pid 6 (pglockkit run nightly) holds advisory lock billing/42 for its caller"
    )
    assert "pg_terminate_backend" not in note.fix


def convoy(state: str | None, **extra) -> dict:
    return {
        "root": 11,
        "waiting": 3,
        "longest": timedelta(seconds=35.3),
        "locks": ["billing/907063020037357494"],
        "application_name": "invoice-job",
        "state": state,
        "state_for": timedelta(seconds=36),
        "query": "SELECT pglockkit.xact_lock('billing', 'invoice:7')",
        "dedicated": False,
        **extra,
    }


def test_a_convoys_fix_fits_what_its_root_is_doing():
    """A transaction left open is ended, an idle session's lock released, an active statement
    cancelled; a lock a pglockkit client holds by design is never to be ended; a root hidden from
    the reader says so and shows no query."""
    fixes = {}
    for state in ("idle in transaction", "idle in transaction (aborted)", "idle", "active", None):
        [f] = check_convoys([convoy(state)], "app")
        assert (f.severity, f.check) == ("warning", "lock convoy")
        assert f.message.startswith("3 session(s) wait behind pid 11 (invoice-job), the longest for 35.3s")
        assert "on billing/907063020037357494; " in f.message
        fixes[state] = f.fix
        assert ("xact_lock('billing'" in f.message) == (state is not None)
    assert fixes["idle in transaction"].startswith("Commit or roll back")
    assert fixes["idle in transaction (aborted)"] == fixes["idle in transaction"]
    assert 'ALTER DATABASE "app" SET idle_in_transaction_session_timeout' in fixes["idle in transaction"]
    assert fixes["idle"].startswith("Release it where it was taken (pglockkit.unlock)")
    assert "pg_cancel_backend(11)" in fixes["active"] and "pg_terminate" not in fixes["active"]
    [hidden] = check_convoys([convoy(None)])
    assert "its state is hidden from you" in hidden.message
    [by_design] = check_convoys([convoy("idle", dedicated=True, application_name="pglockkit sole_writer g")])
    assert "by design: do not end it" in by_design.fix and "pg_terminate" not in by_design.fix


def test_lock_table_headroom_is_a_finding_past_half():
    assert check_lock_table_headroom({"used": 50, "capacity": 100}) == []
    [f] = check_lock_table_headroom({"used": 51, "capacity": 100})
    assert f == Finding(
        "warning",
        "lock table headroom",
        "51 locks in use of about 100 slots in the shared lock table",
        f.fix,
    )


def test_queues_give_their_findings_queue_by_queue():
    rows = [
        {"queue": "a", "dead": 2, "expired_leases": 1, "oldest_ready_age": timedelta(minutes=10)},
        {"queue": "b", "dead": 0, "expired_leases": 0, "oldest_ready_age": timedelta(minutes=4)},
        {"queue": "c", "dead": 1, "expired_leases": 0, "oldest_ready_age": None},
    ]
    findings = check_queues(rows, timedelta(minutes=5))
    assert [(f.check, f.message.split(":")[0]) for f in findings] == [
        ("dead jobs", "queue a"),
        ("queue lag", "queue a"),
        ("expired job leases", "queue a"),
        ("dead jobs", "queue c"),
    ]
    assert findings[1].message == "queue a: the oldest ready job has waited 10.0m"
    assert "retry_dead_jobs('c')" in findings[3].fix
    assert [f.severity for f in findings] == ["warning", "warning", "info", "warning"]


def test_a_paused_queues_expired_leases_wait_for_its_resume():
    row = {"queue": "p", "ready": 3, "dead": 0, "expired_leases": 2, "oldest_ready_age": None}
    rows = [{**row, "paused": True}]
    checks = {f.check: f for f in check_queues(rows, timedelta(minutes=5))}
    assert set(checks) == {"paused queue", "expired job leases"}
    assert checks["expired job leases"].fix == "They are reclaimed when the queue is resumed (resume_queue)."


def test_expired_leases_say_how_long_ago():
    rows = [{"name": "l", "holder": "h", "token": 3, "expired_for": timedelta(hours=2)}]
    [f] = check_expired_leases(rows)
    assert (f.severity, f.message) == ("info", "lease l (holder h, token 3) expired 2.0h ago")


def test_xmin_horizon_old_transactions_and_inactive_slots():
    rows = [
        {"kind": "backend", "holder": "pid 1", "application_name": "etl", "state": "idle in transaction",
         "xmin_age": 900, "xact_age": timedelta(minutes=6)},
        {"kind": "backend", "holder": "pid 2", "application_name": None, "state": "active",
         "xmin_age": 10, "xact_age": timedelta(minutes=1)},
        {"kind": "replication slot", "holder": "s1", "application_name": None, "state": "inactive",
         "xmin_age": 50, "xact_age": None},
    ]  # fmt: skip
    findings = check_xmin_horizon(rows, timedelta(minutes=5))
    assert [f.message for f in findings] == [
        "backend pid 1 (etl) holds the xmin horizon back by 900 transactions for 6.0m",
        "replication slot s1 (inactive) holds the xmin horizon back by 50 transactions",
    ]


def test_pooler_direct_session_and_transaction_mode():
    assert check_pooler(PoolerEvidence(10, 10, frozenset({10}))) == []
    [session] = check_pooler(PoolerEvidence(99, 10, frozenset({10})))
    assert (session.severity, session.check) == ("info", "connection pooler")
    assert "client-side pid 99, server pid 10" in session.message
    [moved] = check_pooler(PoolerEvidence(99, 10, frozenset({10, 11})))
    assert moved.severity == "error" and moved.message.endswith("it ran on 2 server sessions [10, 11]")
    [shared] = check_pooler(PoolerEvidence(99, 10, frozenset({10}), shared=True))
    assert shared.message.endswith("another client connection ran on its server session 10")


def test_findings_render_most_severe_first_with_counts():
    findings = sorted(
        check_expired_leases([{"name": "l", "holder": "h", "token": 1, "expired_for": timedelta(seconds=3)}])
        + check_pooler(PoolerEvidence(99, 10, frozenset({10, 11}))),
        key=lambda f: -f.rank(),
    )
    text = monitor.render_findings(findings)
    assert text.splitlines()[0].startswith("[ERROR] transaction-mode pooler: ")
    assert text.splitlines()[-1] == "1 info, 1 error"
    assert monitor.render_findings([]) == "pglockkit doctor: no findings"


def test_a_paused_queue_is_a_finding_and_its_lag_is_not():
    rows = [
        {
            "queue": "p",
            "ready": 7,
            "dead": 0,
            "expired_leases": 0,
            "oldest_ready_age": timedelta(hours=1),
            "paused": True,
        }
    ]
    [finding] = check_queues(rows, timedelta(minutes=5))
    assert (finding.severity, finding.check) == ("info", "paused queue")
    assert finding.message == "queue p is paused: none of its 7 ready job(s) is claimed"
    assert "pglockkit resume p" in finding.fix


def test_long_holds_from_the_threshold_on_and_not_twice():
    def held(pid: int, minutes: float, **extra) -> dict:
        row = {**idle(pid, 0), "held_for": timedelta(minutes=minutes), "idle_for": None}
        return {**row, "held_since": datetime(2026, 12, 2, 3, 0, 0), "state": "active", **extra}

    rows = [
        held(7, 12),
        held(8, 9.9),
        held(9, 30, dedicated=True),
        held(10, 20, idle_for=timedelta(minutes=5)),
    ]
    [f] = check_long_holds(rows, timedelta(minutes=10), timedelta(seconds=30))
    assert f.severity == "warning" and f.check == "long-held lock"
    assert f.message.startswith("pid 7 (?) has held advisory lock billing/42 for at least 12.0m")
    assert "(seen by sample() since 03:00:00), now active" in f.message
    assert "pg_terminate_backend(7)" in f.fix
    # 8: under the threshold; 9: a dedicated connection; 10: idle, so the idle check reports it.
    assert check_long_holds([held(11, 11, state=None)], timedelta(minutes=10), timedelta(0))[
        0
    ].message.endswith(
        "now in a state hidden from you: a stuck job, or a session lock left on a busy pooled connection?"
    )


def test_sampling_notes_a_sampler_that_never_ran_or_stopped():
    [never] = check_sampling([], timedelta(minutes=10))
    assert (never.severity, never.check) == ("info", "sampling")
    assert never.message.startswith("sample() has never run in this database")
    assert "pglockkit sample --every 5s" in never.fix
    fresh = {"last_sampled_at": datetime(2026, 12, 2, 3, 0, 0), "since_last_sample": timedelta(seconds=5)}
    assert check_sampling([fresh], timedelta(minutes=10)) == []
    [stale] = check_sampling([{**fresh, "since_last_sample": timedelta(minutes=42)}], timedelta(minutes=10))
    assert stale.severity == "info"
    assert stale.message.startswith("sample() last ran 42.0m ago (at 2026-12-02 03:00:00)")


def replication(**overrides) -> dict:
    row = {
        "in_recovery": False,
        "standby_names": "",
        "synchronous_commit": "on",
        "standbys": 0,
        "sync_seen": 0,
        "unseen": 0,
    }
    return {**row, **overrides}


def test_replication_says_what_a_failover_can_lose():
    assert check_replication(replication()) == []  # nothing streams (or it is below PostgreSQL)
    (standby,) = check_replication(replication(in_recovery=True, standbys=0))
    assert (standby.severity, standby.check) == ("error", "standby")
    assert "target_session_attrs=read-write" in standby.fix
    (lost,) = check_replication(replication(standbys=2))
    assert (lost.severity, lost.check) == ("warning", "asynchronous replication")
    assert "2 standby(s)" in lost.message and "jobs completed there run again" in lost.message
    assert "never repeat" in lost.message  # what the epoch still keeps
    (off,) = check_replication(
        replication(standbys=1, sync_seen=1, standby_names="*", synchronous_commit="local")
    )
    assert (off.severity, off.check) == ("warning", "asynchronous replication")
    assert "synchronous_commit is local" in off.message
    (sync,) = check_replication(replication(standbys=2, sync_seen=1, standby_names="ANY 1 (a, b)"))
    assert (sync.severity, sync.check) == ("info", "synchronous replication")
    assert "1 of them synchronous now" in sync.message and "'ANY 1 (a, b)'" in sync.message
    # A role without pg_read_all_stats sees how many stream, not how.
    (unseen,) = check_replication(replication(standbys=1, unseen=1, standby_names="*"))
    assert unseen.severity == "info" and "pg_read_all_stats" in unseen.message


def test_replication_waiting_for_a_standby_that_is_not_there_is_an_error():
    for row in (
        replication(standby_names="*"),  # none streams
        replication(standby_names="s1", standbys=1),  # one streams, and is not s1
    ):
        (stuck,) = check_replication(row)
        assert (stuck.severity, stuck.check) == ("error", "replication"), row
        assert "every commit" in stuck.message and "synchronous_standby_names = ''" in stuck.fix
    # Not an error where the role cannot see whether the one streaming matches.
    assert check_replication(replication(standby_names="s1", standbys=1, unseen=1))[0].severity == "info"


def test_connections_near_the_servers_limit_warn_and_say_the_workers_share():
    assert check_connections({"usable": 97, "used": 77, "workers": 60, "processes": 5}) == []
    (near,) = check_connections({"usable": 97, "used": 78, "workers": 60, "processes": 5})
    assert (near.severity, near.check) == ("warning", "connections")
    assert "78 client connections of the 97" in near.message
    assert "pglockkit workers hold 60 of them (5 process(es)" in near.message
    assert "each its pool of --connections plus 2" in near.message
    assert "--connections" in near.fix and "--concurrency" not in near.fix
    (others,) = check_connections({"usable": 10, "used": 10, "workers": 0, "processes": 0})
    assert "workers" not in others.message  # none of them pglockkit's: not said
