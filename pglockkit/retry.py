# Generated from pglockkit/retry_async.py by tools/async_to_sync.py: do not edit.
# Edit the source, then run `python3 tools/async_to_sync.py` (CI fails while this file
# differs from what the tool writes).
"""Retry a transaction on deadlock (40P01), serialization failure (40001) and lock timeout (55P03).

One source: ``pglockkit.aio.retry`` is this module's ``retry`` as written (it awaits the
transaction), and ``tools/async_to_sync.py`` writes ``pglockkit.retry`` from it."""

from __future__ import annotations

import inspect
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from pglockkit import _calls
from pglockkit.errors import RetryableError, from_psycopg

log = logging.getLogger("pglockkit.retry")

T = TypeVar("T")

_Transaction = Callable[[], T]
_Sleep = Callable[[float], Any]
_SLEEP = time.sleep

# The pauses of the kit's own retries, named once (seconds).
RETRY_BASE = 0.05  # the first pause of retry() and backoff()
RETRY_CAP = 5.0  # the longest pause of retry()
RECONNECT_BASE = 0.1  # the first pause before a worker's reconnect or an install's next try
TICK_BACKOFF_CAP = 30.0  # the longest pause between schedule ticks that keep failing (worker, scheduler)


def backoff(
    attempt: int, *, base: float = RETRY_BASE, cap: float = RETRY_CAP, rng: random.Random | None = None
) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)].

    Jitter is what keeps a swarm of retrying workers from synchronising into a thundering herd.
    The exponent stops growing at 64 (any cap is reached long before): ``2**1024`` overflows a
    float, which an outage of 1,024 failed reconnects in a row reached.
    """
    return (rng or random).uniform(0, min(cap, base * (2 ** min(attempt, 64))))


def retry(
    fn: _Transaction[T],
    *,
    attempts: int = 5,
    base: float = RETRY_BASE,
    cap: float = RETRY_CAP,
    sleep: _Sleep = _SLEEP,
) -> T:
    """Run ``fn()`` until it succeeds, retrying deadlocks, serialization failures and lock
    timeouts with full-jitter backoff. ``fn`` must run one whole transaction (a retry re-runs all
    of it):

    >>> def transfer():  # doctest: +SKIP
    ...     with conn.transaction():
    ...         xact_lock_all(conn, "accounts", [a, b], timeout=1)
    ...         ...
    >>> retry(transfer)  # doctest: +SKIP

    After ``attempts`` tries the last error is raised (as a pglockkit error where one maps). To
    pass arguments, give a ``functools.partial``. ``pglockkit.retry`` calls plain functions and
    ``pglockkit.aio.retry`` awaits coroutine functions; given the other kind, each raises a
    TypeError before it runs (``pglockkit.retry`` would return an unawaited coroutine after one
    try, never retried).
    """
    _calls.check_flavour(fn, "pglockkit.retry", "pglockkit.aio.retry", coroutine=False)
    check_attempts(attempts)
    for attempt in range(attempts):
        try:
            result = fn()
        except (psycopg.Error, RetryableError) as exc:
            sleep(pause_or_raise(exc, attempt, attempts, base, cap))
            continue
        if inspect.iscoroutine(result):  # a plain function that returns one: lambda: transfer()
            result.close()
            raise TypeError(
                f"pglockkit.retry got a coroutine from {fn!r}, which it cannot await: use pglockkit.aio.retry"
            )
        return result
    raise AssertionError("unreachable")


def check_attempts(attempts: int) -> None:
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")


def pause_or_raise(
    exc: psycopg.Error | RetryableError, attempt: int, attempts: int, base: float, cap: float
) -> float:
    """The pause before the next try after ``exc`` failed try ``attempt`` (from 0); raises ``exc``
    (as a pglockkit error where one maps) when it is not retryable or no try is left.
    Call it while ``exc`` is being handled. Shared by ``retry`` and ``pglockkit.aio.retry``."""
    err = from_psycopg(exc) if isinstance(exc, psycopg.Error) else exc
    if not isinstance(err, RetryableError) or attempt == attempts - 1:
        if err is exc:
            raise exc
        raise err from exc
    pause = backoff(attempt, base=base, cap=cap)
    log.info("retrying after sqlstate=%s attempt=%d pause_ms=%.1f", err.sqlstate, attempt + 1, pause * 1000)
    return pause
