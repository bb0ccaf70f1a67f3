"""backoff(): the pause retry() takes between attempts, computed without a server (retry() itself
against a real server: tests/sql/test_retry.py)."""

from __future__ import annotations

import random

from pglockkit import backoff


def test_backoff_is_jittered_and_capped():
    rng = random.Random(7)
    pauses = [backoff(5, base=0.05, cap=1.0, rng=rng) for _ in range(500)]
    assert all(0 <= p <= 1.0 for p in pauses)
    assert max(pauses) - min(pauses) > 0.8  # spread over the window, not synchronised
    assert max(backoff(0, base=0.05, rng=rng) for _ in range(100)) <= 0.05


def test_backoff_after_a_long_outage_stays_capped():
    # A worker's reconnects count failures in a row: at 1,024 (about 85 minutes of outage at the
    # default 10 s cap) 0.1 * 2**1024 overflowed a float and the OverflowError ended the worker.
    rng = random.Random(3)
    pauses = [backoff(n, base=0.1, cap=10.0, rng=rng) for n in (1023, 1024, 5000, 10**9)]
    assert all(0 <= p <= 10.0 for p in pauses)


def test_a_tick_that_works_after_failures_is_followed_by_one_a_second_later():
    """docs/schedules.md: failing ticks are tried again after 2, 4, 8 ... up to 30 s, "and at once
    a second again after one works". The Ticker keeps its failure count until the next due() after
    the tick that worked, so that due() still waits the backed-off interval (up to 30 s): a worker
    ticks the schedules once more at the backoff's pace before going back to one a second."""
    import time

    import psycopg

    from pglockkit.worker.lane import Ticker

    ticker = Ticker(True)
    assert ticker.due()
    ticker.failed(psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"))
    time.sleep(2.05)  # the backoff after one failure: 2 s
    assert ticker.due()  # this tick works (no failed())
    time.sleep(1.05)
    assert ticker.due(), "a second after a tick that worked, the next was not due"
