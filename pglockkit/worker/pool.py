# Generated from pglockkit/worker/pool_async.py by tools/async_to_sync.py: do not edit.
# Edit the source, then run `python3 tools/async_to_sync.py` (CI fails while this file
# differs from what the tool writes).
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

Lanes whose hands are empty claim through the process's feeder (``Feeder``, ``Feeder``):
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

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from pglockkit import _calls
from pglockkit._calls import Call, Job
from pglockkit.worker.connection import NOT_YOURS_TO_END, LaneConnection
from pglockkit.worker.lane import (
    RECHECK,
    ConnectGate,
    NoConnection,
    Settings,
    claim_calls,
    deal,
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
        self._woken = threading.Event()
        self.conn: LaneConnection | None = None
        self.gone = False

    def wake(self) -> None:
        self._woken.set()

    def wait(self, timeout: float | None) -> None:
        self._woken.wait(timeout)


class Pool:
    """Up to ``size`` ``LaneConnection`` shared by a worker's lanes (see the module). Its state
    changes under a lock that is never held across a wait or a connect (in asyncio, where nothing
    else runs meanwhile, it is never contended)."""

    def __init__(
        self, dsn: str, params: dict[str, Any], size: int, gate: ConnectGate, stopping: Callable[[], bool]
    ):
        self.dsn, self.params, self.size, self.gate, self.stopping = dsn, params, size, gate, stopping
        self._lock = threading.Lock()
        self._idle: list[LaneConnection] = []
        self._open = 0  # open or being opened
        self._waiters: deque[_Waiter] = deque()
        self.sample: LaneConnection | None = None  # any connection opened: its info, adapters
        self.closed = False

    def get(self, first: bool = False) -> LaneConnection | None:
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
                conn = self._connect()
                if conn is not None:
                    return conn
                continue
            assert waiter is not None
            try:
                waiter.wait(wait)
            except BaseException:  # cancelled: a connection handed over meanwhile goes back
                with self._lock:
                    waiter.gone = True
                    handed = waiter.conn
                if handed is not None:
                    self.put(handed)
                raise
            with self._lock:
                waiter.gone = True
                if waiter.conn is not None:
                    return waiter.conn
            # not handed one (a place freed, the gate to ask again, a stop): look again

    def _connect(self) -> LaneConnection | None:
        """A new connection, its place taken already; None if the server refused it."""
        try:
            conn = LaneConnection.connect(self.dsn, **self.params)
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

    def put(self, conn: LaneConnection) -> None:
        """Give a connection back: to the caller that has waited longest, or to the idle ones."""
        conn.in_job, conn.pending_savepoint = False, None
        if self.closed or not reusable(conn):
            self.discard(conn)
            return
        with self._lock:
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.gone:
                    waiter.conn = conn
                    waiter.wake()
                    return
            self._idle.append(conn)

    def discard(self, conn: LaneConnection) -> None:
        """Close a connection (lost, or left in a transaction) and free its place."""
        conn.close()
        with self._lock:
            self._open -= 1
            self._wake_one()  # it may open a new one now

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for conn in idle:
            conn.close()


class Hold:
    """A lane's pool connection while it needs one (see the module)."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.conn: LaneConnection | None = None

    def get(self) -> LaneConnection:
        if self.conn is None:
            self.conn = self.pool.get()
            if self.conn is None:
                raise NoConnection()
        return self.conn

    def release(self) -> None:
        """Back to the pool, when no transaction is open on it."""
        conn = self.conn
        if conn is not None and not conn.in_job and (conn.closed or reusable(conn)):
            self.conn = None
            self.pool.put(conn)

    def drop(self) -> None:
        """Lost, or to be given up whatever its state: closed, its place freed."""
        if self.conn is not None:
            conn, self.conn = self.conn, None
            self.pool.discard(conn)


class LazyConnection:
    """What an exactly-once handler ``(job, conn)`` gets as ``conn`` when its lane holds no
    connection (a job that runs in a transaction of its own): its first use of the connection
    (any but ``commit`` and ``rollback``, which a handler may not call) takes one from the pool and
    begins the job's transaction, and the lane keeps it until the job's commit. A handler that
    awaits a model before it writes holds no connection while it waits. Until then, attributes
    that need no server (``info``, ``adapters``) are any pool connection's."""

    def __init__(self, hold: Hold, savepoint: Call[None] | None):
        self._hold, self._savepoint = hold, savepoint
        self.taken: LaneConnection | None = None

    def _get(self) -> LaneConnection:
        if self.taken is None:
            conn = self._hold.get()
            conn.start_job(self._savepoint)
            self.taken = conn
        return self.taken

    def commit(self) -> None:
        raise psycopg.ProgrammingError(NOT_YOURS_TO_END)

    def rollback(self) -> None:
        raise psycopg.ProgrammingError(NOT_YOURS_TO_END)

    @contextmanager
    def transaction(self, *args: Any, **kwargs: Any) -> Iterator[psycopg.Transaction]:
        conn = self._get()
        with conn.transaction(*args, **kwargs) as tx:
            yield tx

    def __getattr__(self, name: str) -> Any:
        if name in ("info", "adapters", "closed", "broken") and self.taken is None:
            return getattr(self._hold.pool.sample, name)
        return getattr(self._get(), name)


# --- the feeders ----------------------------------------------------------------------------------


def _record_together(pool: Pool, outcomes: list[tuple[list[Job], list[tuple[Job, str]]]]) -> Exception | None:
    """The outcomes of several lanes (each a ``Record``'s done and failed jobs), recorded in one
    transaction on a pool connection: None once it committed, else its error (and then each lane
    records its own)."""
    calls, completions, n_done = record_calls(outcomes)
    try:
        conn = pool.get(first=True)
        if conn is None:
            raise NoConnection()
        try:
            results, error = _calls.run_pipeline(conn, calls)
            if error is not None and conn.info.transaction_status != TransactionStatus.IDLE:
                _calls.run_pipeline(conn, [_calls.statement("ROLLBACK")])
        except BaseException:
            pool.discard(conn)
            raise
    except Exception as exc:  # not committed: each lane records its own
        return exc
    pool.put(conn)
    if error is None:
        stale_completions(n_done, sum(results[i] for i in completions))
    return error


def _claim_together(
    pool: Pool, settings: Settings, total: int, token: bool
) -> tuple[LaneConnection, list[Any], Exception | None, int]:
    """The claims of several lanes, ``total`` jobs in all, and a ``next_rate_token`` if ``token``:
    one pipeline on a pool connection taken ahead of the queue. Returns that connection, still held
    (the caller gives it back), the results, the first error, and how many results are claims'. A
    connection lost on the way is dropped (kept if only the statement was cancelled), and the
    error raised."""
    calls = claim_calls(settings, total, token)
    n_claims = len(calls) - token
    conn = pool.get(first=True)
    if conn is None:
        raise NoConnection()
    try:
        results, error = _calls.run_pipeline(conn, calls)
    except BaseException as exc:
        if _calls.outlived(conn) and isinstance(exc, psycopg.OperationalError):
            statement_failed(exc)
            pool.put(conn)
        else:
            pool.discard(conn)
        raise
    return conn, results, error, n_claims


class _Asked:
    __slots__ = ("answered", "kind", "n", "outcomes", "reply")

    def __init__(self, kind: str, n: int = 0, outcomes: tuple[list[Job], list[tuple[Job, str]]] = ([], [])):
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

    def __init__(self, pool: Pool, settings: Settings, found: Callable[[], None]):
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
