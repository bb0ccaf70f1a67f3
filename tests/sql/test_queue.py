"""The job queue against real servers: semantics, stale tokens, interleavings written as explicit
steps over several connections, and exactly-once completion while workers are SIGKILLed."""

from __future__ import annotations

import itertools
import logging
import random
import re
import signal
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from psycopg.types.json import Jsonb
from scenarios import backwards_interval, exactly_once_under_sigkill, worker_proc

import pglockkit
from pglockkit import queue as q


def _status(conn, job_id):
    return conn.execute("SELECT status, attempt FROM pglockkit.jobs WHERE id = %s", (job_id,)).fetchone()


def _jobs(conn):
    return conn.execute("SELECT * FROM pglockkit.jobs ORDER BY id").fetchall()


def test_enqueue_claim_complete(db):
    job_id = q.enqueue(db.conn, "emails", {"to": "ana@example.com"})
    [job] = q.claim(db.conn, "emails", "w1", lease=30)
    assert (job.id, job.payload, job.attempt, job.queue) == (job_id, {"to": "ana@example.com"}, 1, "emails")
    assert job.token > 0
    assert q.claim(db.conn, "emails", "w2") == []  # claimed: invisible to others
    assert q.complete(db.conn, job)
    assert not q.complete(db.conn, job)  # already done: nothing changes
    assert _status(db.conn, job_id) == ("done", 1)


def test_priority_then_run_at_then_fifo(db):
    low = q.enqueue(db.conn, "q", {"n": "low"}, priority=-1)
    a = q.enqueue(db.conn, "q", {"n": "a"})
    b = q.enqueue(db.conn, "q", {"n": "b"})
    high = q.enqueue(db.conn, "q", {"n": "high"}, priority=10)
    order = [j.id for j in q.claim(db.conn, "q", "w", batch=10)]
    assert order == [high, a, b, low]


def test_a_batch_takes_the_first_jobs_in_claim_order_across_priorities(db):
    order = [("c", 0), ("a", 5), ("d", 0), ("b", 5)]
    jobs = {n: q.enqueue(db.conn, "q", {"n": n}, priority=p) for n, p in order}
    later = q.enqueue(db.conn, "q", {"n": "later"}, priority=9, delay=60)  # not due: passed over
    assert [j.id for j in q.claim(db.conn, "q", "w", batch=3)] == [jobs["a"], jobs["b"], jobs["c"]]
    assert [j.id for j in q.claim(db.conn, "q", "w", batch=1)] == [jobs["d"]]
    assert q.claim(db.conn, "q", "w", batch=5) == []
    assert _status(db.conn, later) == ("queued", 0)


def test_single_claims_follow_priority_past_later_and_locked_jobs(db):
    """Batch 1 in claim order when the top priority has no free due job: one due later, one held
    by an open claim. (Before PostgreSQL 18 the claim tries the top priority alone first, then
    walks the priorities; on 18 one skip scan does both.)"""
    q.enqueue(db.conn, "q", {"n": "later"}, priority=20, delay=60)
    held = q.enqueue(db.conn, "q", {"n": "held"}, priority=10)
    low = [q.enqueue(db.conn, "q", {"n": f"low{i}"}) for i in range(2)]
    with db.connect() as other:
        other.execute("BEGIN")
        [taken] = q.claim(other, "q", "other")  # uncommitted: the row is locked, still queued to us
        assert taken.id == held
        assert [j.id for j in q.claim(db.conn, "q", "w")] == [low[0]]
        other.execute("ROLLBACK")  # the held job is free again, ahead of low[1]
    assert [j.id for j in q.claim(db.conn, "q", "w")] == [held]
    assert [j.id for j in q.claim(db.conn, "q", "w")] == [low[1]]
    assert q.claim(db.conn, "q", "w") == []


def test_future_run_at_is_invisible_until_due(db):
    later = q.enqueue(db.conn, "q", delay=0.5)
    assert q.claim(db.conn, "q", "w") == []
    time.sleep(0.55)
    assert [j.id for j in q.claim(db.conn, "q", "w")] == [later]


def test_dedup_key_returns_the_pending_job(db):
    first = q.enqueue(db.conn, "q", {"v": 1}, dedup_key="report:2026-11-30")
    assert q.enqueue(db.conn, "q", {"v": 2}, dedup_key="report:2026-11-30") == first
    assert q.enqueue(db.conn, "other", {"v": 2}, dedup_key="report:2026-11-30") != first  # per queue
    [job] = q.claim(db.conn, "q", "w")
    assert q.enqueue(db.conn, "q", {"v": 3}, dedup_key="report:2026-11-30") == first  # running: still pending
    q.complete(db.conn, job)
    assert q.enqueue(db.conn, "q", {"v": 4}, dedup_key="report:2026-11-30") != first  # finished: a new job


def test_notify_on_enqueue(db):
    with db.connect() as listener:
        listener.execute("LISTEN pglockkit_jobs")
        q.enqueue(db.conn, "emails")
        notes = list(listener.notifies(timeout=2, stop_after=1))
    assert [(n.channel, n.payload) for n in notes] == [("pglockkit_jobs", "emails")]


def test_fail_retries_with_backoff_then_dead_then_retry_dead(db):
    job_id = q.enqueue(db.conn, "q", max_attempts=3)
    delays = []
    for attempt in (1, 2, 3):
        db.conn.execute("UPDATE pglockkit.jobs SET run_at = now() WHERE id = %s", (job_id,))  # skip the wait
        [job] = q.claim(db.conn, "q", "w")
        assert job.attempt == attempt
        before = db.conn.execute("SELECT clock_timestamp()").fetchone()[0]
        status = q.fail(db.conn, job, f"boom {attempt}")
        run_at = db.conn.execute("SELECT run_at FROM pglockkit.jobs WHERE id = %s", (job_id,)).fetchone()[0]
        delays.append((run_at - before).total_seconds())
        assert status == ("queued" if attempt < 3 else "dead")
    # Attempt n waits between 2^(n-1)/2 and 2^(n-1) seconds: exponential, with jitter.
    assert 0.45 <= delays[0] <= 1.05 and 0.95 <= delays[1] <= 2.05
    row = db.conn.execute(
        "SELECT status, last_error, finished_at IS NOT NULL FROM pglockkit.jobs WHERE id = %s", (job_id,)
    ).fetchone()
    assert row == ("dead", "boom 3", True)
    assert q.claim(db.conn, "q", "w") == []
    assert db.conn.execute("SELECT pglockkit.retry_dead_jobs('q')").fetchone()[0] == 1
    [job] = q.claim(db.conn, "q", "w")
    assert job.id == job_id and job.attempt == 1


def test_backoff_jitter_spreads_retries(db):
    delays = db.conn.execute(
        "SELECT extract(epoch FROM pglockkit._retry_delay(4)) FROM generate_series(1, 200)"
    ).fetchall()
    values = [float(d[0]) for d in delays]
    assert all(4 <= v <= 8 for v in values) and max(values) - min(values) > 3
    assert (
        float(db.conn.execute("SELECT extract(epoch FROM pglockkit._retry_delay(30))").fetchone()[0]) <= 3600
    )


def test_explicit_retry_in(db):
    job_id = q.enqueue(db.conn, "q")
    [job] = q.claim(db.conn, "q", "w")
    assert q.fail(db.conn, job, "later", retry_in=0) == "queued"
    assert [j.id for j in q.claim(db.conn, "q", "w")] == [job_id]


def test_stale_token_after_lease_expiry_changes_nothing(db):
    job_id = q.enqueue(db.conn, "q")
    [old] = q.claim(db.conn, "q", "slow-worker", lease=0.2)
    time.sleep(0.25)
    [new] = q.claim(db.conn, "q", "fast-worker", lease=30)  # reclaimed: a new attempt and token
    assert (new.id, new.attempt) == (job_id, 2) and new.token != old.token
    assert not q.complete(db.conn, old)
    assert q.fail(db.conn, old, "late") == "stale"
    assert not q.extend(db.conn, old, 30)
    assert not q.release(db.conn, old)
    assert _status(db.conn, job_id) == ("running", 2)
    assert q.complete(db.conn, new)


def test_expired_leases_are_reclaimed_before_due_jobs(db):
    # claim_job runs its bare statement only when the queue has no expired lease (0012): both here.
    stuck = q.enqueue(db.conn, "q")
    [old] = q.claim(db.conn, "q", "dead-worker", lease=0.2)
    urgent = q.enqueue(db.conn, "q", priority=10)
    normal = q.enqueue(db.conn, "q")
    elsewhere = q.enqueue(db.conn, "other")
    q.claim(db.conn, "other", "w", lease=0.2)  # another queue's expired lease is not this queue's
    time.sleep(0.25)
    got = q.claim(db.conn, "q", "w", batch=2)  # the expired job is picked first, returned by priority
    assert [(j.id, j.attempt) for j in got] == [(urgent, 1), (stuck, 2)]
    assert got[1].token != old.token
    assert [j.id for j in q.claim(db.conn, "q", "w", batch=5)] == [normal]
    assert [(j.id, j.attempt) for j in q.claim(db.conn, "other", "w")] == [(elsewhere, 2)]


def test_a_locked_expired_job_is_skipped_not_waited_for(db):
    stuck = q.enqueue(db.conn, "q")
    q.claim(db.conn, "q", "dead-worker", lease=0.1)
    due = q.enqueue(db.conn, "q")
    time.sleep(0.15)
    with psycopg.connect(db.dsn) as other:  # holds the expired job's row, as a claimer mid-statement
        other.execute("SELECT 1 FROM pglockkit.jobs WHERE id = %s FOR UPDATE", (stuck,))
        db.conn.execute("SET lock_timeout = '1s'")
        assert [j.id for j in q.claim(db.conn, "q", "w")] == [due]
    assert [(j.id, j.attempt) for j in q.claim(db.conn, "q", "w")] == [(stuck, 2)]


@pytest.mark.parametrize("batch", [1, 10])
def test_a_claim_that_would_wait_for_a_lock_gives_up_and_frees_what_it_locked(db, batch):
    """PostgreSQL makes a SKIP LOCKED claim wait in one case (following a row's update chain),
    and such a wait closed deadlocks with completions: a claim now waits 10 ms at most, then
    undoes what it did and returns nothing. Here the wait is on job_keys, locked by another
    session as DDL would lock it, after the claim has locked the keyed job's row: the claim
    returns no rows and no error, the row is free again before the caller's transaction ends,
    the caller's own lock_timeout is untouched, and the job is claimed once the table is free."""
    job_id = q.enqueue(db.conn, "q", concurrency_key="k", concurrency_limit=1)
    with psycopg.connect(db.dsn) as ddl, psycopg.connect(db.dsn) as probe:
        ddl.execute("LOCK TABLE pglockkit.job_keys IN ACCESS EXCLUSIVE MODE")
        with psycopg.connect(db.dsn) as caller:
            caller.execute("SET lock_timeout = '5s'")
            started = time.monotonic()
            assert q.claim(caller, "q", "w", batch=batch) == []
            assert time.monotonic() - started < 1
            assert caller.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            # The claim's row lock went with its block: another session locks the row at once.
            row = probe.execute(
                "SELECT status, attempt FROM pglockkit.jobs WHERE id = %s FOR UPDATE NOWAIT", (job_id,)
            ).fetchone()
            assert row == ("queued", 0)
            probe.rollback()
            assert caller.execute("SHOW lock_timeout").fetchone() == ("5s",)
        ddl.rollback()
    [job] = q.claim(db.conn, "q", "w", batch=batch)
    assert (job.id, job.attempt) == (job_id, 1)
    assert _keys_consistent(db.conn)


def test_lease_expiring_on_last_attempt_goes_dead(db):
    job_id = q.enqueue(db.conn, "q", max_attempts=1)
    q.claim(db.conn, "q", "w", lease=0.1)
    time.sleep(0.15)
    assert q.claim(db.conn, "q", "w") == []
    row = db.conn.execute("SELECT status, last_error FROM pglockkit.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("dead", "lease expired")


def test_extend_keeps_the_claim(db):
    q.enqueue(db.conn, "q")
    [job] = q.claim(db.conn, "q", "w", lease=0.3)
    for _ in range(3):
        time.sleep(0.2)
        assert q.extend(db.conn, job, 0.3)
    assert q.claim(db.conn, "q", "other") == []
    assert q.complete(db.conn, job)


def test_extend_many_is_fenced_per_job_and_never_waits_on_a_locked_row(db):
    ids = q.enqueue_many(db.conn, "q", [{}] * 4)
    jobs = q.claim(db.conn, "q", "w", lease=0.3, batch=4)
    stale, busy, live, done = jobs
    time.sleep(0.35)
    [again] = q.claim(db.conn, "q", "thief", lease=60)  # `stale` expired and was reclaimed...
    assert again.id == stale.id
    for j in (busy, live, done):  # ...the others expired too but were not reclaimed (batch 1)
        q.extend(db.conn, j, 60) or pytest.fail(f"job {j.id} lost")
    assert q.complete(db.conn, done)
    with psycopg.connect(db.dsn) as holder:  # a transaction holding `busy`'s row, as an open group
        holder.execute("SELECT 1 FROM pglockkit.jobs WHERE id = %s FOR NO KEY UPDATE", (busy.id,))
        db.conn.execute("SET lock_timeout = '2s'")
        started = time.monotonic()
        # Only `live` is extended: stale token, row locked by another transaction, job done.
        assert q.extend_many(db.conn, jobs, 0.5) == 1
        assert time.monotonic() - started < 1
    leases = dict(db.conn.execute("SELECT id, lease_expires_at - clock_timestamp() FROM pglockkit.jobs"))
    assert timedelta(seconds=0.3) < leases[live.id] <= timedelta(seconds=0.5)
    assert leases[busy.id] > timedelta(seconds=50)  # untouched: still the 60 s of the extend above
    assert leases[stale.id] > timedelta(seconds=50)  # the thief's claim, untouched
    assert leases[done.id] is None
    assert q.extend_many(db.conn, [], 1) == 0
    assert sorted(ids) == sorted(j.id for j in jobs)


def test_release_gives_the_job_back_without_counting_an_attempt(db):
    job_id = q.enqueue(db.conn, "q")
    [job] = q.claim(db.conn, "q", "w")
    assert q.release(db.conn, job)
    [again] = q.claim(db.conn, "q", "w")
    assert again.id == job_id and again.attempt == 1


def test_cancel(db):
    queued = q.enqueue(db.conn, "q")
    running = q.enqueue(db.conn, "q")
    assert db.conn.execute("SELECT pglockkit.cancel_job(%s)", (queued,)).fetchone()[0]
    [job] = q.claim(db.conn, "q", "w")
    assert job.id == running
    assert db.conn.execute("SELECT pglockkit.cancel_job(%s)", (running,)).fetchone()[0]
    assert not q.complete(db.conn, job)  # the worker learns its job was cancelled
    assert not db.conn.execute("SELECT pglockkit.cancel_job(%s)", (running,)).fetchone()[0]
    assert [_status(db.conn, i)[0] for i in (queued, running)] == ["cancelled", "cancelled"]


def test_prune_removes_only_old_finished_jobs(db):
    done = q.enqueue(db.conn, "q")
    q.complete(db.conn, q.claim(db.conn, "q", "w")[0])
    dead = q.enqueue(db.conn, "q", max_attempts=1)
    q.fail(db.conn, q.claim(db.conn, "q", "w")[0], "x")
    pending = q.enqueue(db.conn, "q")
    assert db.conn.execute("SELECT pglockkit.prune_jobs('1 hour')").fetchone()[0] == 0  # too recent
    assert db.conn.execute("SELECT pglockkit.prune_jobs('0')").fetchone()[0] == 1
    ids = [r[0] for r in db.conn.execute("SELECT id FROM pglockkit.jobs ORDER BY id")]
    assert ids == [dead, pending] and done not in ids
    assert db.conn.execute("SELECT pglockkit.prune_jobs('0', include_dead => true)").fetchone()[0] == 1


def test_batch_claim_and_complete_many(db):
    ids = q.enqueue_many(db.conn, "q", [{"n": i} for i in range(25)])
    assert len(ids) == 25 and ids == sorted(ids)
    jobs = q.claim(db.conn, "q", "w", batch=10)
    assert [j.id for j in jobs] == ids[:10]
    stale = jobs[0].__class__(**{**jobs[0].__dict__, "token": -1})
    assert q.complete_many(db.conn, [*jobs, stale]) == 10
    stats = db.conn.execute(
        "SELECT ready, running, done FROM pglockkit.queue_stats WHERE queue = 'q'"
    ).fetchone()
    assert stats == (15, 0, 10)


@pytest.mark.parametrize(
    ("call", "params", "sqlstate"),
    [
        ("SELECT pglockkit.enqueue_job(%s)", (None,), "22004"),
        ("SELECT pglockkit.enqueue_job(%s)", ("",), "22023"),
        ("SELECT pglockkit.enqueue_job('q', NULL)", (), "22004"),
        ("SELECT pglockkit.enqueue_job('q', max_attempts => 0)", (), "22003"),
        ("SELECT pglockkit.enqueue_job('q', run_at => NULL)", (), "22004"),
        ("SELECT pglockkit.enqueue_jobs('q', ARRAY['{}'::jsonb, NULL])", (), "22004"),
        ("SELECT * FROM pglockkit.claim_job(NULL, 'w')", (), "22004"),
        ("SELECT * FROM pglockkit.claim_job('q', 'w', %s)", (timedelta(seconds=-1),), "22023"),
        ("SELECT * FROM pglockkit.claim_job('q', 'w', %s)", (timedelta(0),), "22023"),
        ("SELECT * FROM pglockkit.claim_job('q', 'w', '1 min', 0)", (), "22023"),
        ("SELECT * FROM pglockkit.claim_job('q', 'w', '1 min', 100000)", (), "22023"),
        ("SELECT * FROM pglockkit.claim_job('q', '', '1 min')", (), "22023"),
        ("SELECT pglockkit.complete_job(987654, 1)", (), "42704"),
        ("SELECT pglockkit.complete_job(NULL, 1)", (), "22004"),
        ("SELECT pglockkit.fail_job(987654, 1, 'x')", (), "42704"),
        ("SELECT pglockkit.fail_job(%s, 1, 'x', '-1 s')", "job", "22023"),
        ("SELECT pglockkit.extend_job(%s, 1, '0 s')", "job", "22023"),
        ("SELECT pglockkit.cancel_job(987654)", (), "42704"),
        ("SELECT pglockkit.complete_jobs(ARRAY[1,2], ARRAY[1])", (), "22023"),
        ("SELECT pglockkit.extend_jobs(ARRAY[1,2], ARRAY[1], '1 min')", (), "22023"),
        ("SELECT pglockkit.extend_jobs(NULL, ARRAY[1], '1 min')", (), "22004"),
        ("SELECT pglockkit.extend_jobs(ARRAY[%s], ARRAY[1], '0 s')", "job", "22023"),
        ("SELECT pglockkit.extend_jobs(ARRAY[%s], ARRAY[1], '8 days')", "job", "22003"),
        ("SELECT pglockkit.prune_jobs('-1 day')", (), "22023"),
    ],
)
def test_bad_input_is_rejected_and_changes_nothing(db, call, params, sqlstate):
    job_id = q.enqueue(db.conn, "q", {"keep": True})
    if params == "job":
        params = (job_id,)
    before = _jobs(db.conn)
    with pytest.raises(psycopg.Error) as err:
        db.conn.execute(call, params)
    assert err.value.sqlstate == sqlstate
    assert _jobs(db.conn) == before


@pytest.mark.parametrize(
    "call",
    [
        "SELECT * FROM pglockkit.claim_job('q', 'w', %(lease)s::interval)",
        "SELECT pglockkit.extend_job(%(job)s, %(token)s, %(lease)s::interval)",
        "SELECT pglockkit.extend_jobs(ARRAY[%(job)s::bigint], ARRAY[%(token)s::bigint], %(lease)s::interval)",
    ],
)
def test_a_lease_that_moves_the_clock_backwards_is_refused(db, call):
    # '-2 mon 61 days' compares as positive (a month is 30 days there) but is added in calendar
    # months: in some months a claim with it had run out when given, and anyone could take it.
    lease = backwards_interval(db.conn)
    q.enqueue(db.conn, "q", {})
    [job] = q.claim(db.conn, "q", "w", lease=60)
    q.enqueue(db.conn, "q", {})
    before = _jobs(db.conn)
    with pytest.raises(psycopg.Error, match="lease must be positive") as err:
        db.conn.execute(call, {"lease": lease, "job": job.id, "token": job.token})
    assert err.value.sqlstate == "22023" and _jobs(db.conn) == before


@pytest.mark.parametrize(
    "call",
    [
        "SELECT * FROM pglockkit.claim_job('q', 'w', '300000 years')",
        "SELECT pglockkit.extend_job(%(job)s, %(token)s, '300000 years')",
        "SELECT pglockkit.extend_jobs(ARRAY[%(job)s::bigint], ARRAY[%(token)s::bigint], '300000 years')",
    ],
)
def test_a_lease_far_over_seven_days_is_out_of_range_not_a_timestamp_overflow(db, call):
    # docs/errors.md: "a job lease over 7 days (an infinite one included)" is 22003. A finite
    # lease so large that now + lease leaves the timestamp range raised 22008 "timestamp out of
    # range" instead, which names no lease (the positive-in-effect check of 0013 runs first).
    q.enqueue(db.conn, "q", {})
    [job] = q.claim(db.conn, "q", "w", lease=60)
    q.enqueue(db.conn, "q", {})
    before = _jobs(db.conn)
    with pytest.raises(psycopg.Error) as err:
        db.conn.execute(call, {"job": job.id, "token": job.token})
    assert (err.value.sqlstate, "lease" in str(err.value)) == ("22003", True), str(err.value)
    assert _jobs(db.conn) == before


# --- interleavings: explicit steps over several connections -----------------------------------


def test_interleaving_claim_vs_claim_skips_instead_of_waiting(db):
    a_id, b_id = q.enqueue(db.conn, "q"), q.enqueue(db.conn, "q")
    with db.connect() as s1, db.connect() as s2:
        s1.execute("BEGIN")  # 1. session 1 begins
        [a] = q.claim(s1, "q", "w1")  # 2. session 1 claims (row locked, uncommitted)
        s2.execute("BEGIN")  # 3. session 2 begins
        started = time.monotonic()
        [b] = q.claim(s2, "q", "w2")  # 4. session 2 claims: skips the locked row
        assert time.monotonic() - started < 0.5
        assert (a.id, b.id) == (a_id, b_id)
        s1.execute("ROLLBACK")  # 5. session 1 rolls back: its job is queued again
        s2.execute("COMMIT")
        [again] = q.claim(db.conn, "q", "w3")
        assert again.id == a_id and again.attempt == 1


def test_interleaving_claim_vs_cancel(db):
    job_id = q.enqueue(db.conn, "q")
    with db.connect() as s1, db.connect() as s2:
        s1.execute("BEGIN")
        [job] = q.claim(s1, "q", "w1")  # 1. claimed, not committed
        s2.execute("SET lock_timeout = '5s'")
        done = {}
        t = threading.Thread(
            target=lambda: done.setdefault(
                "cancelled", s2.execute("SELECT pglockkit.cancel_job(%s)", (job_id,)).fetchone()[0]
            )
        )
        t.start()  # 2. cancel waits for the claim's row lock
        time.sleep(0.2)
        assert t.is_alive()
        s1.execute("COMMIT")  # 3. the claim commits; the cancel proceeds
        t.join(5)
        assert done["cancelled"] is True
        assert not q.complete(s1, job)  # 4. the worker's completion is refused
        assert _status(db.conn, job_id)[0] == "cancelled"


def test_interleaving_complete_vs_lease_expiry(db):
    job_id = q.enqueue(db.conn, "q")
    with db.connect() as w1, db.connect() as w2:
        [old] = q.claim(w1, "q", "w1", lease=0.2)  # 1. worker 1 claims with a short lease
        time.sleep(0.25)  # 2. it stalls past the lease
        w2.execute("BEGIN")
        [new] = q.claim(w2, "q", "w2", lease=30)  # 3. worker 2 reclaims (uncommitted)
        w1.execute("SET lock_timeout = '5s'")
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("old", q.complete(w1, old)))
        t.start()  # 4. worker 1 completes: waits on the row
        time.sleep(0.2)
        w2.execute("COMMIT")  # 5. the reclaim commits
        t.join(5)
        assert result["old"] is False  # 6. the stale completion changed nothing
        assert _status(db.conn, job_id) == ("running", 2)
        assert q.complete(w2, new)


def test_concurrent_claimers_never_share_a_job(db):
    ids = q.enqueue_many(db.conn, "q", [{}] * 400)
    claimed: list[int] = []
    lock = threading.Lock()

    def claimer():
        with db.connect() as conn:
            while jobs := q.claim(conn, "q", "w", batch=7):
                with lock:
                    claimed.extend(j.id for j in jobs)
                q.complete_many(conn, jobs)

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == ids


# --- the Python worker ----------------------------------------------------------------------------


@pytest.fixture
def done_log(db):
    db.conn.execute("CREATE TABLE done_log (job_id bigint, token bigint, pid int)")
    return db


def test_worker_runs_handler_and_failure_records_error(done_log):
    db = done_log
    ok = q.enqueue_many(db.conn, "w", [{"n": i} for i in range(5)])
    from queue_handlers import explode, record

    assert pglockkit.Worker(db.dsn, "w", record, batch=2).run(exit_when_idle=True) == 5
    assert sorted(r[0] for r in db.conn.execute("SELECT job_id FROM done_log")) == ok
    bad = q.enqueue(db.conn, "w", max_attempts=1)
    pglockkit.Worker(db.dsn, "w", explode).run(exit_when_idle=True)
    row = db.conn.execute("SELECT status, last_error FROM pglockkit.jobs WHERE id = %s", (bad,)).fetchone()
    assert row[0] == "dead" and "RuntimeError: handler failed" in row[1]


def test_worker_wakes_on_notify(done_log):
    db = done_log
    from queue_handlers import record

    worker = pglockkit.Worker(db.dsn, "w", record, poll_interval=30)
    thread = threading.Thread(target=worker.run, kwargs={"max_jobs": 1})
    thread.start()
    time.sleep(0.5)  # the worker is now waiting on LISTEN, with a 30 s poll
    enqueued = time.monotonic()
    q.enqueue(db.conn, "w")
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - enqueued < 5


def test_worker_heartbeat_keeps_a_long_job(done_log):
    db = done_log
    from queue_handlers import record

    job_id = q.enqueue(db.conn, "w", {"sleep": 1.2})
    worker = pglockkit.Worker(db.dsn, "w", record, lease=0.4)
    thread = threading.Thread(target=worker.run, kwargs={"max_jobs": 1})
    thread.start()
    time.sleep(0.8)  # past the lease: only the heartbeat keeps the claim
    assert q.claim(db.conn, "w", "thief") == []
    thread.join(10)
    assert _status(db.conn, job_id) == ("done", 1)


def test_worker_heartbeat_in_a_batch_keeps_claims_and_reports_no_false_loss(done_log, caplog):
    db = done_log
    from queue_handlers import record

    caplog.set_level(logging.INFO, logger="pglockkit.queue")
    ids = q.enqueue_many(db.conn, "w", [{"sleep": 0.4}] * 3)
    assert pglockkit.Worker(db.dsn, "w", record, batch=3, lease=0.5).run(max_jobs=3) == 3
    rows = db.conn.execute("SELECT id, status, attempt FROM pglockkit.jobs ORDER BY id").fetchall()
    assert rows == [(i, "done", 1) for i in ids]  # the last job waited 0.8 s on a 0.5 s lease
    assert not [r for r in caplog.records if "lost" in r.getMessage()]


def _worker_proc(db, *extra):
    return worker_proc(db.dsn, *extra)


@pytest.mark.parametrize("batch", ["6", "1"])
def test_sigterm_stops_gracefully_and_gives_back_unstarted_jobs(done_log, batch):
    """A fast job first, so that the worker's lane then claims up to its batch: with batch 6 it
    holds all six slow jobs when SIGTERM arrives, finishes the one in hand and gives five back;
    with batch 1 it holds one, and the other five were never claimed."""
    db = done_log
    ids = q.enqueue_many(db.conn, "w", [{"sleep": 0}] + [{"sleep": 0.5}] * 6)
    # --group-time 1s: the lane claims ahead what it expects to finish in one group time, timed on
    # the fast job; with the default 20 ms, a fast job slowed past 3.3 ms by a loaded machine made
    # it claim fewer than six, and the wait below ran out (seen in clean-clone CI runs).
    proc = _worker_proc(db, "--batch", batch, "--lease", "60s", "--group-time", "1s")
    deadline = time.monotonic() + 20
    running = "SELECT count(*) FROM pglockkit.jobs WHERE status = 'running'"
    while db.conn.execute(running).fetchone()[0] < int(batch):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    time.sleep(0.1)  # inside the first slow handler
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    statuses = dict(db.conn.execute("SELECT status, count(*) FROM pglockkit.jobs GROUP BY status").fetchall())
    assert statuses == {"done": 2, "queued": len(ids) - 2}  # the job in hand finished; the rest given back
    attempts = {r[0] for r in db.conn.execute("SELECT attempt FROM pglockkit.jobs WHERE status = 'queued'")}
    assert attempts == {0}  # given back: the attempt did not count
    assert db.conn.execute("SELECT count(*) FROM done_log").fetchone()[0] == 2


@pytest.mark.slow
def test_exactly_once_while_workers_are_sigkilled(done_log):
    """8 worker processes drain 5,000 jobs while a random one is SIGKILLed every few hundred ms
    and replaced. Every job ends done, recorded exactly once, with the token of its final claim."""
    db = done_log
    stats = exactly_once_under_sigkill(db.conn, db.dsn, total=5000, workers=8)
    assert stats["kills"] >= 5
    assert stats["crashes"] == []
    assert stats["recorded"] == stats["distinct"] == 5000
    assert stats["mismatched"] == 0
    assert stats["reclaimed"] > 0  # the kills really left claims behind that were taken over


def test_jsonb_payload_round_trip(db):
    payload = {"nested": {"list": [1, 2, {"x": None}]}, "unicode": "žluťoučký kůň", "n": 1.5}
    job_id = db.conn.execute("SELECT pglockkit.enqueue_job('q', %s)", (Jsonb(payload),)).fetchone()[0]
    [job] = q.claim(db.conn, "q", "w")
    assert job.id == job_id and job.payload == payload


# --- per-key concurrency ------------------------------------------------------------------------


def _keys_consistent(conn):
    """job_keys.running equals the number of running jobs per key (the counter never drifts)."""
    return conn.execute(
        """SELECT coalesce(bool_and(k.running = coalesce(r.n, 0)), true)
             FROM pglockkit.job_keys k
             LEFT JOIN (SELECT queue, concurrency_key, count(*) AS n FROM pglockkit.jobs
                         WHERE status = 'running' AND concurrency_key IS NOT NULL GROUP BY 1, 2) r
               ON r.queue = k.queue AND r.concurrency_key = k.key"""
    ).fetchone()[0]


def test_concurrency_limit_per_key_does_not_hold_up_other_keys(db):
    a = [q.enqueue(db.conn, "t", {"a": i}, concurrency_key="tenant:a", concurrency_limit=1) for i in range(3)]
    b = [q.enqueue(db.conn, "t", {"b": i}, concurrency_key="tenant:b", concurrency_limit=2) for i in range(3)]
    free = q.enqueue(db.conn, "t")
    first = q.claim(db.conn, "t", "w", batch=10)
    assert sorted(j.id for j in first) == sorted([a[0], b[0], b[1], free])
    assert q.claim(db.conn, "t", "w", batch=10) == []  # both keys at their limit
    assert _keys_consistent(db.conn)
    q.complete(db.conn, next(j for j in first if j.id == a[0]))
    assert [j.id for j in q.claim(db.conn, "t", "w", batch=10)] == [a[1]]
    assert _keys_consistent(db.conn)


def test_fairness_a_flood_on_one_key_does_not_starve_another(db):
    flood = [q.enqueue(db.conn, "t", {"n": i}, concurrency_key="big", concurrency_limit=1) for i in range(20)]
    small = [
        q.enqueue(db.conn, "t", {"n": i}, concurrency_key="small", concurrency_limit=3) for i in range(3)
    ]
    order = []
    while jobs := q.claim(db.conn, "t", "w", batch=1):
        order.extend(j.id for j in jobs)
    # FIFO across keys, but the flood gets one slot and the later key takes the other workers.
    assert order == [flood[0], *small]


def test_single_claims_in_a_queue_with_keys_keep_claim_order_and_limits(db):
    """Batch 1 takes the first due job itself when it has no key, and hands a keyed first job to
    the keyed path (since 0013 it does not ask whether the queue has keys). Either way the order is
    the claim order, minus keys at their limit, and the per-key counts stay right."""
    a1 = q.enqueue(db.conn, "t", {"n": 1}, concurrency_key="A", concurrency_limit=1)
    u1 = q.enqueue(db.conn, "t", {"n": 2})
    a2 = q.enqueue(db.conn, "t", {"n": 3}, concurrency_key="A", concurrency_limit=1)
    u2 = q.enqueue(db.conn, "t", {"n": 4})
    b1 = q.enqueue(db.conn, "t", {"n": 5}, concurrency_key="B", concurrency_limit=1)
    claimed = []
    while jobs := q.claim(db.conn, "t", "w"):
        [job] = jobs
        claimed.append(job)
        assert _keys_consistent(db.conn)
    assert [j.id for j in claimed] == [a1, u1, u2, b1]  # a2 waits: A is at its limit
    running = db.conn.execute("SELECT key, running FROM pglockkit.job_keys WHERE queue = 't'").fetchall()
    assert dict(running) == {"A": 1, "B": 1}
    assert q.complete(db.conn, claimed[0])
    [next_job] = q.claim(db.conn, "t", "w")
    assert next_job.id == a2 and _keys_consistent(db.conn)


def test_counts_follow_every_way_out_of_running(db):
    def keyed(**kw):
        return q.enqueue(db.conn, "t", concurrency_key="k", concurrency_limit=10, **kw)

    for _ in range(6):
        keyed()
    jobs = q.claim(db.conn, "t", "w", batch=6)
    assert db.conn.execute("SELECT running FROM pglockkit.job_keys WHERE key = 'k'").fetchone()[0] == 6
    assert q.complete(db.conn, jobs[0])
    assert q.fail(db.conn, jobs[1], "retry me", retry_in=60) == "queued"
    assert q.release(db.conn, jobs[2])
    assert db.conn.execute("SELECT pglockkit.cancel_job(%s)", (jobs[3].id,)).fetchone()[0]
    assert q.complete_many(db.conn, jobs[4:]) == 2
    assert db.conn.execute("SELECT running FROM pglockkit.job_keys WHERE key = 'k'").fetchone()[0] == 0
    assert _keys_consistent(db.conn)
    # Lease expiry: a reclaim keeps the count; expiry on the last attempt (dead) lowers it.
    last = q.enqueue(db.conn, "t", concurrency_key="k", concurrency_limit=10, max_attempts=2)
    db.conn.execute(
        "UPDATE pglockkit.jobs SET run_at = now() + interval '1 hour' WHERE id <> %s AND status = 'queued'",
        (last,),
    )
    q.claim(db.conn, "t", "w", lease=0.1)
    time.sleep(0.15)
    [again] = q.claim(db.conn, "t", "w", lease=0.1)
    assert again.id == last and again.attempt == 2 and _keys_consistent(db.conn)
    time.sleep(0.15)
    assert q.claim(db.conn, "t", "w") == []
    assert _status(db.conn, last)[0] == "dead"
    assert db.conn.execute("SELECT running FROM pglockkit.job_keys WHERE key = 'k'").fetchone()[0] == 0


@pytest.mark.parametrize("batch", [1, 3])
def test_concurrent_claimers_never_exceed_a_key_limit(db, batch):
    """Eight threads race on a queue where key K allows 2 at once: the recorded running intervals
    of K's jobs never overlap three deep (checked in SQL), and the unkeyed jobs flow past. Batch 1
    and batch 3 take different statements in claim_job."""
    db.conn.execute("CREATE TABLE k_intervals (job_id bigint, s timestamptz, e timestamptz)")
    keyed = [
        q.enqueue(db.conn, "t", {"k": True}, concurrency_key="K", concurrency_limit=2) for _ in range(40)
    ]
    q.enqueue_many(db.conn, "t", [{}] * 40)
    errors = []

    unfinished = "SELECT count(*) FROM pglockkit.jobs WHERE queue = 't' AND status <> 'done'"

    def worker():
        try:
            with db.connect() as conn:
                while True:
                    jobs = q.claim(conn, "t", "w", batch=batch)
                    if not jobs:
                        # A claim passes over a key whose row another transaction holds (claims
                        # never wait): empty is not the end while jobs are left.
                        if conn.execute(unfinished).fetchone()[0] == 0:
                            break
                        time.sleep(0.005)
                        continue
                    for job in jobs:
                        if job.payload.get("k"):
                            conn.execute(
                                "INSERT INTO k_intervals VALUES (%s, clock_timestamp(), NULL)", (job.id,)
                            )
                        time.sleep(0.005)
                        if job.payload.get("k"):
                            conn.execute(
                                "UPDATE k_intervals SET e = clock_timestamp() WHERE job_id = %s", (job.id,)
                            )
                        assert q.complete(conn, job)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE status <> 'done'").fetchone()[0] == 0
    assert db.conn.execute("SELECT count(*) FROM k_intervals WHERE e IS NOT NULL").fetchone()[0] == len(keyed)
    deepest = db.conn.execute(
        """SELECT max(n) FROM (SELECT (SELECT count(*) FROM k_intervals b WHERE b.s <= a.s AND a.s < b.e) AS n
                                 FROM k_intervals a) x"""
    ).fetchone()[0]
    assert deepest <= 2
    assert db.conn.execute("SELECT running FROM pglockkit.job_keys WHERE key = 'K'").fetchone()[0] == 0


@pytest.mark.parametrize(
    ("args", "sqlstate"),
    [
        ("concurrency_key => 'k'", "22023"),
        ("concurrency_limit => 2", "22023"),
        ("concurrency_key => '', concurrency_limit => 1", "22023"),
        ("concurrency_key => 'k', concurrency_limit => 0", "22003"),
        ("concurrency_key => 'k', concurrency_limit => 10001", "22003"),
    ],
)
def test_concurrency_bad_input(db, args, sqlstate):
    with pytest.raises(psycopg.Error) as err:
        db.conn.execute(f"SELECT pglockkit.enqueue_job('t', {args})")
    assert err.value.sqlstate == sqlstate
    assert db.conn.execute("SELECT count(*) FROM pglockkit.jobs").fetchone()[0] == 0


def _plans(conn, sql, params=()):
    """The plans of every statement `sql` runs, nested ones included (auto_explain)."""
    plans = []
    conn.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_min_duration = 0")
    conn.execute("SET auto_explain.log_nested_statements = on")
    conn.execute("SET client_min_messages = log")
    try:
        result = conn.execute(sql, params).fetchall()
    finally:
        conn.execute("RESET client_min_messages")
        conn.execute("SET auto_explain.log_min_duration = -1")
    return result, "\n".join(plans)


def test_plans_made_on_a_small_table_stay_index_scans_as_the_queue_grows(db):
    """A session's first claim and complete happen on a tiny table; their (generic, kept) plans
    must still read jobs_ready in claim order and look jobs up by primary key, never scan the
    table, so their cost does not grow with the backlog or with finished jobs."""
    with db.connect() as conn:
        q.enqueue_many(conn, "grow", [{}] * 3)
        db.conn.execute("ANALYZE pglockkit.jobs")
        for _ in range(6):  # plans are made (and kept) while the table holds a handful of rows
            [job] = q.claim(conn, "grow", "w")
            assert q.complete(conn, job)
            q.enqueue(conn, "grow")
        db.conn.execute(
            "INSERT INTO pglockkit.jobs (queue, status, finished_at) "
            "SELECT 'grow', 'done', now() FROM generate_series(1, 20000)"
        )
        db.conn.execute("INSERT INTO pglockkit.jobs (queue) SELECT 'grow' FROM generate_series(1, 20000)")
        [(job_id, token)], claim_plan = _plans(
            conn, "SELECT id, token FROM pglockkit.claim_job('grow', 'w', '1 minute', 1)"
        )
        _, complete_plan = _plans(conn, "SELECT pglockkit.complete_job(%s, %s)", (job_id, token))
    assert "Index Scan using jobs_ready" in claim_plan, claim_plan
    for plan in (claim_plan, complete_plan):
        assert "Seq Scan on jobs" not in plan and "Bitmap Heap Scan on jobs" not in plan, plan
        assert "Sort Key: j_2.priority" not in plan, plan
    assert "Index Scan using jobs_pkey" in complete_plan, complete_plan


def _commits(db) -> int:
    with db.connect() as conn:
        return conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()[0]


@pytest.mark.slow
@pytest.mark.parametrize(("group", "most"), [(1, 1.5 * 60), (32, 25)])
def test_worker_commits_once_per_group_and_claims_with_the_last_completion(done_log, group, most):
    """group 1 (and batch 1): one commit per job, not two (the claim of job n+1 commits with the
    completion of job n); group 32 (and batch 32): 60 jobs in a few groups, each one commit."""
    db = done_log
    from queue_handlers import record

    total = 60
    for table in ("pglockkit.jobs", "done_log"):  # autovacuum's transactions would count too
        db.conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    q.enqueue_many(db.conn, "w", [{}] * total)
    time.sleep(1.2)  # let the setup's statistics reach pg_stat_database
    before = _commits(db)
    worker = pglockkit.Worker(db.dsn, "w", record, batch=group, group=group, group_time=30)
    assert worker.run(exit_when_idle=True) == total
    time.sleep(1.5)  # the worker's sessions report their commits as they end
    commits = _commits(db) - before
    assert db.conn.execute("SELECT count(DISTINCT job_id) FROM done_log").fetchone()[0] == total
    # Plus a few for the worker's sessions (LISTEN, the first and the last empty claim) and this
    # test's own reads: about 5 for group 32 alone, up to 18 seen in a loaded full run. Claiming
    # in a transaction of its own made group 1 cost 2 * total and more.
    assert commits < most, commits
    if group == 1:
        assert commits >= total


def _nested_buffers(conn, sql, params=()):
    """Shared buffers (hit + read) of each statement that `sql` runs inside functions: one number
    per nested statement, from its top plan node (which counts its children)."""
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_analyze = on")
    conn.execute("SET auto_explain.log_buffers = on")
    conn.execute("SET auto_explain.log_timing = off")
    result, plans = _plans(conn, sql, params)
    counts = []
    for plan in plans.split("Query Text:")[1:]:
        if plan.lstrip().startswith(sql.split("(")[0]):
            continue  # the outermost statement: its numbers include the nested ones
        found = re.search(r"Buffers: shared (?:hit=(\d+))?\s*(?:read=(\d+))?", plan)
        counts.append(int(found.group(1) or 0) + int(found.group(2) or 0) if found else 0)
    return result, counts


@pytest.mark.parametrize("later_priority", [0, 10])
def test_jobs_scheduled_for_later_are_not_read_by_a_claim(db, later_priority):
    """20,000 jobs due tomorrow, at the due job's priority or above it: a claim reads a few pages
    either way. (Ordered by priority first, the ready index puts jobs due tomorrow at priority 10
    before jobs due now at priority 0: claim_job walks the priorities, one index probe each, and
    reads only due entries within each.)"""
    db.conn.execute(
        "INSERT INTO pglockkit.jobs (queue, priority, run_at) "
        "SELECT 'later', %s, now() + interval '1 day' FROM generate_series(1, 20000)",
        (later_priority,),
    )
    due = q.enqueue(db.conn, "later")
    db.conn.execute("VACUUM ANALYZE pglockkit.jobs")
    with db.connect() as conn:
        q.claim(conn, "warm-up", "w")  # plans made and catalogs read: not what is measured
        [(job_id,)], buffers = _nested_buffers(
            conn, "SELECT id FROM pglockkit.claim_job('later', 'w', '1 minute', 1)"
        )
    assert job_id == due
    # The jobs_ready entries of 20,000 jobs fill about 100 pages; a claim's update and its index
    # entries take about 50.
    assert 0 < sum(buffers) < 80, buffers


# --- racing batch claimers with expiring leases: no deadlock, exactly once, limits kept ----------


def _claim_race(
    db, seconds: float, *, claimers: int = 8, keys: int = 6, limit: int = 2, per_key: int = 400, during=None
):
    """`claimers` autocommit threads claim batches of 5 and 10 from a queue of keyed jobs (`keys`
    keys, limit `limit`) and unkeyed ones, with leases of 1-20 ms; 30% of the claimed jobs are
    abandoned (their lease expires and another claim takes them over, or buries them on their last
    attempt), the rest completed one by one (odd threads) or all in one complete_jobs (even ones).
    `during(conn)`, if given, runs in a loop on a thread of its own meanwhile.

    Checks, as it goes, that the jobs in hand (claimed and not yet given up or completed, a subset
    of what the server counts as running) never exceed a key's limit; returns every claim, every
    successful completion and the errors by SQLSTATE."""

    db.conn.execute(
        "SELECT pglockkit.enqueue_job('race', jsonb_build_object('k', key), concurrency_key => key,"
        " concurrency_limit => %s, max_attempts => CASE WHEN i %% 7 = 0 THEN 2 ELSE 1000 END)"
        " FROM (SELECT i, 'k' || (i %% %s) AS key FROM generate_series(1, %s) i) s",
        (limit, keys, keys * per_key),
    )
    q.enqueue_many(db.conn, "race", [{}] * 600, max_attempts=1000)
    key_of: dict[int, str | None] = {}  # job id -> its key (from its payload)
    lock = threading.Lock()
    in_hand: dict[int, int] = {}  # job id -> token of the claim working on it
    claims: list[tuple[int, int, float, object]] = []  # (job, token, lease s, lease_expires_at)
    completed: list[tuple[int, int]] = []
    errors: dict[str, int] = {}
    over_limit: list[dict] = []
    stop = time.monotonic() + seconds

    def note_error(exc):
        state = getattr(exc, "sqlstate", None) or type(exc).__name__
        with lock:
            errors[state] = errors.get(state, 0) + 1

    def claimer(n):
        rng = random.Random(n)
        with db.connect() as conn:
            while time.monotonic() < stop:
                lease = rng.randint(1, 20) / 1000
                try:
                    jobs = q.claim(conn, "race", f"w{n}", lease=lease, batch=5 if n % 2 else 10)
                except Exception as exc:
                    note_error(exc)
                    continue
                keep = []
                with lock:
                    for job in jobs:
                        key_of[job.id] = job.payload.get("k")
                        claims.append((job.id, job.token, lease, job.lease_expires_at))
                        if rng.random() < 0.3:
                            in_hand.pop(job.id, None)  # abandoned: its lease will expire
                            continue
                        in_hand[job.id] = job.token
                        keep.append(job)
                    held: dict[str, int] = {}
                    for job_id in in_hand:
                        if key_of[job_id] is not None:
                            held[key_of[job_id]] = held.get(key_of[job_id], 0) + 1
                    if max(held.values(), default=0) > limit:
                        over_limit.append(held)
                with lock:
                    for job in keep:
                        if in_hand.get(job.id) == job.token:
                            del in_hand[job.id]
                try:
                    if n % 2 == 0:
                        ok = [(j.id, j.token) for j in keep if q.complete(conn, j)]
                    else:
                        done = q.complete_many(conn, keep)
                        current = {j.id for j in keep}
                        ok = [(j.id, j.token) for j in keep] if done == len(keep) else None
                        if ok is None:  # some were stale: ask which claims ended done
                            rows = conn.execute(
                                "SELECT id, token FROM pglockkit.jobs WHERE id = ANY(%s) AND status = 'done'",
                                (list(current),),
                            ).fetchall()
                            ok = [r for r in rows if (r[0], r[1]) in {(j.id, j.token) for j in keep}]
                except Exception as exc:
                    note_error(exc)
                    continue
                with lock:
                    completed.extend(ok)

    def guarded(n):
        try:
            claimer(n)
        except Exception as exc:  # reported in the result: a thread's failure must fail the test
            note_error(exc)

    def side():
        with db.connect() as conn:
            while time.monotonic() < stop:
                try:
                    during(conn)
                except Exception as exc:
                    note_error(exc)

    threads = [threading.Thread(target=guarded, args=(n,)) for n in range(claimers)]
    if during is not None:
        threads.append(threading.Thread(target=side))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"claims": claims, "completed": completed, "errors": errors, "over_limit": over_limit}


def _check_exactly_once(db, race):
    """Each claim of a job starts no earlier than the previous claim's lease ended (no two live
    claims), every job completed at most once and by its last claim, and the per-key counts equal
    the running jobs."""
    by_job: dict[int, list] = {}
    for job_id, token, lease, expires in race["claims"]:
        by_job.setdefault(job_id, []).append((token, expires - timedelta(seconds=lease), expires))
    overlapping = []
    for job_id, rows in by_job.items():
        rows.sort()
        for (_, _, old_end), (_, new_start, _) in itertools.pairwise(rows):
            if new_start < old_end:
                overlapping.append(job_id)
    assert overlapping == []
    done = [job_id for job_id, _ in race["completed"]]
    assert len(done) == len(set(done)), "a job completed twice"
    last_token = {job_id: max(r[0] for r in rows) for job_id, rows in by_job.items()}
    assert all(last_token[job_id] == token for job_id, token in race["completed"])
    statuses = dict(db.conn.execute("SELECT id, status FROM pglockkit.jobs WHERE status = 'done'"))
    assert set(statuses) == set(done)
    assert _keys_consistent(db.conn)


@pytest.mark.slow
def test_racing_batch_claimers_with_expiring_leases_never_deadlock(db):
    """Issue 13 item 3: batch claims reclaiming expired leases and reserving several keys, while
    others complete jobs of those keys one by one or in one complete_jobs, deadlocked (40P01) a
    few times in ten seconds: the key rows were locked in no fixed order. Now a claim never waits
    for a key row (one another transaction holds is passed over this time) and completions lock
    theirs in key order: no deadlock, and still exactly once and within each key's limit."""
    race = _claim_race(db, 8)
    assert race["errors"] == {}  # before the fix: {'40P01': 7 to 13}
    assert len(race["claims"]) > 1000  # the race really ran, and reclaimed:
    assert len(race["claims"]) > len({c[0] for c in race["claims"]})
    assert race["over_limit"] == []
    _check_exactly_once(db, race)


# --- mixed limits on one key ----------------------------------------------------------------------


def _claim_all(conn, queue, batch):
    """Claim until a claim returns nothing; returns the payloads' names in claim order."""
    got = []
    while jobs := q.claim(conn, queue, "w", batch=batch):
        got.extend(jobs)
        if batch == 10:
            break  # one batch claim takes all it may
    return got


@pytest.mark.parametrize("batch", [1, 10])
def test_mixed_limits_on_one_key_the_smallest_unfinished_limit_governs(db, batch):
    """Issue 13 item 8: a key enqueued with limit 1 and then 3 ran 3 (the last claim's limit won).
    The rule: a job of a key starts only while the key's running jobs are fewer than the smallest
    limit among its queued and running jobs. Once the limit-1 job has finished, 3 run."""

    def enqueue(name, limit):
        return q.enqueue(db.conn, "t", {"n": name}, concurrency_key="K", concurrency_limit=limit)

    enqueue("one", 1)
    for i in range(4):
        enqueue(f"three{i}", 3)
    free = q.enqueue(db.conn, "t", {"n": "free"})
    running = _claim_all(db.conn, "t", batch)
    names = sorted(j.payload["n"] for j in running)
    assert names == ["free", "one"]  # the unkeyed job is not held up behind the key
    assert q.claim(db.conn, "t", "w", batch=batch) == []
    assert _keys_consistent(db.conn)
    assert q.complete(db.conn, next(j for j in running if j.payload["n"] == "one"))
    # The limit-1 job finished: the key's smallest unfinished limit is 3 now.
    running = _claim_all(db.conn, "t", batch)
    assert sorted(j.payload["n"] for j in running) == ["three0", "three1", "three2"]
    assert q.claim(db.conn, "t", "w", batch=batch) == []
    row = db.conn.execute("SELECT running, lim FROM pglockkit.job_keys WHERE key = 'K'").fetchone()
    assert row == (3, 3)
    assert free is not None and _keys_consistent(db.conn)


@pytest.mark.parametrize("batch", [1, 10])
def test_a_smaller_limit_enqueued_later_holds_new_starts_until_the_key_is_below_it(db, batch):
    """Limit-3 jobs running; a limit-1 job arrives: nothing of the key starts (not even more
    limit-3 jobs) until fewer than 1 run, i.e. none; then the limit-1 job runs alone (claim order),
    and after it the limit-3 jobs run 3 at a time again. Jobs already running are not stopped."""

    def enqueue(name, limit):
        return q.enqueue(db.conn, "t", {"n": name}, concurrency_key="K", concurrency_limit=limit)

    for i in range(2):
        enqueue(f"early{i}", 3)
    early = _claim_all(db.conn, "t", batch)
    assert len(early) == 2
    enqueue("one", 1)
    for i in range(3):
        enqueue(f"late{i}", 3)
    assert q.claim(db.conn, "t", "w", batch=batch) == []  # 2 run, the smallest limit is 1
    assert q.complete(db.conn, early[0])
    assert q.claim(db.conn, "t", "w", batch=batch) == []  # 1 runs: still not below 1
    assert q.complete(db.conn, early[1])
    [one] = q.claim(db.conn, "t", "w", batch=batch)
    assert one.payload["n"] == "one"
    assert q.claim(db.conn, "t", "w", batch=batch) == []
    assert q.complete(db.conn, one)
    assert sorted(j.payload["n"] for j in _claim_all(db.conn, "t", batch)) == ["late0", "late1", "late2"]
    assert _keys_consistent(db.conn)


# --- pruning idle key rows --------------------------------------------------------------------------


def _runs_keyed_statement(conn, queue, batch):
    """Whether a claim of `queue` runs claim_job's per-key statement (not one of its fast paths).
    The claim is rolled back."""
    conn.execute("BEGIN")
    try:
        _, plans = _plans(conn, "SELECT id FROM pglockkit.claim_job(%s, 'w', '1 minute', %s)", (queue, batch))
    finally:
        conn.execute("ROLLBACK")
    return "FOR NO KEY UPDATE OF k SKIP LOCKED" in plans


def _key_rows(conn):
    return dict(conn.execute("SELECT queue || '/' || key, running FROM pglockkit.job_keys").fetchall())


def test_prune_jobs_deletes_idle_key_rows_and_the_batch_fast_path_comes_back(db):
    """Issue 13 item 11: a key's row stayed forever, and kept claim_job's batch fast path off for
    its queue. prune_jobs deletes the rows of keys with no queued or running job (whatever
    older_than, in the queue given or all), and keeps the others."""
    for key in ("idle", "queued", "running"):
        q.enqueue(db.conn, "t", {"k": key}, concurrency_key=key, concurrency_limit=2)
    q.enqueue(db.conn, "other", concurrency_key="idle", concurrency_limit=2)
    jobs = {j.payload["k"]: j for j in q.claim(db.conn, "t", "w", batch=10)}
    assert q.complete(db.conn, jobs["idle"])
    assert q.release(db.conn, jobs["queued"])  # queued again
    [other] = q.claim(db.conn, "other", "w")
    assert q.complete(db.conn, other)
    q.enqueue_many(db.conn, "t", [{}] * 3)
    with db.connect() as conn:
        assert _runs_keyed_statement(conn, "t", 2)  # a key row: the batch fast path is off
    assert _key_rows(db.conn) == {"t/idle": 0, "t/queued": 0, "t/running": 1, "other/idle": 0}
    assert db.conn.execute("SELECT pglockkit.prune_jobs('1 day', 't')").fetchone()[0] == 0
    assert _key_rows(db.conn) == {"t/queued": 0, "t/running": 1, "other/idle": 0}
    assert db.conn.execute("SELECT pglockkit.prune_jobs('1 day')").fetchone()[0] == 0
    assert _key_rows(db.conn) == {"t/queued": 0, "t/running": 1}
    # The last keyed jobs of the queue finish: its key rows go, and batches take the fast path.
    for job in q.claim(db.conn, "t", "w", batch=1):
        assert job.payload["k"] == "queued" and q.complete(db.conn, job)
    assert q.complete(db.conn, jobs["running"])
    db.conn.execute("SELECT pglockkit.prune_jobs('1 day')")
    assert _key_rows(db.conn) == {}
    with db.connect() as conn:
        assert not _runs_keyed_statement(conn, "t", 2)
        assert len(q.claim(conn, "t", "w", batch=5)) == 3
    # A key used again gets its row again, and its limit holds.
    for _ in range(3):
        q.enqueue(db.conn, "t", concurrency_key="idle", concurrency_limit=2)
    assert len(q.claim(db.conn, "t", "w", batch=10)) == 2
    assert _key_rows(db.conn) == {"t/idle": 2} and _keys_consistent(db.conn)


def test_a_key_of_dead_jobs_loses_its_row_and_retry_dead_jobs_brings_it_back(db):
    job_id = q.enqueue(db.conn, "t", concurrency_key="k", concurrency_limit=1, max_attempts=1)
    q.fail(db.conn, q.claim(db.conn, "t", "w")[0], "boom")
    db.conn.execute("SELECT pglockkit.prune_jobs('1 day')")
    assert _key_rows(db.conn) == {}
    assert db.conn.execute("SELECT pglockkit.retry_dead_jobs('t')").fetchone()[0] == 1
    assert db.conn.execute("SELECT key, running, lim FROM pglockkit.job_keys").fetchall() == [("k", 0, 1)]
    q.enqueue(db.conn, "t", concurrency_key="k", concurrency_limit=1)
    [job] = q.claim(db.conn, "t", "w", batch=5)
    assert job.id == job_id and _keys_consistent(db.conn)


def test_an_enqueue_in_flight_keeps_its_key_row_from_pruning(db):
    """An open transaction that enqueued a job of an idle key (whose row exists, running 0, no
    other job) pins the row: prune_jobs passes it over, so the job, once committed, is claimed.
    Without the pin (trigger jobs_pin_key dropped), the row went, and the job, in a queue left
    without key rows, was never claimed."""
    first = q.enqueue(db.conn, "t", concurrency_key="k", concurrency_limit=1)
    assert q.complete(db.conn, q.claim(db.conn, "t", "w")[0])
    with db.connect() as enqueuer:
        enqueuer.execute("BEGIN")
        job_id = q.enqueue(enqueuer, "t", concurrency_key="k", concurrency_limit=1)
        db.conn.execute("SET lock_timeout = '2s'")
        started = time.monotonic()
        db.conn.execute("SELECT pglockkit.prune_jobs('1 day')")
        assert time.monotonic() - started < 1  # passed over, not waited for
        enqueuer.execute("COMMIT")
    assert _key_rows(db.conn) == {"t/k": 0}
    [job] = q.claim(db.conn, "t", "w", batch=5)
    assert job.id == job_id != first and _keys_consistent(db.conn)


def test_an_enqueue_finding_its_key_row_being_pruned_creates_it_again(db):
    """The other order: prune_jobs has deleted the idle row (not committed yet) when an enqueue
    of that key comes: the enqueue waits for it, then creates the row again."""
    q.enqueue(db.conn, "t", concurrency_key="k", concurrency_limit=1)
    assert q.complete(db.conn, q.claim(db.conn, "t", "w")[0])
    with db.connect() as pruner:
        pruner.execute("BEGIN")
        pruner.execute("SELECT pglockkit.prune_jobs('1 day')")
        done = {}
        t = threading.Thread(
            target=lambda: done.setdefault(
                "id", q.enqueue(db.conn, "t", concurrency_key="k", concurrency_limit=1)
            )
        )
        t.start()
        time.sleep(0.2)
        assert t.is_alive()  # waits for the pruning transaction
        pruner.execute("COMMIT")
        t.join(5)
    [job] = q.claim(db.conn, "t", "w", batch=5)
    assert job.id == done["id"] and _key_rows(db.conn) == {"t/k": 1}


@pytest.mark.slow
def test_pruning_key_rows_during_racing_claims_and_enqueues_never_breaks_limits(db):
    """The race of the deadlock test, with few jobs per key (keys run dry) while another session
    keeps enqueuing jobs of those keys and pruning idle key rows: limits hold, every job is
    claimed exactly once at a time, and no queued or running keyed job is left without its row."""
    rng = random.Random(7)
    pruned = [0]

    def prune_and_enqueue(conn):
        before = conn.execute("SELECT count(*) FROM pglockkit.job_keys").fetchone()[0]
        conn.execute("SELECT pglockkit.prune_jobs('1 day', 'race')")
        pruned[0] += before - conn.execute("SELECT count(*) FROM pglockkit.job_keys").fetchone()[0]
        for _ in range(rng.randint(0, 3)):
            key = f"k{rng.randrange(6)}"
            q.enqueue(conn, "race", {"k": key}, concurrency_key=key, concurrency_limit=2, max_attempts=1000)
        time.sleep(0.002)

    race = _claim_race(db, 6, per_key=20, during=prune_and_enqueue)
    assert race["errors"] == {}
    assert race["over_limit"] == []
    assert pruned[0] > 20  # keys really went idle, were pruned and came back
    _check_exactly_once(db, race)
    orphans = db.conn.execute(
        """SELECT count(*) FROM pglockkit.jobs j
            WHERE j.concurrency_key IS NOT NULL AND j.status IN ('queued', 'running')
              AND NOT EXISTS (SELECT FROM pglockkit.job_keys k
                               WHERE k.queue = j.queue AND k.key = j.concurrency_key)"""
    ).fetchone()[0]
    assert orphans == 0


def _dead(conn, queue: str, dedup_key: str | None = None) -> int:
    job = q.enqueue(conn, queue, {}, dedup_key=dedup_key, max_attempts=1)
    assert q.fail(conn, q.claim(conn, queue, "w")[0], "smtp down") == "dead"
    return job


def test_retry_dead_jobs_queues_the_newest_dead_job_of_a_dedup_key_again(db):
    """Dedup keys are unique among unfinished jobs only, so a key can die more than once (a daily
    digest that fails each day). retry_dead_jobs failed as a whole on the unique index (23505),
    leaving every dead job dead; now the newest dead job of each key is queued again."""
    older, newer = _dead(db.conn, "digest", "digest:ana"), _dead(db.conn, "digest", "digest:ana")
    other = _dead(db.conn, "digest")

    assert db.conn.execute("SELECT pglockkit.retry_dead_jobs('digest')").fetchone()[0] == 2

    assert [_status(db.conn, j) for j in (older, newer, other)] == [("dead", 1), ("queued", 0), ("queued", 0)]
    # Asked for by id, the older one stays dead: its key has an unfinished job now.
    assert db.conn.execute("SELECT pglockkit.retry_dead_jobs('digest', %s)", ([older],)).fetchone()[0] == 0
    assert _status(db.conn, older) == ("dead", 1)


def test_retry_dead_jobs_leaves_dead_a_job_whose_key_was_enqueued_again(db):
    dead = _dead(db.conn, "digest", "digest:ana")
    other = _dead(db.conn, "digest", "digest:bob")
    again = q.enqueue(db.conn, "digest", {}, dedup_key="digest:ana")
    assert db.conn.execute("SELECT pglockkit.retry_dead_jobs('digest')").fetchone()[0] == 1
    assert [_status(db.conn, j) for j in (dead, again, other)] == [("dead", 1), ("queued", 0), ("queued", 0)]


def test_retry_dead_jobs_racing_an_enqueue_of_the_same_key_retries_the_rest(db):
    """An enqueue of a dead job's key, in flight when retry_dead_jobs checks the key, makes its
    UPDATE wait and then fail on the unique index: the retry then goes job by job, and only that
    job stays dead."""
    dead = _dead(db.conn, "digest", "digest:ana")
    others = [_dead(db.conn, "digest", f"digest:{n}") for n in ("bob", "cy")] + [_dead(db.conn, "digest")]
    with db.connect() as producer, db.connect() as admin:
        producer.execute("BEGIN")
        again = q.enqueue(producer, "digest", {}, dedup_key="digest:ana")
        result: list = []
        thread = threading.Thread(
            target=lambda: result.append(
                admin.execute("SELECT pglockkit.retry_dead_jobs('digest')").fetchone()[0]
            )
        )
        thread.start()
        deadline = time.monotonic() + 10
        while not db.conn.execute(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (admin.info.backend_pid,)
        ).fetchone()[0]:
            assert time.monotonic() < deadline, "retry_dead_jobs never waited for the enqueue"
            time.sleep(0.01)
        producer.execute("COMMIT")
        thread.join(10)
    assert result == [3]
    assert _status(db.conn, dead) == ("dead", 1) and _status(db.conn, again) == ("queued", 0)
    assert [_status(db.conn, j) for j in others] == [("queued", 0)] * 3


def test_racing_enqueues_of_one_dedup_key_make_one_job_while_workers_finish_it(db):
    """docs/queue.md: dedup keys are unique among a queue's unfinished jobs, and enqueueing a
    duplicate returns the pending job's id. Eight sessions enqueue the same key at a barrier (one job,
    one id for all, no unique violation); then six enqueue one key in a loop while two workers claim
    and complete its jobs: no error, at most one unfinished job at any time (the index), and no
    enqueue is answered with a job that had finished before the enqueue began."""
    n = 8
    barrier = threading.Barrier(n)
    rounds = 30
    ids: list[list[int]] = [[] for _ in range(rounds)]
    errors: list[BaseException] = []

    def burst() -> None:
        try:
            with db.connect() as conn:
                for r in range(rounds):
                    barrier.wait(10)
                    ids[r].append(q.enqueue(conn, "d", {"r": r}, dedup_key=f"burst:{r}"))
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=burst) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(len(set(got)) == 1 and len(got) == n for got in ids), ids
    assert db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE queue = 'd'").fetchone()[0] == rounds

    stop = time.monotonic() + 3
    answers: list[tuple[int, float]] = []  # (id returned, wall clock when the enqueue was sent)
    committed: dict[int, float] = {}  # job id -> wall clock once its completion had committed

    def enqueuer() -> None:
        try:
            with db.connect() as conn:
                while time.monotonic() < stop:
                    sent = time.time()
                    answers.append((q.enqueue(conn, "race", {}, dedup_key="one"), sent))
        except BaseException as exc:  # reported below
            errors.append(exc)

    def worker() -> None:
        try:
            with db.connect() as conn:
                while time.monotonic() < stop:
                    for job in q.claim(conn, "race", "w"):
                        assert q.complete(conn, job)  # autocommit: committed when it returns
                        committed[job.id] = time.time()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=enqueuer) for _ in range(6)] + [
        threading.Thread(target=worker) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(committed) > 20, len(committed)  # jobs of the key really finished while others enqueued it
    stale = [(i, sent) for i, sent in answers if i in committed and committed[i] < sent]
    assert stale == []  # no enqueue answered with a job whose completion had committed before it began
    jobs = db.conn.execute(
        "SELECT id FROM pglockkit.jobs WHERE queue = 'race' AND dedup_key = 'one' ORDER BY id"
    ).fetchall()
    assert {i for (i,) in jobs} == {i for i, _ in answers}  # every job of the key was some enqueue's answer


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "aio"])
def test_claim_of_a_payload_python_cannot_decode_raises_with_the_claimed_jobs(db, asynchronous):
    """A payload PostgreSQL stores and Python's json cannot load (arrays nested 5,000 deep: a
    RecursionError) raised json's own error out of claim, the batch claimed and in nobody's hand
    until its lease. PayloadNotDecodable names the job and carries the batch, to fail or release."""
    import asyncio

    from pglockkit import aio

    good = q.enqueue(db.conn, "q", {"n": 1})
    bad = db.conn.execute(
        "SELECT pglockkit.enqueue_job('q', "
        "('{\"n\": ' || repeat('[', 5000) || repeat(']', 5000) || '}')::jsonb)"
    ).fetchone()[0]
    if asynchronous:

        async def claim():
            async with await psycopg.AsyncConnection.connect(db.dsn, autocommit=True) as conn:
                return await aio.claim(conn, "q", "w", batch=5)

        with pytest.raises(pglockkit.PayloadNotDecodable) as caught:
            asyncio.run(claim())
    else:
        with pytest.raises(pglockkit.PayloadNotDecodable) as caught:
            q.claim(db.conn, "q", "w", batch=5)
    assert f"job {bad}'s payload cannot be decoded" in str(caught.value), caught.value
    assert "recursion" in str(caught.value)
    jobs = {job.id: job for job in caught.value.jobs}
    assert jobs.keys() == {good, bad} and jobs[good].payload == {"n": 1}
    assert q.fail(db.conn, jobs[bad], str(caught.value)) == "queued" and q.release(db.conn, jobs[good])
    [again] = q.claim(db.conn, "q", "w")  # the good one, given back: claimable at once
    assert again.id == good


def _wait_blocked_by(conn, pid: int, blockers: set[int], seconds: float = 10) -> None:
    """Wait until backend `pid` waits for a lock that one of `blockers` holds."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        [got] = conn.execute("SELECT pg_blocking_pids(%s)", (pid,)).fetchone()
        if set(got) & blockers:
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited for {blockers}")


@pytest.mark.slow
def test_a_stale_complete_jobs_and_the_reclaimers_complete_jobs_do_not_deadlock(db):
    """A complete_jobs whose tokens went stale while it ran still locks each row it reaches (the
    newest version, kept to the end of its transaction though its token no longer matches). It
    locked its rows in the order of its arrays, and the claimer that had reclaimed them completed
    them in another order: each held a row the other waited for (40P01, seen once in CI in the
    racing test above). Completions now lock their job rows in id order, first."""
    x, y, g = (q.enqueue(db.conn, "dl", {"n": n}) for n in "xyg")
    stale = {j.id: j for j in q.claim(db.conn, "dl", "a", lease=0.05, batch=3)}
    assert set(stale) == {x, y, g}
    time.sleep(0.1)  # all three leases expired
    with (
        db.connect() as a,
        db.connect() as b,
        db.connect(autocommit=False) as claim,
        db.connect(autocommit=False) as gate,
    ):
        # the gate holds g, so that the reclaim takes x and y only, and the stale call waits there
        gate.execute("SELECT 1 FROM pglockkit.jobs WHERE id = %s FOR NO KEY UPDATE", (g,))
        fresh = {j.id: j for j in q.claim(claim, "dl", "b", lease=60, batch=3)}
        assert set(fresh) == {x, y}
        a_pid, b_pid = a.info.backend_pid, b.info.backend_pid
        results: dict[str, object] = {}

        def run(name, conn, jobs):
            try:
                results[name] = q.complete_many(conn, jobs)
            except Exception as exc:  # the outcome is the result
                results[name] = getattr(exc, "sqlstate", None) or repr(exc)

        # the stale call, its snapshot from before the reclaim commits, in the order y, g, x
        ta = threading.Thread(target=run, args=("a", a, [stale[y], stale[g], stale[x]]))
        ta.start()
        _wait_blocked_by(db.conn, a_pid, {claim.info.backend_pid})
        claim.commit()  # the reclaim commits: the stale call's rows are the reclaimer's now
        _wait_blocked_by(db.conn, a_pid, {gate.info.backend_pid})
        tb = threading.Thread(target=run, args=("b", b, [fresh[x], fresh[y]]))
        tb.start()
        _wait_blocked_by(db.conn, b_pid, {a_pid})  # before: b held x and waited for y, which a held
        gate.rollback()
        ta.join(10)
        tb.join(10)
    assert results == {"a": 1, "b": 2}  # before the fix: one of them '40P01'
    assert {
        r[0]: r[1]
        for r in db.conn.execute("SELECT id, status FROM pglockkit.jobs WHERE id = ANY(%s)", ([x, y, g],))
    } == {x: "done", y: "done", g: "done"}


@pytest.mark.slow
def test_a_workers_group_recording_a_failure_does_not_deadlock_with_a_stale_complete_jobs(db):
    """A worker's group records its outcomes in key order, a complete_jobs for each run of
    completions between failures: after its first statement it holds a key row. A stale
    complete_jobs (its leases expired while it ran) that had locked one of the group's job rows,
    and went on to the key rows of its own current jobs, waited for that key row while the group
    waited for its job row: 40P01. The group (the calls the worker sends, outcome_calls) now
    locks all its job rows first, in id order, and holds no key row while it waits for one."""
    from pglockkit import _calls
    from pglockkit.worker.lane import outcome_calls

    def enqueue(key):
        return q.enqueue(
            db.conn, "dl", {}, concurrency_key=key, concurrency_limit=5 if key else None, max_attempts=2
        )

    j, z, k, a = enqueue("b"), enqueue(None), enqueue("a"), enqueue("a")  # claim order = id order
    [stale_j] = q.claim(db.conn, "dl", "s", lease=0.05)
    stale = {job.id: job for job in q.claim(db.conn, "dl", "s", lease=60, batch=2)}
    assert set(stale) == {z, k}
    time.sleep(0.1)  # j's lease expired
    with (
        db.connect() as s,
        db.connect() as w,
        db.connect(autocommit=False) as claim,
        db.connect(autocommit=False) as gate,
    ):
        gate.execute("SELECT 1 FROM pglockkit.jobs WHERE id = %s FOR NO KEY UPDATE", (z,))
        group = {job.id: job for job in q.claim(claim, "dl", "w", lease=60, batch=2)}
        assert set(group) == {j, a}  # j reclaimed, a fresh
        results: dict[str, object] = {}

        def stale_call():
            try:
                results["stale"] = q.complete_many(s, [stale_j, stale[z], stale[k]])
            except Exception as exc:  # the outcome is the result
                results["stale"] = getattr(exc, "sqlstate", None) or repr(exc)

        def record():
            calls, completions = outcome_calls([group[a]], [(group[j], "boom")])
            ran, error = _calls.run_pipeline(
                w, [_calls.statement("BEGIN"), *calls, _calls.statement("COMMIT")]
            )
            results["group"] = (
                getattr(error, "sqlstate", None) if error else [ran[1 + i] for i in completions]
            )

        ts = threading.Thread(target=stale_call)
        ts.start()
        _wait_blocked_by(db.conn, s.info.backend_pid, {claim.info.backend_pid})  # its snapshot: before
        claim.commit()  # the reclaim commits: the stale call locks j and stops at z, behind the gate
        _wait_blocked_by(db.conn, s.info.backend_pid, {gate.info.backend_pid})
        tw = threading.Thread(target=record)
        tw.start()
        _wait_blocked_by(db.conn, w.info.backend_pid, {s.info.backend_pid})  # the group waits for j
        gate.rollback()  # the stale call goes on to z, k and then key a's row
        ts.join(10)
        tw.join(10)
    assert results == {"stale": 2, "group": [1]}  # before: one of them '40P01'
    statuses = dict(
        db.conn.execute("SELECT id, status FROM pglockkit.jobs WHERE id = ANY(%s)", ([j, z, k, a],))
    )
    assert statuses == {j: "dead", z: "done", k: "done", a: "done"}  # j failed on its last attempt
    assert _keys_consistent(db.conn)
