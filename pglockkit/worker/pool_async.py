"""A worker process's connections: a pool of ``connections`` lane connections that its jobs in
flight share, and the connection a handler gets before it has one.

A lane holds a pool connection only while it needs one: for a round trip of its own (a claim, a
group's outcomes), for the life of a transaction (a group of fast jobs, or one job from its
handler's first statement to its commit), never while a handler waits outside the database with
nothing to commit. So ``concurrency`` (jobs in flight) and ``connections`` are two numbers: a
process of 2,000 jobs that each wait a second on a model and then write for a millisecond needs
a few connections, not 2,000.

A pool opens connections on demand, up to its size, through the worker's ``ConnectGate``: while
the server refuses connections (full, down, restarting) they are opened one at a time with
backoff, and callers wait their turn; nobody sees the error. A connection is handed straight to
the caller that has waited longest (no thundering herd of thousands of waiting tasks). A
connection given back broken, closed or inside a transaction is closed and its place freed.

Lanes whose hands are empty claim through the process's feeder (``AsyncFeeder``, ``Feeder``):
the claims of the lanes that ask while one is in flight go as one ``claim_job`` of their sizes
added up (a few statements for 1,000 free lanes, not 1,000), and its jobs are dealt out in the
order the lanes asked. So are the lanes' ``next_rate_token`` questions: one statement answers
all that asked at once. And so are the outcomes of slow jobs that wrote nothing in a
transaction of their own (at least once, or exactly once without using the connection): one
transaction records those of every lane that asked, and if it fails, each lane records its own.

One source: this text, as written in the asyncio module, is the pool of ``pglockkit.aio.Worker``,
and ``tools/async_to_sync.py`` writes the pool of ``pglockkit.Worker`` (threads) from it. The
pool and a lane's hold on a connection are one text for both. The feeders, and the connection a
handler gets before it has one, are written side by side (``if True:  # ASYNC``): an asyncio
feeder is a task of its own that lanes may give up waiting for (cancelled), a thread's is the
lane that asks first; a thread's handler calls every method of its connection directly, where an
asyncio handler awaits some and not others.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from pglockkit import _calls
from pglockkit._calls import Call, Job
from pglockkit.worker.connection_async import NOT_YOURS_TO_END, AsyncLaneConnection
from pglockkit.worker.lane import (
    RECHECK,
    ConnectGate,
    NoConnection,
    Settings,
    claim_calls,
    deal,
    give_back_calls,
    record_calls,
    reusable,
    stale_completions,
    statement_failed,
)

log = logging.getLogger("pglockkit.queue")


class _Waiter:
    """A caller waiting for a connection: ``conn`` is the one it was handed, if any; ``gone`` once
    it stopped waiting (``put`` passes it over)."""

    __slots__ = ("_woken", "conn", "gone")

    def __init__(self) -> None:
        if True:  # ASYNC
            self._woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        else:
            self._woken = threading.Event()
        self.conn: AsyncLaneConnection | None = None
        self.gone = False

    def wake(self) -> None:
        if True:  # ASYNC
            if not self._woken.done():
                self._woken.set_result(None)
        else:
            self._woken.set()

    async def wait(self, timeout: float | None) -> None:
        if True:  # ASYNC
            if timeout is None:  # the common case, and asyncio.wait's machinery costs: 2,000 wait
                await self._woken
            else:
                await asyncio.wait([self._woken], timeout=timeout)
        else:
            self._woken.wait(timeout)


class AsyncPool:
    """Up to ``size`` ``AsyncLaneConnection`` shared by a worker's lanes (see the module). Its state
    changes under a lock that is never held across a wait or a connect (in asyncio, where nothing
    else runs meanwhile, it is never contended)."""

    def __init__(
        self, dsn: str, params: dict[str, Any], size: int, gate: ConnectGate, stopping: Callable[[], bool]
    ):
        self.dsn, self.params, self.size, self.gate, self.stopping = dsn, params, size, gate, stopping
        self._lock = threading.Lock()
        self._idle: list[AsyncLaneConnection] = []
        self._open = 0  # open or being opened
        self._waiters: deque[_Waiter] = deque()
        self.sample: AsyncLaneConnection | None = None  # any connection opened: its info, adapters
        self.closed = False

    async def get(self, first: bool = False) -> AsyncLaneConnection | None:
        """A connection, waiting for one if need be; None when the worker stops while none can be
        opened (the server refuses connections): the caller's jobs go back by their lease.
        ``first``: ahead of the callers already waiting (the feeder's claims: queued behind 2,000
        completions, the claims that would start the next jobs waited for all of them, and the
        jobs ran in waves)."""
        while True:
            connect = False
            waiter = None
            with self._lock:
                conn = None
                while self._idle:
                    candidate = self._idle.pop()
                    if not candidate.closed:
                        conn = candidate
                        break
                    self._open -= 1
                wait: float | None = None  # all in use: one comes back (put) or is freed (discard)
                if conn is None and self._open < self.size:
                    if (wait := self.gate.turn()) == 0:
                        self._open += 1
                        connect = True
                    elif self.stopping():
                        self._wake_one()  # and the next waiter sees it too
                        return None
                    else:
                        wait = min(wait, RECHECK)  # the gate is closed: ask it again soon
                if conn is None and not connect:
                    waiter = _Waiter()
                    if first:
                        self._waiters.appendleft(waiter)
                    else:
                        self._waiters.append(waiter)
            if conn is not None:
                return conn
            if connect:
                conn = await self._connect()
                if conn is not None:
                    return conn
                continue
            assert waiter is not None
            try:
                await waiter.wait(wait)
            except BaseException:  # cancelled: a connection handed over meanwhile goes back
                with self._lock:
                    waiter.gone = True
                    handed = waiter.conn
                if handed is not None:
                    await self.put(handed)
                raise
            with self._lock:
                waiter.gone = True
                if waiter.conn is not None:
                    return waiter.conn
            # not handed one (a place freed, the gate to ask again, a stop): look again

    async def _connect(self) -> AsyncLaneConnection | None:
        """A new connection, its place taken already; None if the server refused it."""
        try:
            conn = await AsyncLaneConnection.connect(self.dsn, **self.params)
        except psycopg.OperationalError as exc:
            self.gate.connect_failed(exc)
            with self._lock:
                self._open -= 1
                self._wake_one()  # a waiter queued while every place was taken may try (or stop)
            return None
        except BaseException:
            self.gate.connected()  # not the server's answer: let the next caller try
            with self._lock:
                self._open -= 1
                self._wake_one()
            raise
        self.gate.connected()
        self.sample = conn
        return conn

    def _wake_one(self) -> None:
        """The longest waiter, with no connection: a place is free, or the worker stops. Called
        with the lock held."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.gone:
                waiter.wake()
                return

    async def put(self, conn: AsyncLaneConnection) -> None:
        """Give a connection back: to the caller that has waited longest, or to the idle ones."""
        conn.in_job, conn.pending_savepoint = False, None
        if self.closed or not reusable(conn):
            await self.discard(conn)
            return
        with self._lock:
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.gone:
                    waiter.conn = conn
                    waiter.wake()
                    return
            self._idle.append(conn)

    async def discard(self, conn: AsyncLaneConnection) -> None:
        """Close a connection (lost, or left in a transaction) and free its place."""
        await conn.close()
        with self._lock:
            self._open -= 1
            self._wake_one()  # it may open a new one now

    async def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for conn in idle:
            await conn.close()


class AsyncHold:
    """A lane's pool connection while it needs one (see the module)."""

    def __init__(self, pool: AsyncPool):
        self.pool = pool
        self.conn: AsyncLaneConnection | None = None

    async def get(self) -> AsyncLaneConnection:
        if self.conn is None:
            self.conn = await self.pool.get()
            if self.conn is None:
                raise NoConnection()
        return self.conn

    async def release(self) -> None:
        """Back to the pool, when no transaction is open on it."""
        conn = self.conn
        if conn is not None and not conn.in_job and (conn.closed or reusable(conn)):
            self.conn = None
            await self.pool.put(conn)

    async def drop(self) -> None:
        """Lost, or to be given up whatever its state: closed, its place freed."""
        if self.conn is not None:
            conn, self.conn = self.conn, None
            await self.pool.discard(conn)


class AsyncLazyConnection:
    """What an exactly-once handler ``(job, conn)`` gets as ``conn`` when its lane holds no
    connection (a job that runs in a transaction of its own): its first use of the connection
    (any but ``commit`` and ``rollback``, which a handler may not call) takes one from the pool and
    begins the job's transaction, and the lane keeps it until the job's commit. A handler that
    awaits a model before it writes holds no connection while it waits. Until then, attributes
    that need no server (``info``, ``adapters``) are any pool connection's."""

    def __init__(self, hold: AsyncHold, savepoint: Call[None] | None):
        self._hold, self._savepoint = hold, savepoint
        self.taken: AsyncLaneConnection | None = None

    async def _get(self) -> AsyncLaneConnection:
        if self.taken is None:
            conn = await self._hold.get()
            conn.start_job(self._savepoint)
            self.taken = conn
        return self.taken

    async def commit(self) -> None:
        raise psycopg.ProgrammingError(NOT_YOURS_TO_END)

    async def rollback(self) -> None:
        raise psycopg.ProgrammingError(NOT_YOURS_TO_END)

    @asynccontextmanager
    async def transaction(self, *args: Any, **kwargs: Any) -> AsyncIterator[psycopg.AsyncTransaction]:
        conn = await self._get()
        async with conn.transaction(*args, **kwargs) as tx:
            yield tx

    if True:  # ASYNC
        # An asyncio handler awaits some methods (execute) and not others (cursor), which
        # __getattr__ cannot tell apart: those are written out.

        async def execute(self, *args: Any, **kwargs: Any) -> Any:
            return await (await self._get()).execute(*args, **kwargs)

        def cursor(self, *args: Any, **kwargs: Any) -> Any:
            if self.taken is not None:
                return self.taken.cursor(*args, **kwargs)
            return _AsyncLazyCursor(self, args, kwargs)

        @asynccontextmanager
        async def pipeline(self) -> AsyncIterator[psycopg.AsyncPipeline]:
            async with (await self._get()).pipeline() as p:
                yield p

        def __getattr__(self, name: str) -> Any:
            target = self.taken or self._hold.pool.sample
            return getattr(target, name)

    else:

        def __getattr__(self, name: str) -> Any:
            if name in ("info", "adapters", "closed", "broken") and self.taken is None:
                return getattr(self._hold.pool.sample, name)
            return getattr(self._get(), name)


if True:  # ASYNC

    class _AsyncLazyCursor:
        """``conn.cursor()`` before the handler's first statement: the cursor is made on the pool
        connection that its first ``execute`` (or ``executemany``, ``stream``, ``copy``) takes."""

        def __init__(self, owner: AsyncLazyConnection, args: tuple[Any, ...], kwargs: dict[str, Any]):
            object.__setattr__(self, "_owner", owner)
            object.__setattr__(self, "_made", (args, kwargs))
            object.__setattr__(self, "_set", {})
            object.__setattr__(self, "_cur", None)

        async def _real(self) -> psycopg.AsyncCursor[Any]:
            if self._cur is None:
                conn = await self._owner._get()
                args, kwargs = self._made
                cur = conn.cursor(*args, **kwargs)
                for name, value in self._set.items():
                    setattr(cur, name, value)
                object.__setattr__(self, "_cur", cur)
            return self._cur

        async def execute(self, *args: Any, **kwargs: Any) -> _AsyncLazyCursor:
            await (await self._real()).execute(*args, **kwargs)
            return self

        async def executemany(self, *args: Any, **kwargs: Any) -> None:
            await (await self._real()).executemany(*args, **kwargs)

        async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            async for row in (await self._real()).stream(*args, **kwargs):
                yield row

        @asynccontextmanager
        async def copy(self, *args: Any, **kwargs: Any) -> AsyncIterator[psycopg.AsyncCopy]:
            async with (await self._real()).copy(*args, **kwargs) as copy:
                yield copy

        async def __aenter__(self) -> _AsyncLazyCursor:
            return self

        async def __aexit__(self, *exc: Any) -> None:
            await self.close()

        async def close(self) -> None:
            if self._cur is not None:
                await self._cur.close()

        def __aiter__(self) -> AsyncIterator[Any]:
            if self._cur is None:
                raise psycopg.ProgrammingError("no result available: the cursor has not executed")
            return self._cur.__aiter__()

        def __getattr__(self, name: str) -> Any:
            if self._cur is None:
                if name in self._set:
                    return self._set[name]
                raise psycopg.ProgrammingError(f"the cursor has not executed yet: {name} is not available")
            return getattr(self._cur, name)

        def __setattr__(self, name: str, value: Any) -> None:
            if self._cur is None:
                self._set[name] = value
            else:
                setattr(self._cur, name, value)


# --- the feeders ----------------------------------------------------------------------------------


async def _record_together(
    pool: AsyncPool, outcomes: list[tuple[list[Job], list[tuple[Job, str]]]]
) -> Exception | None:
    """The outcomes of several lanes (each a ``Record``'s done and failed jobs), recorded in one
    transaction on a pool connection: None once it committed, else its error (and then each lane
    records its own)."""
    calls, completions, n_done = record_calls(outcomes)
    try:
        conn = await pool.get(first=True)
        if conn is None:
            raise NoConnection()
        try:
            results, error = await _calls.arun_pipeline(conn, calls)
            if error is not None and conn.info.transaction_status != TransactionStatus.IDLE:
                await _calls.arun_pipeline(conn, [_calls.statement("ROLLBACK")])
        except BaseException:
            await pool.discard(conn)
            raise
    except Exception as exc:  # not committed: each lane records its own
        return exc
    await pool.put(conn)
    if error is None:
        stale_completions(n_done, sum(results[i] for i in completions))
    return error


async def _claim_together(
    pool: AsyncPool, settings: Settings, total: int, token: bool
) -> tuple[AsyncLaneConnection, list[Any], Exception | None, int]:
    """The claims of several lanes, ``total`` jobs in all, and a ``next_rate_token`` if ``token``:
    one pipeline on a pool connection taken ahead of the queue. Returns that connection, still held
    (the caller gives it back), the results, the first error, and how many results are claims'. A
    connection lost on the way is dropped (kept if only the statement was cancelled), and the
    error raised."""
    calls = claim_calls(settings, total, token)
    n_claims = len(calls) - token
    conn = await pool.get(first=True)
    if conn is None:
        raise NoConnection()
    try:
        results, error = await _calls.arun_pipeline(conn, calls)
    except BaseException as exc:
        if _calls.outlived(conn) and isinstance(exc, psycopg.OperationalError):
            statement_failed(exc)
            await pool.put(conn)
        else:
            await pool.discard(conn)
        raise
    return conn, results, error, n_claims


if True:  # ASYNC
    _AsyncRecord = tuple[list[Job], list[tuple[Job, str]], asyncio.Future[Exception | None]]

    class AsyncFeeder:
        """The claims (and ``next_rate_token`` questions) of an ``aio.Worker``'s lanes, batched (see
        the module): a task of its own sends what has been asked, on a pool connection, until nothing
        is left to ask. ``found`` is called when a claim came back with jobs, so that idle lanes
        look again: there may be more (the one idle lane that polls found them)."""

        def __init__(self, pool: AsyncPool, settings: Settings, found: Callable[[], None]):
            self.pool, self.s, self.found = pool, settings, found
            self._claims: list[tuple[int, asyncio.Future[tuple[list[Any], Exception | None]]]] = []
            self._tokens: list[asyncio.Future[float | None]] = []
            self._records: list[_AsyncRecord] = []
            self._task: asyncio.Task[None] | None = None

        async def claim(self, n: int) -> tuple[list[Any], Exception | None]:
            """``([jobs], error)``, the reply to a lane's ``Claim``."""
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[tuple[list[Any], Exception | None]] = loop.create_future()
            self._claims.append((n, fut))
            self._serve()
            return await fut

        async def record(self, done: list[Job], failed: list[tuple[Job, str]]) -> Exception | None:
            """The reply to a lane's ``Record``: None once its outcomes committed."""
            fut: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
            self._records.append((done, failed, fut))
            self._serve()
            return await fut

        async def next_rate_token(self) -> float | None:
            fut: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
            self._tokens.append(fut)
            self._serve()
            return await fut

        def _serve(self) -> None:
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._run())

        async def close(self) -> None:
            """The lanes have ended: a batch still in flight (for a lane that was cancelled) is
            cancelled too; what it claimed goes back by its lease."""
            if self._task is not None and not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

        async def _run(self) -> None:
            while self._claims or self._tokens or self._records:
                records, self._records = self._records, []
                if records:
                    await self._send_records(records)
                claims, self._claims = self._claims, []
                tokens, self._tokens = self._tokens, []
                if not (claims or tokens):
                    continue
                try:
                    await self._send(claims, tokens)
                except BaseException as exc:
                    for _, fut in claims:
                        if not fut.done():
                            fut.set_result(([], exc if isinstance(exc, Exception) else NoConnection()))
                    for fut in tokens:
                        if not fut.done():
                            fut.set_exception(exc if isinstance(exc, Exception) else NoConnection())
                    if not isinstance(exc, Exception):
                        raise

        async def _send_records(self, records: list[_AsyncRecord]) -> None:
            error: Exception | None = NoConnection()  # until it is known to have committed
            try:
                error = await _record_together(self.pool, [(done, failed) for done, failed, _ in records])
            finally:  # answered even when cancelled (then not known to have committed): alone
                for _, _, fut in records:
                    if not fut.done():
                        fut.set_result(error)

        async def _send(
            self,
            claims: list[tuple[int, asyncio.Future[tuple[list[Any], Exception | None]]]],
            tokens: list[asyncio.Future[float | None]],
        ) -> None:
            total = sum(n for n, _ in claims)
            conn, results, error, n_claims = await _claim_together(self.pool, self.s, total, bool(tokens))
            if error is not None and len(results) < n_claims:  # a claim failed: nothing was claimed
                await self.pool.put(conn)
                for _, fut in claims:
                    fut.set_result(([], error))
                for fut in tokens:
                    fut.set_exception(error)
                return
            waiting = [(n, fut) for n, fut in claims if not fut.done()]  # not cancelled
            dealt, left = deal(results, n_claims, [n for n, _ in waiting])
            if left:  # lanes gave up waiting (cancelled): their jobs go back at once
                _, back_error = await _calls.arun_pipeline(conn, give_back_calls(left))
                if back_error is not None:
                    log.warning("could not give back %d claimed job(s): %s", len(left), back_error)
            await self.pool.put(conn)
            for (_, fut), jobs in zip(waiting, dealt, strict=True):
                fut.set_result(([jobs], None))
            for fut in tokens:
                if fut.done():
                    continue
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(results[n_claims])
            if any(results[:n_claims]):
                self.found()

else:

    class _Asked:
        __slots__ = ("answered", "kind", "n", "outcomes", "reply")

        def __init__(
            self, kind: str, n: int = 0, outcomes: tuple[list[Job], list[tuple[Job, str]]] = ([], [])
        ):
            self.kind = kind  # "claim", "token" or "record"
            self.n = n
            self.outcomes = outcomes  # a Record's (done, failed)
            self.answered = False
            self.reply: Any = None  # ([jobs], error), a token's (value, error), a Record's error

    class Feeder:
        """The claims, ``next_rate_token`` questions and outcomes of ``pglockkit.Worker``'s lane
        threads, batched (see the module): a lane that asks while nobody is sending sends one batch,
        what has been asked by then (its own with the others'), and passes the turn to a lane still
        waiting."""

        def __init__(self, pool: AsyncPool, settings: Settings, found: Callable[[], None]):
            self.pool, self.s, self.found = pool, settings, found
            self._cond = threading.Condition()
            self._asked: list[_Asked] = []  # taken whole, under the lock, by the lane that sends
            self._sending = False

        def record(self, done: list[Job], failed: list[tuple[Job, str]]) -> Exception | None:
            asked = _Asked("record", 0, (done, failed))
            self._serve(asked)
            return asked.reply

        def claim(self, n: int) -> tuple[list[Any], Exception | None]:
            asked = _Asked("claim", n)
            self._serve(asked)
            return asked.reply

        def next_rate_token(self) -> float | None:
            asked = _Asked("token")
            self._serve(asked)
            value, error = asked.reply
            if error is not None:
                raise error
            return value

        def _serve(self, mine: _Asked) -> None:
            # A lane's question goes in under the lock, as one list taken whole: a lane that named
            # the list to join before taking the lock (it once did) could join one a sender had
            # already taken, and be answered by nobody.
            with self._cond:
                self._asked.append(mine)
                while self._sending and not mine.answered:
                    self._cond.wait()
                if mine.answered:
                    return
                self._sending = True
                asked, self._asked = self._asked, []
            try:
                records = [a for a in asked if a.kind == "record"]
                claims = [a for a in asked if a.kind == "claim"]
                tokens = [a for a in asked if a.kind == "token"]
                if records:
                    self._send_records(records)
                if claims or tokens:
                    self._send_safely(claims, tokens)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()  # answered lanes return; one of the others sends next

        def _send_records(self, records: list[_Asked]) -> None:
            error: Exception | None = NoConnection()  # until it is known to have committed
            try:
                error = _record_together(self.pool, [asked.outcomes for asked in records])
            finally:
                with self._cond:
                    for asked in records:
                        asked.reply, asked.answered = error, True

        def _send_safely(self, claims: list[_Asked], tokens: list[_Asked]) -> None:
            try:
                self._send(claims, tokens)
            except BaseException as exc:
                error = exc if isinstance(exc, Exception) else NoConnection()
                with self._cond:
                    for asked in claims:
                        if not asked.answered:
                            asked.reply, asked.answered = ([], error), True
                    for asked in tokens:
                        if not asked.answered:
                            asked.reply, asked.answered = (None, error), True
                if not isinstance(exc, Exception):
                    raise

        def _send(self, claims: list[_Asked], tokens: list[_Asked]) -> None:
            total = sum(asked.n for asked in claims)
            conn, results, error, n_claims = _claim_together(self.pool, self.s, total, bool(tokens))
            self.pool.put(conn)
            if error is not None and len(results) < n_claims:
                replies: list[Any] = [([], error)] * len(claims)
            else:
                dealt, _ = deal(results, n_claims, [asked.n for asked in claims])  # threads never give up
                replies = [([jobs], None) for jobs in dealt]
            with self._cond:
                for asked, reply in zip(claims, replies, strict=True):
                    asked.reply, asked.answered = reply, True
                for asked in tokens:
                    asked.reply = (None, error) if error is not None else (results[n_claims], None)
                    asked.answered = True
            if any(results[:n_claims]):
                self.found()
