"""Singleton runs: exactly one caller runs a job's slot (cron pods, periodic ticks)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TypeVar

import psycopg

from pglockkit.connection import connect
from pglockkit.errors import translated
from pglockkit.leases import default_holder

log = logging.getLogger("pglockkit.runs")
T = TypeVar("T")


def today_utc() -> str:
    """The default slot: today's date in UTC, e.g. ``2026-11-30``."""
    return datetime.now(UTC).date().isoformat()


def start_run(conn: psycopg.Connection, job: str, slot: str, holder: str) -> int | None:
    """The run id if this caller won ``job``/``slot``, else None (it ran, or is running elsewhere)."""
    with translated():
        return conn.execute("SELECT pglockkit.start_run(%s, %s, %s)", (job, slot, holder)).fetchone()[0]


def finish_run(conn: psycopg.Connection, run_id: int, ok: bool, detail: str | None = None) -> bool:
    """Record the outcome; False if the run had already finished."""
    with translated():
        return conn.execute("SELECT pglockkit.finish_run(%s, %s, %s)", (run_id, ok, detail)).fetchone()[0]


@contextmanager
def run_once(dsn: str, job: str, slot: str | None = None, holder: str | None = None) -> Iterator[int | None]:
    """Yield the run id if this process won the slot (default: today in UTC), else None.

    The slot is held on a dedicated connection for the whole block; an exception records the run
    as failed (and propagates). If the process dies inside the block, the next ``run_once`` for
    the slot re-runs it.

    >>> with run_once(dsn, "nightly-aggregation") as run:  # doctest: +SKIP
    ...     if run is not None:
    ...         aggregate()
    """
    slot = slot or today_utc()
    with connect(dsn, autocommit=True, application_name=f"pglockkit run {job}") as conn:
        run_id = start_run(conn, job, slot, holder or default_holder())
        if run_id is None:
            log.info("run skipped job=%s slot=%s (already ran or running elsewhere)", job, slot)
            yield None
            return
        log.info("run started job=%s slot=%s id=%s", job, slot, run_id)
        try:
            yield run_id
        except BaseException as exc:
            finish_run(conn, run_id, False, f"{exc.__class__.__name__}: {exc}")
            log.info("run failed job=%s slot=%s id=%s", job, slot, run_id)
            raise
        finish_run(conn, run_id, True)
        log.info("run succeeded job=%s slot=%s id=%s", job, slot, run_id)


def singleton(dsn: str, job: str, slot: Callable[[], str] | str | None = None) -> Callable:
    """Decorator for cron entry points: the function runs at most once per slot across all
    processes; elsewhere the call returns None without running it.

    >>> @singleton(dsn, "nightly-aggregation")  # doctest: +SKIP
    ... def aggregate(): ...
    """

    def decorate(fn: Callable[..., T]) -> Callable[..., T | None]:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs) -> T | None:
            chosen = slot() if callable(slot) else slot
            with run_once(dsn, job, chosen) as run:
                if run is None:
                    return None
                return fn(*args, **kwargs)

        return wrapper

    return decorate
