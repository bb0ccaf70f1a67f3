"""The job queue from Python: one function per SQL call. The worker loop is ``pglockkit.worker``
(``Worker``, re-exported here and from ``pglockkit``).

One source: the queue functions of ``pglockkit.aio`` are this module as written (awaited, on an
async connection), and ``tools/async_to_sync.py`` writes ``pglockkit.queue`` from it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg

from pglockkit import _calls
from pglockkit._calls import Job
from pglockkit.worker.lane import NOTIFY_CHANNEL

if True:  # ASYNC
    from pglockkit.worker.driver_async import Worker
else:
    from pglockkit.worker import Worker

__all__ = [
    "NOTIFY_CHANNEL",
    "Job",
    "Worker",
    "cancel",
    "claim",
    "complete",
    "complete_many",
    "enqueue",
    "enqueue_many",
    "extend",
    "extend_many",
    "fail",
    "jobs",
    "pause",
    "rate_limits",
    "release",
    "remove_rate_limit",
    "resume",
    "set_rate_limit",
]


async def enqueue(
    conn: psycopg.AsyncConnection,
    queue: str,
    payload: Any = None,
    *,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    priority: int = 0,
    dedup_key: str | None = None,
    max_attempts: int = 5,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
    rate_key: str | None = None,
) -> int:
    """Add a job; returns its id (the existing job's id when ``dedup_key`` matches a pending one).

    With ``concurrency_key`` (a tenant, an account, a graph) and ``concurrency_limit``, at most that
    many jobs of the queue with that key run at once; jobs of other keys are not held up. With
    ``rate_key`` (an API key, a provider), claims follow that key's rate limit
    (``set_rate_limit``; a key without one has no limit).

    >>> await enqueue(conn, "emails", {"to": "ana@example.com"}, priority=10)  # doctest: +SKIP
    1
    """
    call = _calls.enqueue(
        queue,
        payload,
        run_at=run_at,
        delay=delay,
        priority=priority,
        dedup_key=dedup_key,
        max_attempts=max_attempts,
        concurrency_key=concurrency_key,
        concurrency_limit=concurrency_limit,
        rate_key=rate_key,
    )
    return await _calls.arun(conn, call)


async def enqueue_many(
    conn: psycopg.AsyncConnection,
    queue: str,
    payloads: Sequence[Any],
    *,
    priority: int = 0,
    max_attempts: int = 5,
    rate_key: str | None = None,
) -> list[int]:
    """Add one job per payload in one statement; returns the ids in payload order. ``rate_key``
    is every job's rate key."""
    return await _calls.arun(conn, _calls.enqueue_many(queue, payloads, priority, max_attempts, rate_key))


async def claim(
    conn: psycopg.AsyncConnection, queue: str, worker: str, *, lease: float | timedelta = 300, batch: int = 1
) -> list[Job]:
    """Claim up to ``batch`` jobs; never waits on other claimers. A payload the JSON loader cannot
    decode raises ``PayloadNotDecodable`` after the claim, its ``jobs`` the batch claimed."""
    return await _calls.arun(conn, _calls.claim(queue, worker, lease, batch))


async def complete(conn: psycopg.AsyncConnection, job: Job) -> bool:
    """Mark done; False if this claim is stale (the job was reclaimed or cancelled)."""
    return await _calls.arun(conn, _calls.complete(job))


async def complete_many(conn: psycopg.AsyncConnection, jobs: Sequence[Job]) -> int:
    """Complete a batch in one statement; returns how many claims were current."""
    return await _calls.arun(conn, _calls.complete_many(jobs))


async def fail(
    conn: psycopg.AsyncConnection, job: Job, error: str, retry_in: float | timedelta | None = None
) -> str:
    """Record a failed attempt; returns 'queued' (will retry), 'dead' or 'stale'."""
    return await _calls.arun(conn, _calls.fail(job, error, retry_in))


async def extend(conn: psycopg.AsyncConnection, job: Job, lease: float | timedelta) -> bool:
    """Heartbeat; False if the claim is stale."""
    return await _calls.arun(conn, _calls.extend(job, lease))


async def extend_many(conn: psycopg.AsyncConnection, jobs: Sequence[Job], lease: float | timedelta) -> int:
    """Heartbeat for many jobs in one statement; returns how many claims were current and extended
    (a job whose row another transaction holds is passed over, never waited for)."""
    return await _calls.arun(conn, _calls.extend_many(jobs, lease))


async def release(conn: psycopg.AsyncConnection, job: Job) -> bool:
    """Give a claimed job back unstarted (its attempt does not count)."""
    return await _calls.arun(conn, _calls.release(job))


async def cancel(conn: psycopg.AsyncConnection, job_id: int) -> bool:
    """Cancel a queued or running job; False if it had already finished. A running job's worker
    finds its claim stale at its next complete, fail or extend."""
    return await _calls.arun(conn, _calls.cancel(job_id))


async def set_rate_limit(
    conn: psycopg.AsyncConnection,
    queue: str,
    key: str,
    rate: int,
    per: float | timedelta = 1,
    *,
    burst: int = 1,
) -> None:
    """Let claims start at most ``rate`` jobs of ``queue`` with rate key ``key`` per ``per``
    (seconds or a timedelta), in bursts of up to ``burst``; jobs over the rate are passed over,
    other keys' jobs are claimed meanwhile. Replaces the key's limit if it has one.
    pglockkit_admin only.

    >>> await set_rate_limit(conn, "llm", "openai", 60, timedelta(minutes=1), burst=5)  # doctest: +SKIP
    """
    await _calls.arun(conn, _calls.set_rate_limit(queue, key, rate, per, burst))


async def remove_rate_limit(conn: psycopg.AsyncConnection, queue: str, key: str) -> bool:
    """Lift a key's rate limit; False if it had none. pglockkit_admin only."""
    return await _calls.arun(conn, _calls.remove_rate_limit(queue, key))


async def rate_limits(conn: psycopg.AsyncConnection, queue: str | None = None) -> list[dict]:
    """The rate-limited keys (of ``queue``, or all) as ``pglockkit.rate_limits`` shows them: a dict
    each with ``queue, key, rate, per, burst, next_allowed_at, tokens, waiting``."""
    return await _calls.arun(conn, _calls.rate_limits(queue))


async def pause(conn: psycopg.AsyncConnection, queue: str) -> bool:
    """Pause a queue: once this commits no claim takes its jobs; running jobs go on and enqueue
    works. False if it was paused already. pglockkit_admin only.

    >>> await pause(conn, "emails")  # doctest: +SKIP
    True
    """
    return await _calls.arun(conn, _calls.pause_queue(queue))


async def resume(conn: psycopg.AsyncConnection, queue: str) -> bool:
    """Resume a paused queue (its workers are woken by NOTIFY); False if it was not paused."""
    return await _calls.arun(conn, _calls.resume_queue(queue))


async def jobs(
    conn: psycopg.AsyncConnection, queue: str, status: str | None = None, limit: int = 50
) -> list[dict]:
    """A queue's jobs for display, newest first (with ``status`` only, if given): a dict per job
    with ``id, status, priority``, ``attempts`` ('2/5'), ``run_at`` (text, to the second, so
    that a stored +-infinity reads too), ``worker``, and the first 40 characters of ``payload``
    (its JSON text) and ``last_error``. What ``pglockkit jobs`` prints."""
    return await _calls.arun(conn, _calls.jobs(queue, status, limit))


if True:  # ASYNC
    pass
else:
    __all__ += ["load_handler"]

    def load_handler(spec: str) -> Callable[..., Any]:
        """``'package.module:function'`` to the function; ValueError naming what is wrong (the
        CLI's usage error) if it cannot be had."""
        module_name, sep, func_name = spec.partition(":")
        if not sep or not module_name or not func_name:
            raise ValueError(f"handler must look like module:function, got {spec!r}")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import the handler's module {module_name!r}: {exc}") from exc
        func = getattr(module, func_name, None)
        if func is None:
            raise ValueError(f"module {module_name!r} has no {func_name!r}")
        if not callable(func):
            raise ValueError(f"handler {spec!r} is not callable")
        return func
