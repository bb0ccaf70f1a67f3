"""retry(): jittered backoff on lock timeouts, deadlocks and serialization failures, against a
real server; other errors are not retried."""

from __future__ import annotations

import threading

import pytest

import pglockkit
from pglockkit import retry


def test_retries_a_lock_timeout_until_the_holder_lets_go(db, ns):
    holder = db.connect()
    holder.execute("SELECT pglockkit.try_lock(%s, 'hot')", (ns,))
    threading.Timer(0.4, holder.close).start()  # the holder's session ends: lock released
    attempts = []

    with db.connect() as conn:

        def work():
            attempts.append(1)
            with conn.transaction():
                pglockkit.xact_lock(conn, ns, "hot", timeout=0.1)
            return "done"

        assert retry(work, attempts=30, base=0.02, cap=0.1) == "done"
    assert len(attempts) >= 2


def test_gives_up_after_attempts_with_a_lock_timeout(db, ns):
    with db.connect() as holder, db.connect() as conn:
        holder.execute("SELECT pglockkit.try_lock(%s, 'hot')", (ns,))
        calls = []

        def work():
            calls.append(1)
            with conn.transaction():
                pglockkit.xact_lock(conn, ns, "hot", timeout=0.05)

        with pytest.raises(pglockkit.LockTimeout):
            retry(work, attempts=3, base=0.01)
        assert len(calls) == 3


def test_does_not_retry_other_errors(db):
    calls = []

    def work():
        calls.append(1)
        with db.connect() as conn, conn.transaction():
            pglockkit.xact_lock(conn, "unregistered", "x")

    with pytest.raises(pglockkit.UnknownNamespace):
        retry(work, attempts=5)
    assert calls == [1]


def test_deadlock_victim_retries_and_both_finish(db, ns):
    barrier = threading.Barrier(2)
    results, attempts = [], []

    def session(first, second):
        with db.connect() as conn:
            conn.execute("SET deadlock_timeout = '100ms'")
            state = {"round": 0}

            def work():
                attempts.append(first)
                state["round"] += 1
                with conn.transaction():
                    pglockkit.xact_lock(conn, ns, first, timeout=10)
                    if state["round"] == 1:
                        barrier.wait()
                    pglockkit.xact_lock(conn, ns, second, timeout=10)
                return first

            results.append(retry(work, attempts=5, base=0.05))

    threads = [threading.Thread(target=session, args=p) for p in (("a", "b"), ("b", "a"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["a", "b"]
    assert len(attempts) == 3  # one of them was the deadlock victim and ran twice
