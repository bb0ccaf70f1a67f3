# Generated from pglockkit/_run_async.py by tools/async_to_sync.py: do not edit.
# Edit the source, then run `python3 tools/async_to_sync.py` (CI fails while this file
# differs from what the tool writes).
"""Run a call description (``pglockkit._call.Call``) on a connection: one statement, or several
in one round trip. What ``pglockkit._calls`` re-exports as ``run``, ``run``, ``run_pipeline``
and ``run_pipeline``.

One source: this module as written runs calls on a ``psycopg.Connection``, and
``tools/async_to_sync.py`` writes ``pglockkit._run`` (a ``psycopg.Connection``) from it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psycopg

from pglockkit._call import Call, T, finish, ran
from pglockkit.errors import translated


def _execute(conn: psycopg.Connection, call: Call[Any]) -> psycopg.Cursor:
    if call.adapt is None:
        return conn.execute(call.query, call.params)
    cur = conn.cursor()
    call.adapt(cur)
    return cur.execute(call.query, call.params)


def run(conn: psycopg.Connection, call: Call[T]) -> T:
    """Execute ``call``: its result, decoded; an error translated by SQLSTATE (or what the
    call's ``failed`` makes of it)."""
    started = time.monotonic()
    try:
        with translated():
            rows = (_execute(conn, call)).fetchall()
    except Exception as exc:
        if call.failed is None:
            raise
        return call.failed(exc, time.monotonic() - started)
    return finish(call, rows, started)


def run_pipeline(conn: psycopg.Connection, calls: Sequence[Call[Any]]) -> tuple[list[Any], Exception | None]:
    """Send ``calls`` in one round trip (psycopg's pipeline mode). Returns the results of the calls
    that ran, in order, and the error that stopped the rest (None when all ran); the transaction,
    if one is open, is then aborted. A lost connection raises."""
    started = time.monotonic()
    cursors: list[psycopg.Cursor] = []
    error: Exception | None = None
    try:
        with translated():
            if len(calls) == 1:  # one statement: the same, without pipeline mode's cost
                cursors.append(_execute(conn, calls[0]))
            else:
                with conn.pipeline():
                    for call in calls:
                        cursors.append(_execute(conn, call))
    except psycopg.OperationalError:
        raise
    except Exception as exc:
        error = exc
    rows = [cur.fetchall() if cur.description is not None else [] for cur in ran(cursors)]
    return [finish(call, r, started) for call, r in zip(calls, rows, strict=False)], error
