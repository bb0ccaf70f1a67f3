"""Per-key rate limits enforced by claim_job, and pause / resume of a queue, against real servers
with real concurrent connections."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import psycopg
import pytest

import pglockkit
from pglockkit import queue as q


def _claims_fit_the_rate(times: list, rate_per_s: float, burst: int) -> list[str]:
    """Every window [t_i, t_j] between two claims (the tight ones) holds at most
    rate * (t_j - t_i) + burst claims; returns the windows that hold more."""
    times = sorted(times)
    bad = []
    for i in range(len(times)):
        for j in range(i, len(times)):
            span = (times[j] - times[i]).total_seconds()
            if j - i + 1 > rate_per_s * span + burst + 1e-9:
                bad.append(f"{j - i + 1} claims in {span:.6f} s from {times[i]}")
    return bad


def test_three_limited_keys_eight_workers_ten_seconds(db):
    """3 keys at 10/s (burst 5), 8 workers on their own connections, 10 s, single and batch
    claims: no window holds more than rate * time + burst claims of a key (claim times are
    started_at, the database's clock); the unlimited key's jobs are not slowed; key A also has a
    concurrency limit of 2, which holds as well."""
    rate, burst, seconds = 10, 5, 10.0
    for key in ("A", "B", "C"):
        db.conn.execute("SELECT pglockkit.set_rate_limit('t', %s, %s, '1 second', %s)", (key, rate, burst))
    for i in range(200):  # more than 10 s can take: rate * 10 + burst = 105
        q.enqueue(db.conn, "t", {"k": "A", "i": i}, rate_key="A", concurrency_key="A", concurrency_limit=2)
        q.enqueue(db.conn, "t", {"k": "B", "i": i}, rate_key="B")
        q.enqueue(db.conn, "t", {"k": "C", "i": i}, rate_key="C")
    free = q.enqueue_many(db.conn, "t", [{"k": "free", "i": i} for i in range(600)])
    errors: list[BaseException] = []
    start = threading.Barrier(8)
    deadline = time.monotonic() + seconds + 1  # the barrier and connecting take a moment

    def worker(n: int) -> None:
        try:
            with db.connect(autocommit=True) as conn:
                start.wait()
                while time.monotonic() < deadline:
                    jobs = q.claim(conn, "t", f"w{n}", lease=60, batch=1 if n % 2 else 4)
                    if not jobs:
                        time.sleep(0.005)
                        continue
                    if any(j.payload["k"] == "A" for j in jobs):
                        time.sleep(0.02)  # long enough for the concurrency limit to matter
                    assert q.complete_many(conn, jobs) == len(jobs)
        except BaseException as exc:  # reported below
            errors.append(exc)

    running_a: list[int] = []

    def watch() -> None:  # key A's running jobs, as a snapshot sees them (started_at is a claim's start)
        with db.connect(autocommit=True) as conn:
            while time.monotonic() < deadline:
                running_a.append(
                    conn.execute(
                        "SELECT count(*) FROM pglockkit.jobs WHERE queue = 't' AND concurrency_key = 'A' "
                        "AND status = 'running'"
                    ).fetchone()[0]
                )
                time.sleep(0.01)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)] + [
        threading.Thread(target=watch)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert max(running_a) == 2, running_a  # reached, never passed
    rows = db.conn.execute(
        "SELECT payload->>'k', started_at FROM pglockkit.jobs WHERE status = 'done'"
    ).fetchall()
    by_key: dict[str, list] = {}
    for key, started in rows:
        by_key.setdefault(key, []).append(started)
    for key in ("A", "B", "C"):
        times = by_key[key]
        assert _claims_fit_the_rate(times, rate, burst) == [], key
        span = (max(times) - min(times)).total_seconds()
        # The limit was the bound, not something else: the key kept close to its rate.
        assert len(times) >= 0.7 * (rate * span + burst), (key, len(times), span)
        assert span >= seconds - 2, (key, span)
    # The unlimited key's 600 jobs: all done, at far more than the limited keys' 10/s.
    free_times = sorted(by_key["free"])
    assert len(free_times) == len(free)
    assert (free_times[-1] - free_times[0]).total_seconds() < 600 / (10 * rate)


def test_racing_claimers_never_both_take_the_last_token(db):
    """One token (burst 1, 1 per hour), 6 connections claiming at one barrier, 15 rounds: each
    round exactly one job of the key is claimed; and an explicit interleaving: while one claim's
    transaction holds the token's row, another claim passes the key over (never waits) and
    takes the other key's job."""
    conns = [db.connect(autocommit=True) for _ in range(6)]
    try:
        for rnd in range(15):
            key = f"k{rnd}"
            db.conn.execute("SELECT pglockkit.set_rate_limit('race', %s, 1, '1 hour', 1)", (key,))
            for _ in range(6):
                q.enqueue(db.conn, "race", {"r": rnd}, rate_key=key)
            barrier = threading.Barrier(len(conns))
            got: list[int] = []

            def claim(conn: psycopg.Connection, barrier: threading.Barrier, got: list[int]) -> None:
                barrier.wait()
                got.extend(j.id for j in q.claim(conn, "race", "w", batch=2))

            threads = [threading.Thread(target=claim, args=(c, barrier, got)) for c in conns]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(got) == 1, (rnd, got)
        db.conn.execute("SELECT pglockkit.set_rate_limit('x', 'one', 1, '1 hour', 1)")
        first = q.enqueue(db.conn, "x", {}, rate_key="one")
        q.enqueue(db.conn, "x", {}, rate_key="one")
        other = q.enqueue(db.conn, "x", {}, rate_key="two")  # no limit
        holder, claimer = conns[0], conns[1]
        holder.execute("BEGIN")
        assert [j.id for j in q.claim(holder, "x", "h")] == [first]  # the token's row is held
        began = time.monotonic()
        assert [j.id for j in q.claim(claimer, "x", "c", batch=5)] == [other]
        assert time.monotonic() - began < 1.0  # passed over, not waited for
        holder.execute("COMMIT")
        assert q.claim(claimer, "x", "c", batch=5) == []  # the token is spent
    finally:
        for c in conns:
            c.close()


def test_a_batch_takes_at_most_the_tokens_and_the_view_shows_the_key(db):
    db.conn.execute("SELECT pglockkit.set_rate_limit('b', 'api', 1, '1 hour', 3)")
    limited = [q.enqueue(db.conn, "b", {"n": i}, rate_key="api") for i in range(5)]
    free = [q.enqueue(db.conn, "b", {"free": i}) for i in range(2)]
    view = (
        "SELECT key, rate, per, burst, tokens, waiting, next_allowed_at - clock_timestamp() "
        "FROM pglockkit.rate_limits"
    )
    assert db.conn.execute(view).fetchone()[:6] == ("api", 1, timedelta(hours=1), 3, 3, 5)
    got = [j.id for j in q.claim(db.conn, "b", "w", batch=10)]
    assert got == limited[:3] + free
    assert q.claim(db.conn, "b", "w", batch=10) == []
    *_, tokens, waiting, wait = db.conn.execute(view).fetchone()
    assert (tokens, waiting) == (0, 2)
    assert timedelta(minutes=59) < wait <= timedelta(hours=1)  # 3 taken at once: the next in 1 step
    # A reclaimed expired lease is a claim too: it waits for a token like any job.
    db.conn.execute(
        "UPDATE pglockkit.jobs SET lease_expires_at = clock_timestamp() WHERE id = %s", (limited[0],)
    )
    assert q.claim(db.conn, "b", "w", batch=10) == []
    assert db.conn.execute("SELECT pglockkit.remove_rate_limit('b', 'api')").fetchone()[0] is True
    assert db.conn.execute("SELECT pglockkit.remove_rate_limit('b', 'api')").fetchone()[0] is False
    assert sorted(j.id for j in q.claim(db.conn, "b", "w", batch=10)) == limited[:1] + limited[3:]
    # enqueue_jobs gives every job of the batch the rate key.
    db.conn.execute("SELECT pglockkit.set_rate_limit('b', 'bulk', 1, '1 hour', 2)")
    ids = q.enqueue_many(db.conn, "b", [{}, {}, {}], rate_key="bulk")
    assert [j.id for j in q.claim(db.conn, "b", "w", batch=10)] == ids[:2]


BAD_RATE_CALLS = [
    ("set_rate_limit('q', 'k', 0, '1 s', 1)", "22023"),
    ("set_rate_limit('q', 'k', -1, '1 s', 1)", "22023"),
    ("set_rate_limit('q', 'k', 10, '0 s', 1)", "22023"),
    ("set_rate_limit('q', 'k', 10, '-1 s', 1)", "22023"),
    ("set_rate_limit('q', 'k', 10, '1 s', 0)", "22023"),
    ("set_rate_limit('q', '', 10, '1 s', 1)", "22023"),
    ("set_rate_limit('', 'k', 10, '1 s', 1)", "22023"),
    ("set_rate_limit(NULL, 'k', 10, '1 s', 1)", "22004"),
    ("set_rate_limit('q', NULL, 10, '1 s', 1)", "22004"),
    ("set_rate_limit('q', 'k', NULL, '1 s', 1)", "22004"),
    ("set_rate_limit('q', 'k', 10, NULL, 1)", "22004"),
    ("set_rate_limit('q', 'k', 10, '1 s', NULL)", "22004"),
    ("set_rate_limit('q', 'k', 10, '367 days', 1)", "22003"),
    # Positive compared as intervals (a year is 360 days there) but not in seconds (365.25):
    # 0 s long, which divided by zero in every claim of the queue, and -4.25 days, no limit.
    ("set_rate_limit('q', 'k', 1, '-1 year +365 days 6 hours', 1)", "22023"),
    ("set_rate_limit('q', 'k', 1, '-1 year +361 days', 1)", "22023"),
    ("set_rate_limit('q', 'k', 1, '1 year 1 day', 1)", "22003"),  # 366.25 days in seconds
    ("set_rate_limit('q', 'k', 10, '1 s', 1000001)", "22003"),
    ("set_rate_limit('q', 'k', 1, '366 days', 100)", "22003"),
    ("set_rate_limit('q', repeat('k', 1025), 10, '1 s', 1)", "23514"),
    ("remove_rate_limit('q', NULL)", "22004"),
    ("remove_rate_limit(NULL, 'k')", "22004"),
    ("enqueue_job('q', rate_key => '')", "22023"),
    ("enqueue_job('q', rate_key => repeat('k', 1025))", "23514"),
    ("enqueue_jobs('q', ARRAY['{}']::jsonb[], rate_key => '')", "22023"),
    ("pause_queue(NULL)", "22004"),
    ("pause_queue('')", "22023"),
    ("resume_queue(NULL)", "22004"),
]


def test_bad_rate_limit_and_pause_input_is_refused_and_changes_nothing(db):
    db.conn.execute("SELECT pglockkit.set_rate_limit('q', 'k', 10, '1 s', 5)")
    state = (
        "SELECT (SELECT array_agg(r::text) FROM pglockkit.job_rates r), "
        "(SELECT count(*) FROM pglockkit.jobs), (SELECT count(*) FROM pglockkit.paused_queues)"
    )
    before = db.conn.execute(state).fetchone()
    for call, sqlstate in BAD_RATE_CALLS:
        with pytest.raises(psycopg.Error) as err:
            db.conn.execute(f"SELECT pglockkit.{call}")
        assert err.value.sqlstate == sqlstate, call
    assert db.conn.execute(state).fetchone() == before


def test_pause_while_four_workers_drain(db):
    """No claim that starts after pause_queue committed claims anything; the jobs running then
    finish (complete_job works); enqueue works; queue_stats shows the pause; resume continues
    until the queue is drained."""
    q.enqueue_many(db.conn, "p", [{"i": i} for i in range(300)])
    claims: list[tuple[float, int]] = []  # (monotonic time the claim was sent, jobs it got)
    completed: list[bool] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(n: int) -> None:
        try:
            with db.connect(autocommit=True) as conn:
                while not stop.is_set():
                    sent = time.monotonic()
                    jobs = q.claim(conn, "p", f"w{n}", lease=60, batch=2)
                    claims.append((sent, len(jobs)))
                    if not jobs:
                        time.sleep(0.01)
                        continue
                    time.sleep(0.02)  # the work: the pause lands while jobs run
                    completed.extend(q.complete(conn, j) for j in jobs)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.4)
    assert db.conn.execute("SELECT pglockkit.pause_queue('p')").fetchone()[0] is True  # autocommit
    paused = time.monotonic()
    late = q.enqueue(db.conn, "p", {"late": True})
    time.sleep(0.5)
    stats = "SELECT ready, running, done, paused FROM pglockkit.queue_stats WHERE queue = 'p'"
    ready, running, done, is_paused = db.conn.execute(stats).fetchone()
    assert is_paused and running == 0 and 0 < done < 300 and ready == 301 - done
    assert [c for c in claims if c[0] > paused and c[1] > 0] == []
    assert any(c[0] > paused for c in claims)  # the workers kept trying
    assert db.conn.execute("SELECT pglockkit.resume_queue('p')").fetchone()[0] is True
    for _ in range(200):
        if db.conn.execute("SELECT done FROM pglockkit.queue_stats WHERE queue = 'p'").fetchone()[0] == 301:
            break
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
    assert all(completed) and len(completed) == 301
    assert q.jobs(db.conn, "p", "done", limit=1000)[0]["id"] == late
    assert db.conn.execute(stats).fetchone()[3] is False


def test_a_paused_queue_claims_nothing_on_any_path(db):
    """Every path of claim_job checks the pause: single and batch claims, a queue with
    concurrency keys, one with rate limits, one with an expired lease to reclaim."""
    q.enqueue(db.conn, "plain", {})
    q.enqueue(db.conn, "keyed", {}, concurrency_key="k", concurrency_limit=1)
    db.conn.execute("SELECT pglockkit.set_rate_limit('rated', 'r', 10, '1 s', 5)")
    q.enqueue(db.conn, "rated", {}, rate_key="r")
    q.enqueue(db.conn, "expired", {})
    [job] = q.claim(db.conn, "expired", "w", lease=0.001)
    time.sleep(0.01)
    queues = ("plain", "keyed", "rated", "expired")
    for queue in queues:
        assert db.conn.execute("SELECT pglockkit.pause_queue(%s)", (queue,)).fetchone()[0] is True
        assert q.claim(db.conn, queue, "w") == [] and q.claim(db.conn, queue, "w", batch=5) == [], queue
    held = "SELECT status, token FROM pglockkit.jobs WHERE id = %s"
    assert db.conn.execute(held, (job.id,)).fetchone() == ("running", job.token)  # expired, not reclaimed
    stats = dict(db.conn.execute("SELECT queue, paused FROM pglockkit.queue_stats").fetchall())
    assert stats == dict.fromkeys(queues, True)
    for queue in queues:
        assert db.conn.execute("SELECT pglockkit.resume_queue(%s)", (queue,)).fetchone()[0] is True
        assert len(q.claim(db.conn, queue, "w", batch=5)) == 1, queue


def test_integers_out_of_range_from_python_get_22003_naming_the_argument(db):
    """docs/queue.md: a burst over 1,000,000 is 22003 (InvalidArgument). A Python int beyond
    int4 went as a bigint, and the call failed with 42883 "function pglockkit.set_rate_limit(unknown,
    unknown, smallint, interval, bigint) does not exist" and a hint to add casts; the same for
    schedule()'s catch_up, enqueue's priority and claim's batch (and the CLI's forms of them)."""
    big = 3_000_000_000
    calls = {
        "burst": lambda: q.set_rate_limit(db.conn, "q", "k", 5, 1, burst=big),
        "catch_up": lambda: pglockkit.schedule(db.conn, "s", "* * * * *", "q", catch_up=big),
        "priority": lambda: q.enqueue(db.conn, "q", {}, priority=-big),
        "batch": lambda: q.claim(db.conn, "q", "w", batch=big),
    }
    for name, call in calls.items():
        with pytest.raises(pglockkit.InvalidArgument) as refused:
            call()
        assert refused.value.sqlstate == "22003", name
        assert f"{name} {-big if name == 'priority' else big} is out of range" in str(refused.value)
    # Nothing was stored by the refused calls.
    assert db.conn.execute("SELECT count(*) FROM pglockkit.jobs").fetchone()[0] == 0
    assert db.conn.execute("SELECT count(*) FROM pglockkit.rate_limits").fetchone()[0] == 0


def test_next_rate_token_says_how_long_due_jobs_wait_for_a_token(db):
    c = db.conn
    wait = "SELECT extract(epoch FROM pglockkit.next_rate_token(%s))::float8"
    c.execute("SELECT pglockkit.set_rate_limit('nt', 'k', 1, '1 second', 1)")
    assert c.execute(wait, ("nt",)).fetchone()[0] is None  # no job waits
    q.enqueue_many(c, "nt", [{}, {}], rate_key="k")
    assert c.execute(wait, ("nt",)).fetchone()[0] is None  # a token now: nothing waits for one
    assert len(q.claim(c, "nt", "w", batch=2)) == 1  # takes the token; one job left due
    assert 0.5 < c.execute(wait, ("nt",)).fetchone()[0] <= 1.0
    q.enqueue(c, "nt", {}, rate_key="other")  # a key without a limit waits for nothing
    assert 0.5 < c.execute(wait, ("nt",)).fetchone()[0] <= 1.0
    assert c.execute("SELECT pglockkit.pause_queue('nt')").fetchone()[0] is True
    assert c.execute(wait, ("nt",)).fetchone()[0] is None  # paused: no token makes a job claimable
    assert c.execute(wait, ("elsewhere",)).fetchone()[0] is None
    for bad, state in (("NULL", "22004"), ("''", "22023")):
        with pytest.raises(psycopg.Error) as refused:
            c.execute(f"SELECT pglockkit.next_rate_token({bad})")
        assert refused.value.sqlstate == state


@pytest.mark.parametrize("exit_when_idle", [False, True], ids=["running", "exit-when-idle"])
@pytest.mark.parametrize("flavour", ["threads", "asyncio"])
def test_a_worker_starts_a_limited_keys_jobs_at_its_rate_not_its_poll_interval(db, exit_when_idle, flavour):
    """A worker (poll_interval 1 s, the default) over a backlog of one key limited to 10 a second
    (burst 1) found the key without a token 100 ms before the next one and slept its whole poll
    interval (no NOTIFY comes with a token): one job a second. With exit_when_idle it stopped
    after the first job, the rest due and waiting only for tokens."""
    from pglockkit.worker import Worker

    db.conn.execute("SELECT pglockkit.set_rate_limit('wr', 'k', 10, '1 second', 1)")
    q.enqueue_many(db.conn, "wr", [{"i": i} for i in range(200 if not exit_when_idle else 20)], rate_key="k")

    def handler(job, conn) -> None:
        pass

    async def async_handler(job, conn) -> None:
        pass

    worker = Worker(db.dsn, "wr", handler if flavour == "threads" else async_handler, tick_schedules=False)
    if exit_when_idle:
        started = time.monotonic()
        assert worker.run(exit_when_idle=True) == 20
        assert time.monotonic() - started >= 1.7  # 19 tokens at 10 a second: it obeyed the limit
        return
    runner = threading.Thread(target=worker.run)
    runner.start()
    time.sleep(4)
    worker.stop()
    runner.join(30)
    done = db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE status = 'done'").fetchone()[0]
    assert 0.7 * 10 * 4 <= done <= 10 * 4 + 2, done  # the limit, not the poll interval, sets the pace
