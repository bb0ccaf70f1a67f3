"""Leases with fencing tokens: a ``Lease`` that renews itself, and the SQL calls it wraps.

A lease outlives connections (unlike a session lock): it is a row with an expiry on the server's
clock. Its token grows at every acquisition, so a writer that lost the lease without noticing is
stopped by ``check_fence`` in its own transaction.

One source: the lease functions and ``Lease`` of ``pglockkit.aio`` are this module as written
(renewed by an asyncio task), and ``tools/async_to_sync.py`` writes ``pglockkit.leases`` from it
(renewed by a thread). What a renewal decides (when to renew, when the ttl has run out, how a loss
is recorded and reported) is written once; only starting the renewal and waiting for it are
written per flavour, side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from datetime import timedelta
from typing import Any

import psycopg

from pglockkit import _calls
from pglockkit.connection import aconnect, aset_server_keepalives, sever
from pglockkit.errors import LockTimeout, PglockkitError

# What a call on the lease's own connection may raise: the driver's errors and the ones
# pglockkit maps them to (a lock timeout, a serialization failure, ...).
CALL_ERRORS = (psycopg.Error, PglockkitError)

# How long a lease lost to an unanswered renewal waits for that call to fail once its socket is
# shut down, before it leaves the connection to it (closing it under the call is not safe).
SEVERED_WAIT = 5.0


def default_holder() -> str:
    """``host:pid``: what lease_status and run_history show as the holder."""
    return f"{socket.gethostname()}:{os.getpid()}"


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
    """Inside the writer's transaction, before it writes: raises ``StaleToken`` unless ``token``
    is the live lease's, and holds the lease until the transaction ends."""
    await _calls.arun(conn, _calls.check_fence(conn, name, token))


async def prune_leases(conn: psycopg.AsyncConnection, older_than: float | timedelta) -> int:
    """Delete leases released or expired more than ``older_than`` ago (pglockkit_admin); how many.
    Tokens never repeat: a pruned name's next token is larger than all it had.

    >>> await prune_leases(conn, timedelta(days=7))  # doctest: +SKIP
    3
    """
    return await _calls.arun(conn, _calls.prune_leases(older_than))


async def leases(conn: psycopg.AsyncConnection) -> list[dict]:
    """Every lease, by name, as ``pglockkit.lease_status`` shows it: a dict per lease with
    ``name, holder, token, live, expires_in`` (a timedelta to the millisecond, negative once
    expired) and ``session_bound``. What ``pglockkit leases`` prints."""
    return await _calls.arun(conn, _calls.leases())


class Lease:
    """Acquire a lease, keep it renewed in the background, release it on exit.

    >>> async with Lease(dsn, "nightly-refresh", ttl=30) as lease:  # doctest: +SKIP
    ...     if not lease.acquired:
    ...         return                           # someone else holds it
    ...     for chunk in work():
    ...         if lease.lost.is_set():
    ...             break                        # stop writing: the lease is gone
    ...         async with conn.transaction():
    ...             await lease.check_fence(conn)  # rejects a stale writer in SQL
    ...             await write(conn, chunk)

    Renewals run every ``ttl / 3`` on the lease's own connection, from a thread (``pglockkit.Lease``)
    or an asyncio task (``pglockkit.aio.Lease``). The first failed renewal records ``lost_reason``,
    calls ``on_lost(lease)`` and then sets ``lost`` (a ``threading.Event``, or an ``asyncio.Event``
    for ``pglockkit.aio.Lease``); the lease then lets go of what it still holds (its session key,
    the row if nobody took it). So does a renewal that has not answered when the ttl, counted from
    the start of the last call that answered, runs out (a frozen backend, a partition): its
    connection is shut down. ``bind_session=True`` also frees the lease as soon as this process's
    connection dies. ``pglockkit.aio.Lease`` awaits an ``async def`` on_lost; ``pglockkit.Lease``
    refuses one with a TypeError, since its renewal thread could never await it.
    """

    _task: Any = None  # what renews: an asyncio task, or a thread
    _call: Any = None  # the renewal in flight, or the last one: a future of either flavour

    def __init__(
        self,
        dsn: str,
        name: str,
        ttl: float | timedelta = 30.0,
        *,
        holder: str | None = None,
        bind_session: bool = False,
        renew_every: float | None = None,
        on_lost: Callable[[Any], Any] | None = None,
    ):
        if True:  # ASYNC
            pass  # a coroutine function's result is awaited, a plain function's taken as it is
        else:
            # Called from the renewal thread, a coroutine function's coroutine is never awaited.
            _calls.check_flavour(on_lost, "pglockkit.Lease's on_lost", "pglockkit.aio.Lease", coroutine=False)
        self.dsn = dsn
        self.name = name
        self.ttl = _calls.seconds(ttl)
        self.holder = holder or default_holder()
        self.bind_session = bind_session
        self.renew_every = renew_every if renew_every is not None else self.ttl.total_seconds() / 3
        self.on_lost = on_lost
        self.token: int | None = None
        if True:  # ASYNC
            self.lost = asyncio.Event()
            self._stop = asyncio.Event()
        else:
            self.lost = threading.Event()
            self._stop = threading.Event()
        self.lost_reason: str | None = None
        # Until when (time.monotonic()) the lease is known to be ours: the start of the last
        # acquire or renewal that answered, plus the ttl. The server counts the ttl from when the
        # call arrived, later, so past this time a holder that heard nothing cannot know that
        # the lease is still its own, and declares it lost.
        self._valid_until = 0.0

    @property
    def acquired(self) -> bool:
        return self.token is not None

    @property
    def application_name(self) -> str:
        return f"pglockkit lease {self.name}"

    async def __aenter__(self) -> Lease:
        self._conn = await aconnect(self.dsn, autocommit=True, application_name=self.application_name)
        try:
            if self.bind_session:  # freed with the session: a direct one, told to notice a vanished host
                await _calls.arun(self._conn, _calls.refuse_pooler(self._conn, *_calls.BOUND_LEASE))
                await aset_server_keepalives(self._conn)
            started = time.monotonic()
            self.token = await acquire_lease(self._conn, self.name, self.holder, self.ttl, self.bind_session)
        except BaseException:
            await self._conn.close()
            raise
        self._renewed(started)
        _calls.lease_acquire_event(self.name, self.holder, self.token)
        if self.acquired:
            if True:  # ASYNC
                self._task = asyncio.create_task(self._renew_loop(), name=f"lease-{self.name}")
            else:
                self._task = threading.Thread(target=self._renew_loop, name=f"lease-{self.name}", daemon=True)
                self._task.start()
        return self

    async def check_fence(self, conn: psycopg.AsyncConnection) -> None:
        """``check_fence(name, token)`` in ``conn``'s current transaction."""
        if self.token is None:
            raise RuntimeError(f"lease {self.name!r} was not acquired")
        await check_fence(conn, self.name, self.token)

    def _renewed(self, started: float) -> None:
        self._valid_until = started + self.ttl.total_seconds()

    async def _renew_loop(self) -> None:
        while True:
            left = self._valid_until - time.monotonic()
            if await self._stopped(max(0.0, min(self.renew_every, left))):
                return
            if self.renew_every >= left:  # the ttl runs out before the next renewal would start
                await self._lose(_calls.RENEWAL_UNANSWERED)
                await self._let_go()
                return
            started = time.monotonic()
            # A task or a thread of its own, so that this loop stops waiting when the ttl runs out.
            self._call = call = self._start_renewal()
            if not await _finished(call, self._valid_until - started):
                # Unanswered: a rival may hold the lease by now. The call would wait for TCP to
                # give up (a frozen backend never answers): make it fail now.
                sever(self._conn)
                await self._lose(_calls.RENEWAL_UNANSWERED)
                await _finished(call, SEVERED_WAIT)
                return
            try:
                ok = call.result()
            except CALL_ERRORS as exc:
                await self._lose(_calls.renewal_error(exc))
                await self._let_go()
                return
            if not ok:  # renew_lease has let go of this session's key already
                await self._lose(_calls.RENEWAL_REFUSED)
                return
            self._renewed(started)

    async def _stopped(self, wait: float) -> bool:
        """Whether the block ended (``_stop``) within ``wait`` seconds. A stop ends the wait, never
        a renewal in flight on the lease's connection."""
        if True:  # ASYNC
            try:
                await asyncio.wait_for(self._stop.wait(), wait)
                return True
            except TimeoutError:
                return False
        else:
            return self._stop.wait(wait)

    def _start_renewal(self) -> Any:
        """``renew_lease`` started: a future of its result."""
        args = (self._conn, self.name, self.holder, self.token, self.ttl)
        if True:  # ASYNC
            return asyncio.ensure_future(renew_lease(*args))
        else:
            return _in_thread(renew_lease, *args)

    async def _lose(self, reason: str) -> None:
        """Record the loss, call ``on_lost``, then set ``lost``: whoever waits on the event sees
        what the callback did. A callback that raises is logged, and the lease goes on to let go
        of what it holds."""
        self.lost_reason = reason
        _calls.lease_lost_event(self.name, self.holder, self.token, reason)
        try:
            if self.on_lost is not None:
                if True:  # ASYNC
                    result = self.on_lost(self)
                    if inspect.isawaitable(result):
                        await result
                else:
                    self.on_lost(self)
        except Exception:
            _calls.leases_log.exception("lease %s: on_lost raised", self.name)
        finally:
            self.lost.set()

    async def _let_go(self) -> None:
        """After a renewal that raised: release with the lost token, which frees the row if nobody
        took it and the session's key if it is still held. Best effort: a dead connection took
        both with it."""
        if self._conn.closed or self._conn.broken:
            return
        with contextlib.suppress(*CALL_ERRORS):
            await release_lease(self._conn, self.name, self.holder, self.token)

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            if self._task is not None:
                if True:  # ASYNC
                    await self._task
                else:
                    self._task.join()
            if self.acquired and not self.lost.is_set():
                # A lease lost unnoticed (check_fence raised StaleToken) is released as well:
                # false, and the session's key let go of. Its row may be locked by a fenced
                # transaction that waits for this block to end: wait for it at most for the rest
                # of the ttl, never forever.
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


async def _finished(call: Any, timeout: float) -> bool:
    """Whether ``call`` (a future) ended within ``timeout`` seconds. An error it ends with is read
    by whoever reads its result, or by nobody; waiting never raises it."""
    if True:  # ASYNC
        try:
            await asyncio.wait([call], timeout=timeout)
        except asyncio.CancelledError:  # the renewal task cancelled: so is its call
            call.cancel()
            raise
        call.add_done_callback(lambda c: c.cancelled() or c.exception())  # no "never retrieved"
    else:
        futures.wait([call], timeout)
    return call.done()


if True:  # ASYNC
    pass
else:

    def _in_thread(fn: Callable[..., Any], *args: Any) -> futures.Future:
        """``fn(*args)`` in a daemon thread (an interpreter that exits does not wait for it)."""
        result: futures.Future = futures.Future()

        def run() -> None:
            try:
                result.set_result(fn(*args))
            except BaseException as exc:
                result.set_exception(exc)

        threading.Thread(target=run, name="lease-call", daemon=True).start()
        return result
