"""A call description (``Call``: one SQL statement and what to make of it) and what becomes of
its rows: what ``pglockkit._calls`` (which builds calls) and ``pglockkit._run`` and ``_run_async``
(which run them) share, with no IO of its own."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from psycopg import sql

T = TypeVar("T")
Rows = list[tuple[Any, ...]]


def first(rows: Rows) -> Any:
    return rows[0][0]


def nothing(rows: Rows) -> None:
    return None


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a microsecond more
class Call(Generic[T]):
    """One SQL statement and what to make of it.

    ``done(result, elapsed_s)`` runs after success (logging); ``failed(exc, elapsed_s)`` runs on
    an error already translated to a pglockkit exception where one maps: it re-raises, or
    returns a result that stands in for the call's (a lost session that freed its lock itself)."""

    query: str | sql.Composable
    params: Sequence[Any] | Mapping[str, Any] = ()
    decode: Callable[[Rows], T] = first
    done: Callable[[T, float], None] | None = None
    failed: Callable[[Exception, float], T] | None = None
    adapt: Callable[[Any], None] | None = None  # changes the loaders of the cursor it runs on


def ran(cursors: Sequence[Any]) -> list[Any]:
    """The cursors of a pipeline up to the first that failed or was skipped after a failure."""
    done = []
    for cur in cursors:
        if cur.pgresult is None:
            break
        done.append(cur)
    return done


def finish(call: Call[T], rows: Rows, started: float) -> T:
    result = call.decode(rows)
    if call.done is not None:
        call.done(result, time.monotonic() - started)
    return result
