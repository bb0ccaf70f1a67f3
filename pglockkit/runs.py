# Generated from pglockkit/runs_async.py by tools/async_to_sync.py: do not edit.
# Edit the source, then run `python3 tools/async_to_sync.py` (CI fails while this file
# differs from what the tool writes).
"""Singleton runs: exactly one caller runs a job's slot (cron pods, periodic ticks).

One source: the run functions of ``pglockkit.aio`` are this module as written (awaited, on an
async connection), and ``tools/async_to_sync.py`` writes ``pglockkit.runs`` from it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg

from pglockkit import _calls
from pglockkit.connection import connect, set_server_keepalives
from pglockkit.leases import default_holder

T = TypeVar("T")


def today_utc() -> str:
    """The default slot: today's date in UTC, e.g. ``2026-11-30``."""
    return datetime.now(UTC).date().isoformat()


def start_run(conn: psycopg.Connection, job: str, slot: str, holder: str) -> int | None:
    """The run id if this caller won ``job``/``slot``, else None (it ran, or is running elsewhere)."""
    return _calls.run(conn, _calls.start_run(job, slot, holder))


def finish_run(conn: psycopg.Connection, run_id: int, ok: bool, detail: str | None = None) -> bool:
    """Record the outcome (the slot's lock goes when the transaction commits); False if the run had
    already finished or is not this session's (its session ended, and it may have been taken over)."""
    return _calls.run(conn, _calls.finish_run(run_id, ok, detail))


def prune_runs(conn: psycopg.Connection, older_than: float | timedelta) -> int:
    """Delete runs that finished more than ``older_than`` ago (pglockkit_admin); how many. A pruned
    slot can run again: keep rows for as long as any pod may still start their slot.

    >>> prune_runs(conn, timedelta(days=30))  # doctest: +SKIP
    12
    """
    return _calls.run(conn, _calls.prune_runs(older_than))


def runs(conn: psycopg.Connection, job: str | None = None, limit: int = 50) -> list[dict]:
    """Singleton runs from ``pglockkit.run_history``, newest first (of ``job`` only, if given):
    a dict per run with ``id, job, slot, holder, status, attempt, started_at`` (to the second),
    ``duration`` (to the millisecond) and ``detail``. What ``pglockkit runs`` prints."""
    return _calls.run(conn, _calls.runs(job, limit))


@contextmanager
def run_once(dsn: str, job: str, slot: str | None = None, holder: str | None = None) -> Iterator[int | None]:
    """Yield the run id if this process won the slot (default: today in UTC), else None.

    The slot is held on a dedicated, direct connection for the whole block, with the server
    keepalives and ``idle_session_timeout`` off of ``sole_writer``; an exception records the run
    as failed (and propagates). If the process dies inside the block, the next ``run_once`` for
    the slot re-runs it; if this host vanishes, the server frees the slot within 25 s.

    >>> with run_once(dsn, "nightly-aggregation") as run:  # doctest: +SKIP
    ...     if run is not None:
    ...         aggregate()
    """
    slot = today_utc() if slot is None else slot
    with connect(dsn, autocommit=True, application_name=f"pglockkit run {job}") as conn:
        _calls.run(conn, _calls.refuse_pooler(conn, *_calls.RUN_ONCE_POOLER))
        # The slot's lock lives as long as this session, idle while the block runs: keep the
        # server's idle_session_timeout from ending it, and bound how long a vanished host keeps it.
        set_server_keepalives(conn)
        run_id = start_run(conn, job, slot, default_holder() if holder is None else holder)
        if run_id is None:
            _calls.run_event("skipped", job, slot, None)
            yield None
            return
        _calls.run_event("started", job, slot, run_id)
        try:
            yield run_id
        except BaseException as exc:
            try:
                recorded = finish_run(conn, run_id, False, _calls.run_failure_detail(exc, conn.info.encoding))
            except psycopg.OperationalError as lost:  # the caller gets the body's exception
                _calls.run_event("unrecorded", job, slot, run_id, lost)
            else:
                _calls.run_event("failed" if recorded else "unrecorded", job, slot, run_id)
            raise
        try:
            recorded = finish_run(conn, run_id, True)
        except psycopg.OperationalError as lost:  # the slot is free: say so, not just the driver's words
            _calls.run_event("unrecorded", job, slot, run_id, lost)
            raise _calls.unrecorded_success(job, slot, run_id, lost) from lost
        _calls.run_event("succeeded" if recorded else "unrecorded", job, slot, run_id)


_Entry = Callable[..., T]
_Singleton = Callable[..., T | None]


def singleton(dsn: str, job: str, slot: Callable[[], str] | str | None = None) -> Callable:
    """Decorator for cron entry points: the function runs at most once per slot across all
    processes; elsewhere the call returns None without running it. ``pglockkit.singleton`` takes a
    plain function, ``pglockkit.aio.singleton`` a coroutine function (run inside the slot); given
    the other kind, each raises a TypeError.

    >>> @singleton(dsn, "nightly-aggregation")  # doctest: +SKIP
    ... def aggregate(): ...
    """

    def decorate(fn: _Entry[T]) -> _Singleton[T]:
        _calls.check_flavour(fn, "pglockkit.singleton", "pglockkit.aio.singleton", coroutine=False)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> T | None:
            chosen = slot() if callable(slot) else slot
            with run_once(dsn, job, chosen) as run:
                if run is None:
                    return None
                return fn(*args, **kwargs)

        return wrapper

    return decorate
