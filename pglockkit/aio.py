"""pglockkit on ``psycopg.AsyncConnection``, for async code (agent frameworks, web handlers).

The same operations, names and arguments as ``pglockkit.locks``, ``leases``, ``queue`` and
``runs``, awaited. Each one runs the call description the sync function runs
(``pglockkit._calls``): the SQL, argument checks, result decoding, error translation and log
records are the same by construction.

>>> import pglockkit.aio as aio  # doctest: +SKIP
>>> async with await aio.connect(dsn) as conn:
...     async with conn.transaction():
...         await aio.xact_lock(conn, "billing", "invoice:7", timeout=0.2)
>>> async with aio.sole_writer(dsn, "graphs", "restock_plan") as mine:
...     if mine:
...         await graph.ainvoke(state)
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg

from pglockkit import _calls
from pglockkit._calls import Job
from pglockkit.connection import aconnect as connect
from pglockkit.connection import aset_server_keepalives as set_server_keepalives
from pglockkit.connection import sever
from pglockkit.errors import LockTimeout, RetryableError
from pglockkit.leases import CALL_ERRORS, SEVERED_WAIT, _LeaseState
from pglockkit.locks_async import (
    lock_rows,
    namespaces,
    register_namespace,
    resource_key,
    sole_writer,
    try_xact_lock,
    xact_lock,
    xact_lock_all,
)
from pglockkit.queue_async import (
    cancel,
    claim,
    complete,
    complete_many,
    enqueue,
    enqueue_many,
    extend,
    extend_many,
    fail,
    jobs,
    pause,
    rate_limits,
    release,
    remove_rate_limit,
    resume,
    set_rate_limit,
)
from pglockkit.retry import RETRY_BASE, RETRY_CAP, check_attempts, pause_or_raise
from pglockkit.runs_async import finish_run, prune_runs, run_once, runs, singleton, start_run
from pglockkit.worker.driver_async import Worker

T = TypeVar("T")

__all__ = [
    "Job",
    "Lease",
    "Worker",
    "acquire_lease",
    "cancel",
    "check_fence",
    "claim",
    "complete",
    "complete_many",
    "connect",
    "cron_next",
    "enqueue",
    "enqueue_many",
    "extend",
    "extend_many",
    "fail",
    "finish_run",
    "jobs",
    "leases",
    "lock_rows",
    "namespaces",
    "pause",
    "prune_leases",
    "prune_runs",
    "rate_limits",
    "register_namespace",
    "release",
    "release_lease",
    "remove_rate_limit",
    "renew_lease",
    "resource_key",
    "resume",
    "retry",
    "run_once",
    "runs",
    "schedule",
    "schedules",
    "set_rate_limit",
    "set_server_keepalives",
    "singleton",
    "sole_writer",
    "start_run",
    "tick_schedules",
    "try_xact_lock",
    "unschedule",
    "xact_lock",
    "xact_lock_all",
]


# --- listings -------------------------------------------------------------------------------


async def leases(conn: psycopg.AsyncConnection) -> list[dict]:
    """``pglockkit.leases.leases``: every lease as ``pglockkit.lease_status`` shows it."""
    return await _calls.arun(conn, _calls.leases())


# --- leases ---------------------------------------------------------------------------------


async def acquire_lease(
    conn: psycopg.AsyncConnection, name: str, holder: str, ttl: float | timedelta, bind_session: bool = False
) -> int | None:
    """The new fencing token, or None while another holder's lease is live."""
    return await _calls.arun(conn, _calls.acquire_lease(name, holder, ttl, bind_session))


async def renew_lease(
    conn: psycopg.AsyncConnection, name: str, holder: str, token: int, ttl: float | timedelta
) -> bool:
    """True if the lease was still ours and now lasts ``ttl`` from now."""
    return await _calls.arun(conn, _calls.renew_lease(name, holder, token, ttl))


async def release_lease(conn: psycopg.AsyncConnection, name: str, holder: str, token: int) -> bool:
    """True if the lease was ours and is now free."""
    return await _calls.arun(conn, _calls.release_lease(name, holder, token))


async def check_fence(conn: psycopg.AsyncConnection, name: str, token: int) -> None:
    """In the writer's transaction: ``StaleToken`` unless ``token`` is the live lease's."""
    await _calls.arun(conn, _calls.check_fence(conn, name, token))


async def prune_leases(conn: psycopg.AsyncConnection, older_than: float | timedelta) -> int:
    """Delete leases released or expired more than ``older_than`` ago (pglockkit_admin); how many."""
    return await _calls.arun(conn, _calls.prune_leases(older_than))


class Lease(_LeaseState):
    """``pglockkit.Lease`` for async code: renewed by an asyncio task, ``lost`` an ``asyncio.Event``,
    ``on_lost`` a function or a coroutine function (awaited).

    >>> async with Lease(dsn, "nightly-refresh", ttl=30) as lease:  # doctest: +SKIP
    ...     if lease.acquired:
    ...         async with conn.transaction():
    ...             await lease.check_fence(conn)
    ...             await write(conn)
    """

    _event_type = asyncio.Event
    _awaits_on_lost = True
    _task: asyncio.Task[None] | None = None
    _call: asyncio.Future[bool] | None = None  # the renewal in flight, or the last one

    async def __aenter__(self) -> Lease:
        self._stop = asyncio.Event()
        self._conn = await connect(self.dsn, autocommit=True, application_name=self.application_name)
        try:
            if self.bind_session:  # a direct connection, told to notice a vanished host
                await _calls.arun(self._conn, _calls.refuse_pooler(self._conn, *_calls.BOUND_LEASE))
                await set_server_keepalives(self._conn)
            started = time.monotonic()
            self.token = await acquire_lease(self._conn, self.name, self.holder, self.ttl, self.bind_session)
        except BaseException:
            await self._conn.close()
            raise
        self._renewed(started)
        _calls.lease_acquire_event(self.name, self.holder, self.token)
        if self.acquired:
            self._task = asyncio.create_task(self._renew_loop(), name=f"lease-{self.name}")
        return self

    async def check_fence(self, conn: psycopg.AsyncConnection) -> None:
        """``check_fence(name, token)`` in ``conn``'s current transaction."""
        await check_fence(conn, self.name, self._fence_token())

    async def _renew_loop(self) -> None:
        while True:
            wait, runs_out = self._next_renewal()
            try:  # a stop ends the wait, never a renewal in flight on the lease's connection
                await asyncio.wait_for(self._stop.wait(), wait)
                return
            except TimeoutError:
                pass
            if runs_out:
                await self._alose(_calls.RENEWAL_UNANSWERED)
                await self._let_go()
                return
            started = time.monotonic()
            # A task of its own, awaited with a deadline: cancelling a query in flight waits for
            # the server to answer the cancel (up to 10 s in psycopg), a frozen one never does.
            self._call = call = asyncio.ensure_future(
                renew_lease(self._conn, self.name, self.holder, self.token, self.ttl)
            )
            try:
                await asyncio.wait([call], timeout=self._valid_until - started)
            except asyncio.CancelledError:
                call.cancel()
                raise
            if not call.done():
                # Unanswered: a rival may hold the lease by now. The call would wait for TCP to
                # give up: make it fail now.
                sever(self._conn)
                await self._alose(_calls.RENEWAL_UNANSWERED)
                await asyncio.wait([call], timeout=SEVERED_WAIT)
                call.add_done_callback(lambda c: c.cancelled() or c.exception())  # an error nobody reads
                return
            try:
                ok = call.result()
            except CALL_ERRORS as exc:
                await self._alose(_calls.renewal_error(exc))
                await self._let_go()
                return
            if not ok:  # renew_lease has let go of this session's key already
                await self._alose(_calls.RENEWAL_REFUSED)
                return
            self._renewed(started)

    async def _alose(self, reason: str) -> None:
        """``_lose``, awaiting what ``on_lost`` returns if it is awaitable (an ``async def``)."""
        self._record_loss(reason)
        try:
            if self.on_lost is not None:
                result = self.on_lost(self)
                if inspect.isawaitable(result):
                    await result
        except Exception:
            _calls.leases_log.exception("lease %s: on_lost raised", self.name)
        finally:
            self.lost.set()

    async def _let_go(self) -> None:
        """``pglockkit.Lease._let_go``: release with the lost token, best effort."""
        if self._conn.closed or self._conn.broken:
            return
        with suppress(*CALL_ERRORS):
            await release_lease(self._conn, self.name, self.holder, self.token)

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            if self._task is not None:
                await self._task
            if self.acquired and not self.lost.is_set():
                # At most for the rest of the ttl: see leases.Lease.__exit__.
                await _calls.arun(self._conn, _calls.lease_release_wait(self._valid_until - time.monotonic()))
                await release_lease(self._conn, self.name, self.holder, self.token)
                _calls.lease_release_event(self.name, self.holder, self.token)
        except LockTimeout:
            _calls.lease_release_timed_out(self.name)
        except psycopg.OperationalError:
            pass  # connection gone: the lease expires by its ttl (or at once if session-bound)
        finally:
            if self._call is None or self._call.done():
                await self._conn.close()
            else:  # still waiting on the socket: left to the call, which ends when TCP gives up
                _calls.leases_log.warning("lease %s: renewal still in flight, connection left", self.name)


# --- queue ----------------------------------------------------------------------------------


# --- schedules ------------------------------------------------------------------------------


async def schedule(
    conn: psycopg.AsyncConnection,
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
    """``pglockkit.scheduling.schedule``, async."""
    return await _calls.arun(
        conn, _calls.schedule(name, cron, queue, payload, timezone, priority, max_attempts, catch_up)
    )


async def unschedule(conn: psycopg.AsyncConnection, name: str) -> bool:
    """``pglockkit.scheduling.unschedule``, async."""
    return await _calls.arun(conn, _calls.unschedule(name))


async def schedules(conn: psycopg.AsyncConnection) -> list[dict]:
    """``pglockkit.scheduling.schedules``, async."""
    return await _calls.arun(conn, _calls.schedules())


async def tick_schedules(conn: psycopg.AsyncConnection) -> int:
    """``pglockkit.scheduling.tick_schedules``, async."""
    return await _calls.arun(conn, _calls.tick_schedules())


async def cron_next(
    conn: psycopg.AsyncConnection, cron: str, after: datetime | None = None, timezone: str = "UTC"
) -> datetime:
    """``pglockkit.scheduling.cron_next``, async."""
    return await _calls.arun(conn, _calls.cron_next(cron, after, timezone))


# --- retry ----------------------------------------------------------------------------------


async def retry(
    fn: Callable[[], Awaitable[T]],
    *,
    attempts: int = 5,
    base: float = RETRY_BASE,
    cap: float = RETRY_CAP,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> T:
    """``pglockkit.retry`` for coroutines: await ``fn()`` (one whole transaction) until it succeeds,
    retrying deadlocks, serialization failures and lock timeouts with the same full-jitter backoff.

    >>> async def transfer():  # doctest: +SKIP
    ...     async with conn.transaction():
    ...         await xact_lock_all(conn, "accounts", [a, b], timeout=1)
    >>> await retry(transfer)  # doctest: +SKIP

    A plain function is a TypeError, before it runs: ``pglockkit.retry`` calls those. To pass
    arguments, give a ``functools.partial`` of the coroutine function.
    """
    _calls.check_flavour(fn, "pglockkit.aio.retry", "pglockkit.retry", coroutine=True)
    check_attempts(attempts)
    for attempt in range(attempts):
        try:
            return await fn()
        except (psycopg.Error, RetryableError) as exc:
            await sleep(pause_or_raise(exc, attempt, attempts, base, cap))
    raise AssertionError("unreachable")
