"""What a worker lane does, written once for ``pglockkit.Worker`` (threads) and
``pglockkit.aio.Worker`` (asyncio).

A worker process runs ``concurrency`` lanes (its jobs in flight). A lane runs jobs one after
another; ``Lane.drain`` is a generator that decides every step and yields the I/O it needs
(``Pipeline``: statements sent in one round trip, on the lane's connection; ``Claim``: jobs for
an empty hand, which the driver claims together with other lanes' (``pglockkit.worker.pool``'s
feeder); ``Handle``: run the handler on a job). The sync and async drivers perform that I/O and
send the result back, so both workers share one definition of group commit. A lane takes a
connection from the process's pool for each round trip and keeps it while a transaction is open
(``pglockkit.worker.pool``): what follows says which.

Group commit, exactly once (``handler(job, conn)``)
    Jobs that run one after another on a lane share one transaction. It begins by locking the
    jobs in hand with ``extend_jobs`` (which also renews their leases): a locked row cannot be
    reclaimed, cancelled or completed by another session until the group ends, so no completion
    of the group can find its claim stale, and a claim that went stale before is found here and
    dropped. Each job gets a savepoint, made just before the handler's first statement (a handler
    that does not use its connection costs no round trip); a handler that raises rolls back to
    it, so its writes are undone and the group's other jobs are not. At the end, one round trip:
    ``complete_jobs`` for the group, ``fail_job`` for each failure (in key order: see
    ``outcome_calls``), the next claim when the hand is empty, and ``COMMIT``. No claim runs
    while handlers do: a claim locks its keys' running counts until its transaction ends, and
    other claimers of those keys would wait. A crash or a lost connection before the commit loses
    the group's writes and completions together: its jobs run again after their lease. A COMMIT
    that fails (a deferred constraint a handler broke, checked only then) puts the group's jobs
    back in hand to run alone, one transaction each (``_commit_failed``). A group is the jobs in
    hand, ended early after ``group`` jobs or, at the next job boundary,
    ``group_time`` seconds after it began.

    A slow job (slower than ``group_time`` on this lane), or the only one in hand, runs alone in
    a transaction that begins with its handler's first statement; its row is not locked, so the
    heartbeat renews its lease however long it runs, and ``complete_job`` then tells whether the
    claim is still ours (a stale one rolls back). A COMMIT that fails fails the job, with its error.

    Both kinds of transaction turn the server's ``idle_in_transaction_session_timeout`` off for
    themselves (``SET LOCAL``, ``_calls.KEEP_OPEN``): they are idle, as the server sees them,
    whenever a handler waits outside the database, and the timeout would end the lane's session.

At least once (``handler(job)``, no connection)
    The handler runs outside any transaction; its completions (and failures) are buffered and
    recorded with the next claim in one transaction per group. A crash before that commit runs
    the group's jobs again after their lease: their handlers' outside effects happen twice.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from pglockkit import _calls
from pglockkit._calls import Call, Job, first_line
from pglockkit.connection import connect_params
from pglockkit.errors import Deadlock, LimitExceeded, RetryableError, SerializationFailure, UnknownJob
from pglockkit.retry import TICK_BACKOFF_CAP, backoff

log = logging.getLogger("pglockkit.queue")

NOTIFY_CHANNEL = "pglockkit_jobs"
MAX_LEASE = timedelta(days=7)  # claim_job's limit
# Seconds a worker's connect (a lane's, the LISTEN's, the heartbeat's) may take unless the DSN, its
# service or PGCONNECT_TIMEOUT says: libpq waits 130 s for a server that does not answer, and a
# stop() meanwhile waited as long (the pool that lanes took their connections from waited 3 s).
CONNECT_TIMEOUT = 3
MAX_GROUP = 64  # a transaction's first 64 subtransactions are tracked cheaply by the server
LONGEST_PAUSE = 86400.0  # seconds, a day: the longest poll, group time, reconnect pause (and CLI pause)


@dataclass(frozen=True)
class Pipeline:
    """Send these statements in one round trip; the reply is ``(results, error)``."""

    calls: list[Call[Any]]


@dataclass(frozen=True)
class Claim:
    """Claim up to ``n`` jobs into the lane's empty hand, in a transaction of its own; the reply is
    ``([jobs], error)``, as a ``Pipeline`` of the one claim would answer. The driver sends the
    claims of its lanes that ask at about the same time as one (a ``Feeder``)."""

    n: int


@dataclass(frozen=True)
class Record:
    """Record the outcomes of jobs that wrote nothing in a transaction of their lane's (at least
    once, or exactly once without using the connection) in one transaction with other lanes'
    outcomes (the driver's feeder). The reply is None once committed, or the error that rolled
    the whole batch back: the lane then records its own alone."""

    done: list[Job]
    failed: list[tuple[Job, str]]


@dataclass(frozen=True)
class Handle:
    """Run the handler on ``job``; the reply is an ``Outcome``. With ``savepoint``, the
    connection makes it before the handler's first statement."""

    job: Job
    savepoint: Call[None] | None
    begins: bool = False  # ``savepoint`` is the BEGIN of the job's transaction, not a savepoint


class ClaimsConflicted(Exception):
    """A claim into an empty hand conflicted (40001, 40P01: REPEATABLE READ or SERIALIZABLE as the
    database's default, many claimers) ``CLAIM_TRIES`` times in a row. Nothing was held, so
    nothing is undone: the worker pauses the lane briefly, as after an error, and it claims again.
    The conflict is ``__cause__``."""


class HandlerEndedTransaction(Exception):
    """The handler committed or rolled back the worker's transaction itself."""


def takes_connection(handler: Callable[..., Any]) -> bool:
    """``handler(job, conn)`` (exactly once) or ``handler(job)`` (at least once)?"""
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):  # no signature to read: assume the documented (job, conn)
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def is_async(handler: Callable[..., Any]) -> bool:
    """An ``async def`` or an object with an async ``__call__``. Not a plain function that wraps
    one (``functools.wraps`` says what it wraps, not what it returns: asgiref's ``async_to_sync``,
    or a ``def`` that runs ``asyncio.run``, is sync); a plain function that returns a coroutine
    fails its job with a ``TypeError`` that names ``pglockkit.aio.Worker`` (``driver.py``)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


ABORTED_BY_HANDLER = (
    "the handler returned with its transaction aborted by an error it caught; wrap statements "
    "that may fail in `with conn.transaction():`"
)


def error_text(exc: BaseException, encoding: str = "utf-8") -> str:
    return _calls.sql_text("".join(traceback.format_exception_only(type(exc), exc)).strip(), encoding)


def outcome(conn: Any, request: Handle, exactly_once: bool, exc: BaseException | None = None) -> Outcome:
    """What a handler's run on a lane's connection (sync or async) comes to; ``exc`` is what it
    raised. Re-raises when the connection is gone (the group is lost with it), and raises
    ``HandlerEndedTransaction`` when the handler committed or rolled back the group."""
    used = request.savepoint is not None and conn.pending_savepoint is None
    conn.pending_savepoint = None
    conn.in_job = False
    if not exactly_once:
        return Outcome(None if exc is None else error_text(exc, conn.info.encoding), used)
    if exc is not None and (conn.closed or conn.broken):
        raise exc
    status = conn.info.transaction_status
    if conn.ended_by_handler or (status == TransactionStatus.IDLE and (used or not request.begins)):
        raise HandlerEndedTransaction(request.job)
    if exc is not None:
        return Outcome(error_text(exc, conn.info.encoding), used)
    if status == TransactionStatus.INERROR:
        return Outcome(ABORTED_BY_HANDLER, used)
    return Outcome(None, used)


def outcome_without_connection(exc: BaseException | None, encoding: str) -> Outcome:
    """The outcome of a handler that never took a connection (its savepoint never made)."""
    return Outcome(None if exc is None else error_text(exc, encoding))


def undecodable(request: Handle, encoding: str) -> Outcome | None:
    """The outcome of a job whose payload the worker could not decode (``UndecodablePayload``): a
    failure, its handler not run; None for any other job."""
    payload = request.job.payload
    if type(payload) is not _calls.UndecodablePayload:
        return None
    return Outcome(f"{UNDECODABLE}: {error_text(payload.error, encoding)}")


UNDECODABLE = "the handler did not run: this worker's JSON loader cannot decode the job's payload"

HANDLER_ENDED_TRANSACTION = (
    "the handler ended the worker's transaction (COMMIT or ROLLBACK); a handler must leave it open: "
    "its writes commit with the job's completion"
)


@dataclass(frozen=True)
class Settings:
    """A worker's settings, checked once."""

    queue: str
    name: str
    concurrency: int
    connections: int
    batch: int
    group: int
    group_time: float
    lease: timedelta
    poll_interval: float
    reconnect_cap: float
    exactly_once: bool
    tick_schedules: bool = True

    @classmethod
    def checked(
        cls,
        queue: str,
        *,
        name: str,
        concurrency: int,
        connections: int | None,
        batch: int,
        group: int,
        group_time: float,
        lease: float | timedelta,
        poll_interval: float,
        reconnect_cap: float,
        exactly_once: bool,
        tick_schedules: bool = True,
    ) -> Settings:
        if not isinstance(queue, str) or not queue:
            # claim_job refuses it (22023): every claim would fail, retried for ever.
            raise ValueError(f"queue must be a non-empty name, got {queue!r}")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        if connections is None:
            connections = CONNECTIONS
        elif isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
            raise ValueError(f"connections must be a positive integer, got {connections!r}")
        if not isinstance(batch, int) or not 1 <= batch <= 1000:
            raise ValueError(f"batch must be between 1 and 1000, got {batch!r}")
        if not isinstance(group, int) or not 1 <= group <= MAX_GROUP:
            raise ValueError(
                f"group must be between 1 and {MAX_GROUP} jobs, got {group!r} (a savepoint per job; "
                f"past {MAX_GROUP} the server tracks a transaction's subtransactions the slow way)"
            )
        # Finite, as well: a NaN passes any comparison's negation, and an idle lane spun on it (or,
        # waiting an infinite poll_interval, died of OverflowError in Condition.wait).
        if not 0 <= group_time <= LONGEST_PAUSE:
            raise ValueError(f"group_time must be 0 to {LONGEST_PAUSE:g} seconds, got {group_time!r}")
        if not 0 < poll_interval <= LONGEST_PAUSE:
            raise ValueError(
                f"poll_interval must be over 0 and at most {LONGEST_PAUSE:g} seconds, got {poll_interval!r}"
            )
        try:
            job_lease = _calls.seconds(lease)
        except (OverflowError, ValueError):  # NaN or infinite seconds, or over timedelta's range
            job_lease = None
        if job_lease is None or not timedelta(0) < job_lease <= MAX_LEASE:
            # claim_job refuses it (22023, 22003): every claim would fail, retried for ever.
            got = lease if job_lease is None else job_lease
            raise ValueError(f"lease must be more than 0 and at most 7 days, got {got}")
        if not 0 < reconnect_cap <= LONGEST_PAUSE:
            raise ValueError(
                f"reconnect_cap must be over 0 and at most {LONGEST_PAUSE:g} seconds, got {reconnect_cap!r}"
            )
        return cls(
            queue,
            name,
            concurrency,
            min(connections, concurrency),  # a job in flight uses one at most
            batch,
            group,
            group_time,
            job_lease,
            poll_interval,
            reconnect_cap,
            exactly_once,
            tick_schedules,
        )


# How often a worker process ticks the schedules (pglockkit.tick_schedules), at most.
TICK_INTERVAL = 1.0

# A worker's defaults (the CLI shows them).
CONNECTIONS = 10  # the pool's size: never more than concurrency
BATCH = 32
GROUP = 32
GROUP_TIME = 0.02
LEASE = 60.0


class WorkerBase:
    """What ``pglockkit.Worker`` and ``pglockkit.aio.Worker`` share: their arguments, checked
    once, and their counters."""

    def __init__(
        self,
        dsn: str,
        queue: str,
        handler: Callable[..., Any],
        *,
        name: str | None = None,
        concurrency: int = 1,
        connections: int | None = None,
        batch: int = BATCH,
        group: int = GROUP,
        group_time: float = GROUP_TIME,
        lease: float | timedelta = LEASE,
        poll_interval: float = 1.0,
        reconnect_cap: float = 10.0,
        tick_schedules: bool = True,
    ):
        from pglockkit.leases import default_holder

        self._check_handler(handler)
        self.dsn = dsn
        self.handler = handler
        self.options = {
            "name": name or default_holder(),
            "concurrency": concurrency,
            "connections": connections,
            "batch": batch,
            "group": group,
            "group_time": group_time,
            "lease": lease,
            "poll_interval": poll_interval,
            "reconnect_cap": reconnect_cap,
            "tick_schedules": tick_schedules,
        }
        self.settings = Settings.checked(queue, exactly_once=takes_connection(handler), **self.options)
        self.queue, self.name = queue, self.settings.name
        self._reconnects = 0
        self._budget = Budget(None)
        self._watch = Watch()
        self._gate = ConnectGate(self.settings.reconnect_cap)  # the lanes' connects, when slots run out
        self._stopping = threading.Event()
        self._ready()

    @property
    def processed(self) -> int:
        """Jobs whose outcome (done or a failed attempt) has committed."""
        return self._budget.processed

    @property
    def reconnects(self) -> int:
        """Pauses after a lost connection or a failed statement, all lanes together."""
        return self._reconnects

    def _check_handler(self, handler: Callable[..., Any]) -> None:
        """Raises ``TypeError`` for a handler this worker cannot run."""

    def _idle_wait(self, token_in: float | None) -> float:
        """How long a lane whose claim came back empty waits for a NOTIFY: the poll interval, or
        less when due jobs wait for a rate token that comes sooner (``next_rate_token``)."""
        poll = self.settings.poll_interval
        return poll if token_in is None else min(token_in, poll)

    def _ready(self) -> None:
        """The subclass's own state."""


def worker_params(dsn: str, application_name: str) -> dict[str, Any]:
    """The connect parameters of a worker's connections (sync or async): autocommit, and a connect
    timeout of CONNECT_TIMEOUT unless the DSN or its environment sets one (a parameter given here
    would win over a service file's, so a service is left to say)."""
    params = connect_params(application_name, {"autocommit": True})
    given = conninfo_to_dict(dsn)
    if not (
        {"connect_timeout", "service"} & given.keys()
        or {"PGCONNECT_TIMEOUT", "PGSERVICE"} & os.environ.keys()
    ):
        params.setdefault("connect_timeout", CONNECT_TIMEOUT)
    return params


class Ticker:
    """When a worker process ticks the schedules: at most every ``TICK_INTERVAL`` seconds, on
    the LISTEN connection (idle between notifications, so the lanes never wait for a tick). A
    database without ``tick_schedules`` (installed before schedules) turns ticking off, once.
    Ticks that fail (a database that refuses writes) back off, doubling up to
    ``TICK_BACKOFF_CAP``, each failure logged on one line: not a warning every second."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._last = -TICK_INTERVAL
        self._failures = 0  # in a row
        self._failed = False  # the last tick

    def _wait(self) -> float:
        return min(TICK_INTERVAL * 2**self._failures, TICK_BACKOFF_CAP) if self._failures else TICK_INTERVAL

    def due(self) -> bool:
        if self._failures and not self._failed:  # the last tick worked: once a second again
            log.warning("tick_schedules works again after %d failure(s)", self._failures)
            self._failures = 0
        now = time.monotonic()
        if not self.enabled or now - self._last < self._wait():
            return False
        self._last, self._failed = now, False
        return True

    def failed(self, exc: Exception) -> None:
        if getattr(exc, "sqlstate", None) == "42883":  # undefined_function
            self.enabled = False
            log.warning("schedules not ticked: no pglockkit.tick_schedules here (run pglockkit install)")
            return
        self._failures += 1
        self._failed = True
        text = error_text(exc).splitlines()[0]
        log.warning(
            "tick_schedules failed (%d in a row, next in %.0f s): %s", self._failures, self._wait(), text
        )


# A connect refused because the server has no connection slot left (53300): "sorry, too many
# clients already", or "remaining connection slots are reserved ..." for a role that is not a
# superuser. libpq reports it as text, without a SQLSTATE.
TOO_MANY_CLIENTS = ("too many clients already", "remaining connection slots are reserved")
GATE_BASE = 0.5  # seconds: the first pause of the gate after a refusal, doubling up to the cap
GATE_REPORT_EVERY = 60.0  # seconds between the gate's lines while the server keeps refusing
GATE_POLL = 0.25  # seconds a lane waits before it asks the gate again while another one tries


def refused_for_slots(exc: BaseException) -> bool:
    """Whether a connect failed because the server had no connection slot left (53300)."""
    text = str(exc)
    return any(phrase in text for phrase in TOO_MANY_CLIENTS)


class ConnectGate:
    """How a worker process opens its pool's connections while the server refuses them (53300, for
    want of slots) or cannot be reached (down, restarting, failing over). Every waiting job trying
    on its own schedule answered a full server with a connect attempt and a warning every few
    seconds each (a process of 500 lanes logged 4,000 lines), and took every slot freed by another
    client at once. Once a connect has failed, connections are opened one at a time: a single
    caller tries, and the others wait for its result; a failure closes the gate for a full-jitter
    backoff doubling from ``GATE_BASE`` up to ``cap``; a success lets the next caller try at once.
    The gate logs one line when connects first fail, one a minute while they go on, and one when
    connections are accepted again. ``turn`` and its reports are cheap, never block, and are called
    by the pools (threads or asyncio): sans-IO, the caller does the waiting."""

    def __init__(self, cap: float, clock: Callable[[], float] = time.monotonic):
        self.cap = cap
        self.clock = clock
        self._lock = threading.Lock()
        self._refusing = False  # since the first failure, until a minute passes without one
        self._refusals = 0  # in a row, since the last connect that was accepted
        self._closed_until = 0.0
        self._trying = False  # a caller is connecting under the gate: the others wait for it
        self._last_refusal = 0.0
        self._reported = 0.0
        self._refused_since_report = 0
        self.refused_total = 0

    @property
    def refusing(self) -> bool:
        return self._refusing

    @property
    def closed(self) -> bool:
        """The last connect failed and its pause has not passed."""
        return self._refusing and self.clock() < self._closed_until

    def turn(self) -> float:
        """0 when the caller may connect now (then it must report ``connected`` or
        ``connect_failed``), else the seconds to wait before it asks again."""
        with self._lock:
            now = self.clock()
            if self._refusing and not self._trying and now - self._last_refusal > GATE_REPORT_EVERY:
                self._refusing = False  # a minute without a failure: every caller on its own again
                log.warning("the server accepts connections again")
            if not self._refusing:
                return 0.0
            if now < self._closed_until:
                return self._closed_until - now
            if self._trying:
                return GATE_POLL
            self._trying = True
            return 0.0

    def connected(self) -> None:
        with self._lock:
            self._trying = False
            if self._refusing and self._refusals:
                self._refusals = 0
                log.info("a connection was accepted; connections are still opened one at a time")

    def connect_failed(self, exc: BaseException) -> None:
        """Report a failed connect: the gate closes and paces the next try."""
        with self._lock:
            now = self.clock()
            self._trying = False
            self._refusals += 1
            self.refused_total += 1
            self._refused_since_report += 1
            self._last_refusal = now
            pause = max(GATE_BASE / 2, backoff(self._refusals - 1, base=GATE_BASE, cap=self.cap))
            self._closed_until = max(self._closed_until, now + pause)
            if not self._refusing:
                self._refusing = True
                self._reported, self._refused_since_report = now, 0
                hint = (
                    "; lower --connections or free connections (pglockkit doctor counts them)"
                    if refused_for_slots(exc)
                    else ""
                )
                log.warning(
                    "the server refuses connections (%s): jobs that need one wait, and connections "
                    "are opened one at a time, one try every %g s at most%s",
                    first_line(exc), self.cap, hint,
                )  # fmt: skip
            elif now - self._reported >= GATE_REPORT_EVERY:
                log.warning(
                    "the server still refuses connections: %d refusal(s) in the last %.0f s (%s)",
                    self._refused_since_report, now - self._reported, first_line(exc),
                )  # fmt: skip
                self._reported, self._refused_since_report = now, 0


def check_connection_slots(settings: Settings, allowed: int, max_connections: int) -> None:
    """Refuse, before its pool connects, a worker that needs more connections than the server
    lets its role hold at all (its pool, its LISTEN and its heartbeat): it cannot work, and it
    would take every connection of the server from its other clients."""
    needed = settings.connections + 2
    if needed > allowed:
        raise LimitExceeded(
            f"connections {settings.connections} needs {needed} connections (the pool, LISTEN and "
            f"the heartbeat), and the server lets this role hold {allowed} in all (max_connections "
            f"{max_connections}): lower connections to at most {max(allowed - 2, 0)}, less what other "
            "clients hold"
        )


class Budget:
    """``max_jobs`` shared by the lanes of a worker: claims reserve, commits spend."""

    def __init__(self, max_jobs: int | None):
        self.max_jobs = max_jobs
        self.processed = 0
        self._reserved = 0
        self._lock = threading.Lock()

    def take(self, want: int) -> int:
        with self._lock:
            if self.max_jobs is None:
                return want
            n = max(0, min(want, self.max_jobs - self.processed - self._reserved))
            self._reserved += n
            return n

    def give_back(self, n: int) -> None:
        if self.max_jobs is not None and n:
            with self._lock:
                self._reserved -= n

    def spend(self, n: int) -> None:
        with self._lock:
            self.processed += n
            if self.max_jobs is not None:
                self._reserved -= n


class Watch:
    """The jobs a worker process has claimed and not yet finished: what its heartbeat extends."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()

    def add(self, jobs: list[Job]) -> None:
        with self._lock:
            for job in jobs:
                self._jobs[job.id] = job

    def remove(self, jobs: list[Job]) -> None:
        with self._lock:
            for job in jobs:
                if self._jobs.get(job.id) == job:
                    del self._jobs[job.id]

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())


# --- the lane ---------------------------------------------------------------------------------

IDLE, STOPPED, SPENT = "idle", "stopped", "spent"
CLAIM_TRIES = 5  # a claim of its own that conflicts (40001, 40P01) is sent again at once, this often


@dataclass
class Outcome:
    """What a driver reports after running the handler on a job."""

    failure: str | None = None  # the error's text, or None: the handler returned
    used_savepoint: bool = False  # the job's savepoint was made: a failure must roll back to it


def key_order(job: Job) -> tuple[int, str, str]:
    """The order in which the queue functions lock key rows (``_keys_left``: queue, then
    concurrency key, bytewise, which is code-point order for UTF-8): jobs without a key, which
    lock none, first."""
    if job.concurrency_key is None:
        return (0, "", "")
    return (1, job.queue, job.concurrency_key)


def give_back_calls(jobs: Sequence[Job]) -> list[Call[Any]]:
    """The ``release_job`` calls that hand unstarted jobs back at shutdown, in one transaction:
    each locks its job's key row until the transaction ends, so they go in key order, like a
    group's outcomes (``outcome_calls``), after locking all their job rows in id order."""
    calls = [_calls.release(job) for job in sorted(jobs, key=key_order)]
    return [_calls.lock_jobs(jobs), *calls] if len(calls) > 1 else calls


def outcome_calls(
    done: Sequence[Job], failed: Sequence[tuple[Job, str]]
) -> tuple[list[Call[Any]], list[int]]:
    """The ``complete_jobs`` and ``fail_job`` calls that record a group's outcomes in one
    transaction, and the positions of the ``complete_jobs`` ones. Each call locks the key rows of
    its jobs until the transaction ends, so the calls go in key order: a ``complete_jobs`` for
    each run of completions between failures, and keyless jobs (no key rows) with the first.
    Two groups that recorded a failure of one key after completing a job of another, in
    opposite pairings, each held a key row the other waited for: a deadlock, which rolled one
    group back. More than one call begins with ``_lock_jobs`` (the job rows in id order), so
    the group holds no key row while it waits for a job row: a stale ``complete_jobs`` (its
    leases expired while it ran) keeps the rows it reached locked, one of them the group's, and
    then waited for the group's key row."""
    keyed = sorted(  # stable: by key, completions before failures, then as they came
        [(key_order(job), False, job, "") for job in done if job.concurrency_key is not None]
        + [(key_order(job), True, job, f) for job, f in failed if job.concurrency_key is not None],
        key=lambda item: item[:2],
    )
    calls: list[Call[Any]] = []
    completions: list[int] = []
    run = [job for job in done if job.concurrency_key is None]

    def flush() -> None:
        if run:
            completions.append(len(calls))
            calls.append(_calls.complete_many(list(run)))
            run.clear()

    for _, is_failure, job, failure in keyed:
        if is_failure:
            flush()
            calls.append(_calls.fail(job, failure, None))
        else:
            run.append(job)
    flush()
    calls += [_calls.fail(job, failure, None) for job, failure in failed if job.concurrency_key is None]
    if len(calls) > 1:
        calls.insert(0, _calls.lock_jobs([*done, *(job for job, _ in failed)]))
        completions = [i + 1 for i in completions]
    return calls, completions


def stale_completions(asked: int, current: int) -> None:
    """Say so when completions found their claim stale: at least once, a job reclaimed after its
    lease ran out while it ran, or cancelled (exactly once, a group's cannot be)."""
    if current != asked:
        log.warning(
            "%d of %d completions found their claim stale (reclaimed or cancelled)", asked - current, asked
        )


# --- what the pools and the feeders decide (pool.py) ---------------------------------------

RECHECK = 0.25  # seconds: how often a caller waiting for a connection looks at the gate and the stop
MOST_PER_CLAIM = 1000  # claim_job's batch, at most: a feeder's larger claims go as several


def statement_failed(exc: BaseException) -> None:
    """Mark an ``OperationalError`` raised on a connection that outlived it (a statement cancelled
    by a timeout: ``_calls.outlived``), for a lane that did not hold that connection."""
    exc.pglockkit_outlived = True  # type: ignore[attr-defined]


def outlived(exc: BaseException, conn: Any) -> bool:
    """Whether the connection that raised ``exc`` is still usable: the lane's own, or the one a
    feeder sent its claim on."""
    if conn is not None:
        return _calls.outlived(conn)
    return getattr(exc, "pglockkit_outlived", False)


def claim_calls(s: Settings, total: int, token: bool) -> list[Call[Any]]:
    calls: list[Call[Any]] = [
        _calls.claim(s.queue, s.name, s.lease, min(MOST_PER_CLAIM, total - i), tolerant=True)
        for i in range(0, total, MOST_PER_CLAIM)
    ]
    return [*calls, _calls.next_rate_token(s.queue)] if token else calls


def record_calls(
    records: list[tuple[list[Job], list[tuple[Job, str]]]],
) -> tuple[list[Call[Any]], list[int], int]:
    """One transaction that records the outcomes of several lanes (in key order: ``outcome_calls``),
    the positions of its ``complete_jobs`` calls and how many jobs they complete."""
    done = [job for d, _ in records for job in d]
    failed = [f for _, fs in records for f in fs]
    calls, completions = outcome_calls(done, failed)
    statement = _calls.statement
    return [statement("BEGIN"), *calls, statement("COMMIT")], [i + 1 for i in completions], len(done)


def deal(results: list[Any], n_claims: int, sizes: list[int]) -> tuple[list[list[Job]], list[Job]]:
    """The claimed jobs dealt out, in the order the lanes asked: each gets up to its size; and the
    jobs left over (asked for by lanes that gave up waiting)."""
    jobs = [job for claimed in results[:n_claims] for job in claimed]
    dealt = []
    for n in sizes:
        dealt.append(jobs[:n])
        jobs = jobs[n:]
    return dealt, jobs


def reusable(conn: psycopg.BaseConnection[Any]) -> bool:
    return not (conn.closed or conn.broken) and conn.info.transaction_status == TransactionStatus.IDLE


class NoConnection(Exception):
    """The worker stops, and the pool could open no connection for a lane (the server refuses)."""


class Lane:
    """One lane's jobs in hand and its group commit; ``drain`` is driven by a worker."""

    def __init__(self, settings: Settings, watch: Watch, budget: Budget, stopping: Callable[[], bool]):
        self.s = settings
        self.watch = watch
        self.budget = budget
        self.stopping = stopping
        self.hand: deque[Job] = deque()  # ours: claimed by committed transactions or the open group
        self.running: list[Job] = []  # taken from the hand by the open group, not yet recorded
        # The open group's transaction id and its failures so far (its other running jobs are
        # done): if a handler ends the transaction with a COMMIT, what the jobs before it wrote is
        # committed (handler_ended).
        self.group_xid: str | None = None
        self._group_failed: list[tuple[Job, str]] = []
        self.job_seconds = 0.0  # a moving average of this lane's handler time
        # How many jobs at the head of the hand run alone: those of a group whose COMMIT failed.
        self.solo = 0

    # --- claims ---------------------------------------------------------------------------

    def _claim_size(self) -> int:
        """At most ``batch``, and no more than the lane expects to finish in one group time (one
        until it has timed a job), so jobs do not wait in one lane's hand while other lanes and
        workers could run them."""
        if self.stopping():
            return 0
        n = 1
        if self.job_seconds > 0:
            n = min(self.s.batch, max(1, int(max(self.s.group_time, 0.001) / self.job_seconds)))
        return self.budget.take(n)

    def _claim(self, n: int) -> Call[list[Job]]:
        return _calls.claim(self.s.queue, self.s.name, self.s.lease, n, tolerant=True)

    def _took(self, jobs: list[Job], asked: int) -> None:
        self.budget.give_back(asked - len(jobs))
        self.hand.extend(jobs)
        self.watch.add(jobs)

    def _drop(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job in self.hand:
                self.hand.remove(job)
        self.solo = min(self.solo, len(self.hand))
        self.watch.remove(jobs)
        self.budget.give_back(len(jobs))

    def abandon_group(self) -> None:
        """The open group rolled back (or its connection is gone): its jobs are no longer ours to
        finish. The heartbeat stops extending them, so their leases hand them back."""
        self.watch.remove(self.running)
        self.budget.give_back(len(self.running))
        self.running = []
        self.group_xid = None

    def handler_ended(self, job: Job, committed: bool) -> list[Call[Any]]:
        """A handler ended the group's transaction (COMMIT or ROLLBACK sent as SQL). The calls to
        run next, in autocommit: fail ``job``; and if the transaction committed, what the jobs
        before it wrote committed with it, so record their outcomes too (in key order), or they
        would run again after their lease and write twice. Rolled back, they go back by it."""
        self.running.remove(job)
        calls: list[Call[Any]] = []
        if committed:  # the group's other running jobs are its outcomes so far
            failed = [j for j, _ in self._group_failed]
            calls, _ = outcome_calls([j for j in self.running if j not in failed], self._group_failed)
            self.watch.remove(self.running)
            self.budget.spend(len(self.running))
            self.running = []
        self.abandon_group()
        self.watch.remove([job])
        self.budget.spend(1)
        return [*calls, _calls.fail(job, HANDLER_ENDED_TRANSACTION, None)]

    def forget(self) -> None:
        """The lane ends with jobs in hand it could not give back: their leases hand them back."""
        self.abandon_group()
        self._drop(list(self.hand))

    def _timed(self, seconds: float) -> None:
        self.job_seconds = seconds if self.job_seconds == 0 else 0.8 * self.job_seconds + 0.2 * seconds

    # --- the loop -------------------------------------------------------------------------

    def drain(self) -> Generator[Pipeline | Claim | Record | Handle, Any, str]:
        """Run groups until the queue has no job for this lane (IDLE), the worker stops (STOPPED:
        unstarted jobs are given back) or ``max_jobs`` is reached (SPENT)."""
        while True:
            if self.stopping():
                yield from self._give_back()
                return STOPPED
            if self.s.exactly_once:
                ended = yield from self._group()
            else:
                ended = yield from self._buffered_group()
            if ended is not None:
                return ended

    def _give_back(self) -> Generator[Pipeline, Any, None]:
        jobs = list(self.hand)
        if jobs:  # one transaction (a pipeline's implicit one): its key rows in key order
            _, error = yield Pipeline(give_back_calls(jobs))
            if error is not None:
                log.warning("could not give back %d unstarted job(s): %s", len(jobs), error)
            else:
                log.info("stopping: gave back %d unstarted job(s)", len(jobs))
            self._drop(jobs)

    def _closing(self, started: float, finished: int) -> bool:
        return finished >= self.s.group or time.monotonic() - started >= self.s.group_time or self.stopping()

    def _claim_alone(self) -> Generator[Claim, Any, str | None]:
        """Claim into an empty hand, in a transaction of its own."""
        n = self._claim_size()
        if n == 0:  # stopping, or max_jobs reached or reserved by other lanes
            return STOPPED if self.stopping() else SPENT
        for attempt in range(CLAIM_TRIES):
            results, error = yield Claim(n)
            if not isinstance(error, SerializationFailure | Deadlock) or attempt == CLAIM_TRIES - 1:
                break
            # A claim conflicted (40001 under REPEATABLE READ or SERIALIZABLE as the database's
            # default, where a row claimed after the statement's snapshot cannot be updated): it
            # changed nothing, and the next statement has a new snapshot.
            log.debug("claim conflicted, trying again: %s", error)
        if error is not None:
            self.budget.give_back(n)
            if isinstance(error, SerializationFailure | Deadlock):
                raise ClaimsConflicted(f"{CLAIM_TRIES} claims in a row conflicted") from error
            raise error
        self._took(results[0], n)
        return None if self.hand else IDLE

    def _group(self) -> Generator[Pipeline | Claim | Record | Handle, Any, str | None]:
        """One group of exactly-once jobs in one transaction. Returns IDLE when the queue had no
        job for the lane, STOPPED or SPENT, or None to go on."""
        if not self.hand:
            ended = yield from self._claim_alone()
            if ended is not None:
                return ended
            if self.stopping():  # stopped during the claim: give the jobs back (drain) unstarted
                return None
        if len(self.hand) == 1 or self.job_seconds >= self.s.group_time or self.solo:
            return (yield from self._alone())
        # Lock the jobs in hand for the group's life (and renew their leases). A claim does not
        # run inside the group: its per-key counts would stay locked, and other claimers wait.
        jobs = list(self.hand)
        results, error = yield Pipeline(
            [
                _calls.statement("BEGIN"),
                _calls.statement(_calls.KEEP_OPEN),  # handlers run in it: see KEEP_OPEN
                _calls.extend_many(jobs, self.s.lease),
                _calls.current_xid(),
            ]
        )
        if error is not None:
            raise error
        self.group_xid = results[3]
        if results[2] < len(jobs):  # a claim went stale since it was taken, or a row is busy
            results, error = yield Pipeline([_calls.extend(job, self.s.lease) for job in jobs])
            if error is not None:  # a job is gone (pruned): leave the hand to the leases
                self.forget()
                raise error
            lost = [job for job, ok in zip(jobs, results, strict=True) if not ok]
            for job in lost:
                log.warning(
                    "job %s: claim %s lost before it started (reclaimed or cancelled)", job.id, job.token
                )
            self._drop(lost)
        started = time.monotonic()
        done: list[Job] = []
        failed: list[tuple[Job, str]] = []
        self._group_failed = failed
        sp = 0
        while self.hand and not self._closing(started, len(done) + len(failed)):
            job = self.hand.popleft()
            self.running.append(job)
            sp += 1
            t0 = time.monotonic()
            outcome: Outcome = yield Handle(job, _calls.savepoint(sp))
            self._timed(time.monotonic() - t0)
            if outcome.failure is None:
                done.append(job)
                continue
            failed.append((job, outcome.failure))
            if outcome.used_savepoint:  # undo its writes now; the transaction may be aborted
                _, error = yield Pipeline([_calls.rollback_to(sp)])
                if error is not None:
                    raise error
        self.group_xid = None  # the transaction ends with the record: no handler can end it now
        return (yield from self._record(done, failed, begin=False, extend_hand=True))

    def _alone(self) -> Generator[Pipeline | Claim | Record | Handle, Any, str | None]:
        """One exactly-once job in a transaction of its own (slow jobs, or one in hand). Its row
        is not locked while the handler runs, so the heartbeat keeps renewing its lease however
        long it runs; ``complete_job`` then tells whether the claim is still ours, and a stale
        one rolls the job's writes back. The transaction begins with the handler's first
        statement: a handler that does not use its connection costs no round trip for it."""
        job = self.hand.popleft()
        self.solo = max(0, self.solo - 1)
        self.running.append(job)
        t0 = time.monotonic()
        outcome: Outcome = yield Handle(job, _calls.begin_worker_transaction(), begins=True)
        self._timed(time.monotonic() - t0)
        began = outcome.used_savepoint
        if outcome.failure is not None:
            if began:
                _, error = yield Pipeline([_calls.statement("ROLLBACK")])
                if error is not None:
                    raise error
            return (yield from self._record_outcomes([], [(job, outcome.failure)]))
        if not began:  # no writes to keep or undo: record it with the next claim, one round trip
            return (yield from self._record_outcomes([job], []))
        results, error = yield Pipeline([_calls.complete(job)])
        if error is not None and not isinstance(error, UnknownJob):
            raise error
        if error is not None or results[-1] is False:
            log.warning(
                "job %s: claim %s is %s; its writes were rolled back",
                job.id,
                job.token,
                "gone (cancelled and pruned)" if error else "stale (reclaimed or cancelled)",
            )
            _, error = yield Pipeline([_calls.statement("ROLLBACK")])
            if error is not None:
                raise error
            self.abandon_group()
            return None
        return (yield from self._record([], [], begin=False, completed=[job]))

    def _buffered_group(self) -> Generator[Pipeline | Claim | Record | Handle, Any, str | None]:
        """At-least-once jobs: handlers outside any transaction, their outcomes recorded with the
        next claim in one transaction."""
        if not self.hand:
            ended = yield from self._claim_alone()
            if ended is not None:
                return ended
        started = time.monotonic()
        done: list[Job] = []
        failed: list[tuple[Job, str]] = []
        while self.hand and not self._closing(started, len(done) + len(failed)):
            job = self.hand.popleft()
            self.running.append(job)
            t0 = time.monotonic()
            outcome: Outcome = yield Handle(job, None)
            self._timed(time.monotonic() - t0)
            if outcome.failure is None:
                done.append(job)
            else:
                failed.append((job, outcome.failure))
        return (yield from self._record_outcomes(done, failed))

    def _record_outcomes(
        self, done: list[Job], failed: list[tuple[Job, str]]
    ) -> Generator[Pipeline | Record, Any, str | None]:
        """Outcomes that need no transaction of the lane's own. A lane of fast jobs records them
        with its next claim (``_record``); a lane of slow jobs with the other lanes' (``Record``),
        then claims with them: 2,000 lanes of 1 s jobs each committing their own outcomes sent
        2,000 transactions a second."""
        if self.job_seconds < self.s.group_time or not (done or failed):
            return (yield from self._record(done, failed, begin=True))
        error = yield Record(done, failed)
        if error is None:
            self._finished(done, failed)
            return None
        log.info("outcomes recorded with other lanes' failed (%s); recording them alone", first_line(error))
        return (yield from self._record(done, failed, begin=True))

    def _finished(
        self, done: list[Job], failed: list[tuple[Job, str]], completed: Sequence[Job] = ()
    ) -> None:
        """The outcomes of the lane's running jobs committed."""
        self.running = []
        self.watch.remove([*done, *completed, *(job for job, _ in failed)])
        self.budget.spend(len(done) + len(completed) + len(failed))
        for job, failure in failed:
            log.info("job %s failed (attempt %d/%d): %s", job.id, job.attempt, job.max_attempts, failure)

    def _fail_each(self, failed: list[tuple[Job, str]]) -> Generator[Pipeline, Any, None]:
        """Record failures one by one (each commits alone): a job that another session cancelled
        and pruned meanwhile (``UnknownJob``) is passed over instead of undoing the others."""
        for job, failure in failed:
            _, error = yield Pipeline([_calls.fail(job, failure, None)])
            if error is not None and not isinstance(error, UnknownJob):
                raise error
            if error is not None:
                log.warning("job %s: gone (cancelled and pruned) before its failure was recorded", job.id)
            else:
                log.info("job %s failed (attempt %d/%d): %s", job.id, job.attempt, job.max_attempts, failure)
            self.running.remove(job)
            self.watch.remove([job])
            self.budget.spend(1)

    def _commit_failed(
        self, done: list[Job], failed: list[tuple[Job, str]], completed: Sequence[Job], error: Exception
    ) -> Generator[Pipeline, Any, None]:
        """The COMMIT of a transaction that handlers wrote in failed, not a statement before it:
        a deferred constraint (``DEFERRABLE INITIALLY DEFERRED``, as Django makes every foreign
        key) that a handler broke is checked only then, past its savepoint. The server rolled the
        transaction back whole: outcomes, writes and claim. The jobs' claims committed before, so
        they are still this lane's. A job that ran alone (``completed``) fails with the COMMIT's
        error, like a handler that raised. A group's failures are recorded as they were (their
        writes were undone with their savepoints), and its other jobs go back to the head of the
        hand to run again alone, one transaction each: only the one whose writes cannot commit
        fails then."""
        if completed:
            yield from self._fail_each([(job, f"at COMMIT: {error_text(error)}") for job in completed])
            return None
        log.warning(
            "group of %d job(s) failed at COMMIT (%s); running %d of them again, one per transaction",
            len(done) + len(failed),
            _calls.first_line(error),
            len(done),
        )
        yield from self._fail_each(failed)
        self.running = []
        self.hand.extendleft(reversed(done))
        self.solo += len(done)
        return None

    def _record(
        self,
        done: list[Job],
        failed: list[tuple[Job, str]],
        *,
        begin: bool,
        completed: Sequence[Job] = (),
        extend_hand: bool = False,
    ) -> Generator[Pipeline, Any, str | None]:
        """Record a group's outcomes (``completed``: jobs already completed in the open
        transaction) and, with the hand empty, claim the next jobs, then commit: one round trip,
        one commit. The claim's per-key counts are locked only until this commit; a claim that
        fails (a deadlock, say) is undone alone, under a savepoint of its own. A COMMIT that fails
        after handlers wrote (``begin`` false) is ``_commit_failed``. ``extend_hand``:
        the transaction locked the jobs left in hand (a group), so the heartbeat could not renew
        their leases while it ran; they are renewed before the commit unlocks them, or a group
        that ran longer than the lease left them to other workers' reclaims."""
        calls: list[Call[Any]] = [_calls.statement("BEGIN")] if begin else []
        outcomes, completions = outcome_calls(done, failed)
        completions = [len(calls) + i for i in completions]
        calls += outcomes
        if extend_hand and self.hand:
            calls.append(_calls.extend_many(list(self.hand), self.s.lease))
        n_outcomes = len(calls)
        # A lane of fast jobs claims its next ones with this commit. A lane of slow jobs (slower
        # than group_time) claims when its hand is empty, with the process's other lanes (Claim):
        # 2,000 lanes of 1 s jobs claiming one job each with their commits sent 2,000 claims a
        # second, and the feeder sends a few.
        n = 0 if self.hand or self.job_seconds >= self.s.group_time else self._claim_size()
        if n:
            calls += [_calls.savepoint(0), self._claim(n)]
        results, error = yield Pipeline([*calls, _calls.statement("COMMIT")])
        claimed: list[Job] = []
        if error is not None:
            at_commit = len(results) == len(calls)  # every statement before the COMMIT ran
            if n and len(results) == n_outcomes + 1:  # the claim failed, under its savepoint
                self.budget.give_back(n)
                n = 0
                (log.info if isinstance(error, RetryableError) else log.warning)(
                    "claim failed, retried later: %s", error
                )
                ran, error = yield Pipeline([_calls.rollback_to(0), _calls.statement("COMMIT")])
                at_commit = len(ran) == 1
        if error is not None:
            self.budget.give_back(n)
            if at_commit and not begin:  # a handler's writes cannot commit: the server rolled back
                return (yield from self._commit_failed(done, failed, completed, error))
            if not at_commit and begin and failed and isinstance(error, UnknownJob):
                # An outcome failed, and nothing else was in the transaction.
                _, error = yield Pipeline([_calls.statement("ROLLBACK")])
                if error is not None:
                    raise error
                yield from self._fail_each(failed)
                return (yield from self._record(done, [], begin=True, completed=completed))
            raise error
        if n:
            claimed = results[n_outcomes + 1]
        stale_completions(len(done), sum(results[i] for i in completions))
        self._finished(done, failed, completed)
        if n:
            self._took(claimed, n)
            if not self.hand:
                return IDLE
        return None
