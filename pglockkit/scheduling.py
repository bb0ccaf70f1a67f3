# Generated from pglockkit/scheduling_async.py by tools/async_to_sync.py: do not edit.
# Edit the source, then run `python3 tools/async_to_sync.py` (CI fails while this file
# differs from what the tool writes).
"""Schedules from Python: cron expressions kept in the database (``pglockkit.schedule``), ticked
into the job queue exactly once per slot by whoever ticks first: every ``Worker`` (about once a
second), ``pglockkit scheduler``, or ``SELECT pglockkit.tick_schedules()`` from pg_cron. One
function per SQL call; docs/schedules.md says what the SQL guarantees.

One source: the schedule functions of ``pglockkit.aio`` are this module as written (awaited, on an
async connection), and ``tools/async_to_sync.py`` writes ``pglockkit.scheduling`` from it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from pglockkit import _calls

__all__ = ["cron_next", "schedule", "schedules", "tick_schedules", "unschedule"]


def schedule(
    conn: psycopg.Connection,
    name: str,
    cron: str,
    queue: str,
    payload: Any = None,
    *,
    timezone: str = "UTC",
    priority: int = 0,
    max_attempts: int = 5,
    catch_up: int = 1,
) -> datetime:
    """Create or replace the schedule ``name``; returns its next run. At every slot of ``cron``
    (5 fields, local time in ``timezone``) a job goes into ``queue`` with ``payload`` (a dict)
    plus ``_schedule`` (the name) and ``_slot`` (the slot, UTC ISO text). After downtime the
    newest ``catch_up`` missed slots are enqueued (1: the latest only). pglockkit_admin only.

    >>> schedule(conn, "nightly-report", "0 2 * * *", "reports", {"kind": "daily"},
    ...          timezone="Europe/Berlin")  # doctest: +SKIP
    datetime.datetime(2025, 3, 31, 0, 0, tzinfo=...)
    """
    return _calls.run(
        conn, _calls.schedule(name, cron, queue, payload, timezone, priority, max_attempts, catch_up)
    )


def unschedule(conn: psycopg.Connection, name: str) -> bool:
    """Delete the schedule ``name``; False if there was none. pglockkit_admin only."""
    return _calls.run(conn, _calls.unschedule(name))


def schedules(conn: psycopg.Connection) -> list[dict]:
    """Every schedule, by name: a dict per schedule with the columns of ``pglockkit.schedules``
    (``name, cron, timezone, queue, payload, priority, max_attempts, catch_up, next_run,
    last_run, last_job_id, last_error``). What ``pglockkit schedules`` prints."""
    return _calls.run(conn, _calls.schedules())


def tick_schedules(conn: psycopg.Connection) -> int:
    """Enqueue every due slot of every schedule (each slot once, whoever ticks); returns how many
    jobs this call enqueued. Never waits on another ticker."""
    return _calls.run(conn, _calls.tick_schedules())


def cron_next(
    conn: psycopg.Connection, cron: str, after: datetime | None = None, timezone: str = "UTC"
) -> datetime:
    """The first slot of ``cron`` after ``after`` (default: now) in ``timezone``, as the
    database computes it (``pglockkit.cron_next``)."""
    return _calls.run(conn, _calls.cron_next(cron, after, timezone))
