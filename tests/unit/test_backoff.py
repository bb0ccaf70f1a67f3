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
