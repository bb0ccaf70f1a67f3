"""The worker's drivers: ``pglockkit.aio.Worker`` runs its lanes as asyncio tasks, and
``pglockkit.Worker`` as threads.

One source: this text, as written in ``driver_async.py``, is the asyncio driver, and
``tools/async_to_sync.py`` writes the threads driver (``driver.py``) from it: ``await`` dropped,
the pool's and the connections' names read without their ``Async`` prefix, and each ``if True:
# ASYNC`` block replaced by its ``else:`` block (what only one flavour does: starting and
stopping the lanes, waiting, signals).
What a lane does with a job (claiming, running the handler, recording its outcome, recovering
from a lost connection) is written once, in the methods outside those blocks.

Per process: ``concurrency`` lanes, each running jobs one after another, sharing a pool of
``connections`` (``pglockkit.worker.pool``: a lane holds a connection only while it needs one,
and one that is lost is opened again); one LISTEN connection, which wakes idle lanes on NOTIFY;
one heartbeat and its connection, which extends every job in hand with one ``extend_jobs``
statement per tick. So ``connections + 2`` connections, whatever ``concurrency`` is. What a lane
decides (group commit, exactly once or at least once) is ``pglockkit.worker.lane``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from pglockkit import _calls
from pglockkit._calls import Job, first_line
from pglockkit.errors import PglockkitError
from pglockkit.retry import RECONNECT_BASE, backoff
from pglockkit.worker.lane import (
    HANDLER_ENDED_TRANSACTION,
    IDLE,
    NOTIFY_CHANNEL,
    Budget,
    Claim,
    ClaimsConflicted,
    Handle,
    HandlerEndedTransaction,
    Lane,
    NoConnection,
    Outcome,
    Record,
    Ticker,
    Watch,
    WorkerBase,
    check_connection_slots,
    is_async,
    outcome,
    outcome_without_connection,
    outlived,
    undecodable,
    worker_params,
)
from pglockkit.worker.pool_async import AsyncFeeder, AsyncHold, AsyncLazyConnection, AsyncPool

log = logging.getLogger("pglockkit.queue")

if True:  # ASYNC
    # Seconds a cancelled run() waits for its lanes to record what they finished and give back the
    # rest, after cancelling the handlers in flight; past it (a handler that ignores its
    # cancellation, a server that does not answer) the lanes are cancelled too, and their open
    # groups roll back.
    CANCEL_WAIT = 5.0
    INTERRUPTED = "the worker was cancelled while the handler ran"
else:
    STOP_LOOK = 0.25  # seconds: how often a waiting lane (or run()) looks at the stop flag

    class _Heartbeat:
        """Extends the lease of every job the process has in hand, every ``lease / 3``, with one
        statement on its own connection. It never dies: a failed tick is logged and tried again."""

        def __init__(self, dsn: str, lease: timedelta, application_name: str, watch: Watch):
            self.lease = lease
            self.watch = watch
            self._dsn, self._app = dsn, application_name
            self._stop = threading.Event()
            self._conn = psycopg.connect(dsn, **worker_params(dsn, application_name))
            self._thread = threading.Thread(target=self._run, name="pglockkit-heartbeat", daemon=True)
            self._thread.start()

        def _run(self) -> None:
            while not self._stop.wait(self.lease.total_seconds() / 3):
                jobs = self.watch.jobs()
                if not jobs:
                    continue
                try:
                    if self._conn.closed:  # lost (server restart, network): try again each tick
                        self._conn = psycopg.connect(self._dsn, **worker_params(self._dsn, self._app))
                    extended = _calls.run(self._conn, _calls.extend_many(jobs, self.lease))
                    if extended < len(jobs):
                        log.debug(
                            "heartbeat extended %d of %d jobs (others finished or stale)", extended, len(jobs)
                        )
                except Exception as exc:  # anything another session did must not end the heartbeat
                    log.warning("heartbeat failed for %d job(s): %s", len(jobs), first_line(exc))

        def close(self) -> None:
            self._stop.set()
            self._thread.join()
            self._conn.close()

    def returned_awaitable(result: Any) -> str:
        """Why a job whose ``def`` handler returned ``result`` (a coroutine, say) fails. A
        coroutine is closed, so that it is not reported "never awaited"."""
        what = f"an awaitable ({type(result).__name__})"
        if inspect.iscoroutine(result):
            what = f"a coroutine ({result.__qualname__})"
            result.close()
        return (
            f"the handler returned {what} instead of running it: an async def behind a plain function "
            "(a decorator, a lambda, an object with a def __call__); make the handler itself an async "
            "def (or an object with an async def __call__): pglockkit.Worker and `pglockkit work` then "
            "run it on pglockkit.aio.Worker"
        )


class Worker(WorkerBase):
    if True:  # ASYNC
        __doc__ = """``pglockkit.Worker`` for ``async def`` handlers, awaited on the running loop.

        ``await handler(job, conn)`` runs in the job's transaction on an ``AsyncConnection`` and
        commits with the job's completion (exactly once, group commit); ``await handler(job)``
        runs outside any transaction, its completions recorded in batches (at least once). Up to
        ``concurrency`` handlers are awaited at once. ``stop()`` may be called from any thread;
        SIGTERM/SIGINT stop it when the loop runs in the main thread. Cancelling the task that
        awaits ``run()`` stops it too, without waiting for the handlers in flight: they are
        cancelled and their jobs fail; finished jobs are recorded, unstarted ones given back,
        then ``run()`` raises ``CancelledError``.

        >>> async def send(job, conn):  # doctest: +SKIP
        ...     await conn.execute("INSERT INTO sent (job_id) VALUES (%s)", (job.id,))
        >>> await pglockkit.aio.Worker(dsn, "emails", send, concurrency=16).run()  # doctest: +SKIP
        """
    else:
        __doc__ = """Claim, run, heartbeat, complete or fail; wake on NOTIFY, poll as a fallback; stop
        gracefully.

        ``handler(job, conn)`` runs inside a transaction on ``conn``, and the job's completion
        commits in that same transaction: its writes and its ``done`` commit together or not at
        all (exactly once). Jobs that run one after another on a connection share one
        transaction, a savepoint each (group commit: ``group`` jobs or ``group_time`` seconds,
        whichever comes first). Raising rolls back to the job's savepoint and records a failed
        attempt (retried with backoff until ``max_attempts``, then dead); the group's other jobs
        are not affected.

        ``handler(job)``, with no connection (it only calls outside systems), runs outside any
        transaction, and its completions are recorded in batches: a crash before they are
        recorded runs those jobs again (at least once).

        ``concurrency`` jobs run at once: ``def`` handlers on that many threads, ``async def``
        handlers on an asyncio loop (``pglockkit.aio.Worker``). A lane claims up to ``batch``
        jobs at a time, fewer when its jobs are slow. SIGTERM/SIGINT (when ``run`` is called in
        the main thread) finish the jobs in hand, commit, give back unstarted jobs, and return.

        A lost connection (server restart, failover, terminated backend) is retried with
        full-jitter exponential backoff (0.1 s doubling up to ``reconnect_cap``); the open
        group's jobs go back by their lease. A first connection that fails raises at once (a
        wrong DSN is not an outage).

        With ``tick_schedules`` (default), the process also ticks the database's schedules
        (``pglockkit.tick_schedules``) about once a second on its LISTEN connection, so that due
        slots become jobs while any worker runs; each slot is enqueued once however many tick.

        >>> def send(job, conn):  # doctest: +SKIP
        ...     conn.execute("INSERT INTO sent (job_id, email) VALUES (%s, %s)", (job.id, job.payload["to"]))
        >>> Worker(dsn, "emails", send, concurrency=4).run()  # doctest: +SKIP
        """

    # --- starting and stopping --------------------------------------------------------------

    async def run(self, *, max_jobs: int | None = None, exit_when_idle: bool = False) -> int:
        """Work until stopped (or ``max_jobs`` done, or, with ``exit_when_idle``, until every lane
        found the queue without a due job, other than ones a paused queue or a concurrency limit
        holds back: a due job waiting for its rate key's next token is waited for). Returns the
        number of jobs processed."""
        if True:  # ASYNC
            self._loop = asyncio.get_running_loop()
            self._kick = asyncio.Event()
            self._stopped = asyncio.Event()
            if self._stopping.is_set():
                self._stopped.set()
        else:
            if self._delegate:
                return asyncio.run(self._delegate.run(max_jobs=max_jobs, exit_when_idle=exit_when_idle))
        self._budget = Budget(max_jobs)
        app = f"pglockkit worker {self.settings.queue}"
        listener = await self._open_listener(app)
        restore = self._install_signal_handlers()
        try:
            await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self._open_pool(app)
            listener = await self._run_lanes(listener, app, exit_when_idle)
        finally:
            self._stop_now()
            if self._pool is not None:
                await self._pool.close()
            await listener.close()
            restore()
        return self.processed

    def _stop_now(self) -> None:
        """Stop the lanes: they finish the jobs in hand and end."""
        self._stopping.set()
        self._notify()

    def _ready(self) -> None:
        self._pool: AsyncPool | None = None
        self._feeder: AsyncFeeder | None = None
        self._poller = False  # an idle lane waits with a timeout (to poll); the others for a NOTIFY
        self._ready_flavour()

    if True:  # ASYNC

        def _check_handler(self, handler: Callable[..., Any]) -> None:
            if not is_async(handler):
                raise TypeError(
                    f"pglockkit.aio.Worker awaits `async def` handlers; {handler!r} is not one: "
                    "run it with pglockkit.Worker (threads)"
                )

        def _ready_flavour(self) -> None:
            self._loop: asyncio.AbstractEventLoop | None = None
            self._kick = asyncio.Event()
            self._stopped = asyncio.Event()
            self._in_handler: set[asyncio.Task[Any]] = set()  # lanes awaiting a handler
            self._interrupted: set[asyncio.Task[Any]] = set()  # lanes whose handler run() cancelled

        def stop(self) -> None:
            """Ask the worker to finish the jobs in hand, commit, give back the rest and return.
            Safe from any thread."""
            self._stopping.set()
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
                    self._loop.call_soon_threadsafe(self._notify)

        def _asked_to_stop(self) -> bool:
            return self._stopping.is_set()

        async def _run_lanes(
            self, listener: psycopg.AsyncConnection, app: str, exit_when_idle: bool
        ) -> psycopg.AsyncConnection:
            """The lanes, the heartbeat and the listener as tasks, until the lanes have ended; the
            listener to close (its task closes the ones it opened)."""
            tasks: list[asyncio.Task[Any]] = []
            lanes: list[asyncio.Task[None]] = []
            try:
                heartbeat = await self._connect(f"{app} heartbeat")
                tasks.append(asyncio.create_task(self._heartbeat(heartbeat, f"{app} heartbeat")))
                tasks.append(asyncio.create_task(self._listen(listener, f"{app} listen")))
                lanes = [
                    asyncio.create_task(self._lane(exit_when_idle)) for _ in range(self.settings.concurrency)
                ]
                await self._until_done(lanes)
            finally:
                self._stop_now()
                if lanes:
                    await asyncio.gather(*lanes, return_exceptions=True)
                if self._feeder is not None:
                    await self._feeder.close()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return listener

        async def _until_done(self, lanes: list[asyncio.Task[None]]) -> None:
            """Wait for the lanes. ``asyncio.wait`` does not pass a cancellation of ``run()`` on to
            them (``gather`` did: every lane rolled back and ended with its hand still claimed, the
            jobs it had not started burning an attempt at their lease's end, finished at-least-once
            jobs left unrecorded to run again): they stop the way ``stop()`` stops them."""
            try:
                done, _ = await asyncio.wait(lanes, return_when=asyncio.FIRST_EXCEPTION)
            except asyncio.CancelledError:
                await self._wind_down(lanes)
                raise  # a cancelled task ends cancelled
            for lane in done:
                lane.result()  # a lane's BaseException (or its own cancellation) goes on up

        async def _wind_down(self, lanes: list[asyncio.Task[None]]) -> None:
            """``run()`` was cancelled: stop as ``stop()`` does, but cancel the handlers in flight
            instead of awaiting them (each fails its job: ``_call_handler``). The lanes record the
            outcomes they hold and give back their unstarted jobs, within ``CANCEL_WAIT`` seconds,
            shielded from further cancellations of ``run()`` (anyio's cancel scopes cancel again at
            every await); lanes still busy then are cancelled: their open groups roll back, their
            jobs go back by their lease."""
            self._stop_now()
            for lane in self._in_handler:
                self._interrupted.add(lane)
                lane.cancel()
            waiting = asyncio.ensure_future(asyncio.wait(lanes, timeout=CANCEL_WAIT))
            while not waiting.done():
                with contextlib.suppress(asyncio.CancelledError):  # cancelled again: the wait is bounded
                    await asyncio.shield(waiting)
            self._interrupted.clear()
            late = [lane for lane in lanes if not lane.done()]
            if late:
                log.warning(
                    "cancelled: %d lane(s) still busy after %g s, rolling back", len(late), CANCEL_WAIT
                )
            for lane in late:
                lane.cancel()

    else:

        def _ready_flavour(self) -> None:
            self._wake = threading.Condition()
            self._wakeups = 0
            self._stop_asked = False  # by stop(): a plain flag, which a signal handler may set
            self._delegate: Any = None
            if is_async(self.handler):
                from pglockkit.worker.driver_async import Worker as AsyncWorker

                self._delegate = AsyncWorker(self.dsn, self.queue, self.handler, **self.options)

        @property
        def processed(self) -> int:
            """Jobs whose outcome (done or a failed attempt) has committed."""
            return self._delegate.processed if self._delegate else self._budget.processed

        @property
        def reconnects(self) -> int:
            """Pauses after a lost connection or a failed statement, all lanes together."""
            return self._delegate.reconnects if self._delegate else self._reconnects

        def stop(self) -> None:
            """Ask the worker to finish the jobs in hand, commit, give back the rest and return.
            Safe from any thread and from a signal handler. In the main thread (where signal
            handlers run, wherever that thread was: perhaps inside a lock that waking the lanes
            takes) it only sets a flag, which the lanes and the thread in ``run`` look at every
            quarter of a second."""
            if self._delegate:
                self._delegate.stop()
            self._stop_asked = True
            if threading.current_thread() is not threading.main_thread():
                self._pass_on_stop()

        def _asked_to_stop(self) -> bool:
            return self._stop_asked or self._stopping.is_set()

        def _pass_on_stop(self) -> bool:
            """In the thread of ``run``: wake the lanes if ``stop`` was asked. True once stopping."""
            if self._stop_asked and not self._stopping.is_set():
                self._stop_now()
            return self._stopping.is_set()

        def _run_lanes(
            self, listener: psycopg.Connection, app: str, exit_when_idle: bool
        ) -> psycopg.Connection:
            """The lanes as threads and the heartbeat's, this thread listening, until the lanes
            have ended; the listener to close (the one it reconnected, if it did)."""
            lanes: list[threading.Thread] = []
            heartbeat = None
            try:
                heartbeat = _Heartbeat(self.dsn, self.settings.lease, f"{app} heartbeat", self._watch)
                for i in range(self.settings.concurrency):
                    name = f"pglockkit-lane-{i}"
                    lanes.append(threading.Thread(target=self._lane, args=(exit_when_idle,), name=name))
                    lanes[-1].start()
                listener = self._listen(listener, lanes)
            finally:
                self._stop_now()
                for t in lanes:
                    t.join()
                if heartbeat is not None:
                    heartbeat.close()
            return listener

    async def _connect(self, application_name: str) -> psycopg.AsyncConnection:
        return await psycopg.AsyncConnection.connect(self.dsn, **worker_params(self.dsn, application_name))

    async def _open_listener(self, app: str) -> psycopg.AsyncConnection:
        """The LISTEN connection, the process's first: a wrong DSN raises here, at once, and so
        does a setting that the server's connection slots cannot hold."""
        listener = await self._connect(f"{app} listen")
        try:
            check_connection_slots(self.settings, *await _calls.arun(listener, _calls.connection_slots()))
        except BaseException:
            await listener.close()
            raise
        return listener

    def _open_pool(self, app: str) -> None:
        """The pool the lanes share (it connects on demand) and its feeder."""
        s = self.settings
        self._pool = AsyncPool(
            self.dsn, worker_params(self.dsn, app), s.connections, self._gate, self._asked_to_stop
        )
        self._feeder = AsyncFeeder(self._pool, s, self._notify)

    def _backoff(self, failures: int, what: str) -> float:
        """The pause after ``failures`` failures in a row, counted and logged."""
        pause = backoff(failures, base=RECONNECT_BASE, cap=self.settings.reconnect_cap)
        self._reconnects += 1
        log.warning("%s in %.2f s (attempt %d)", what, pause, failures + 1)
        return pause

    async def _tick(self, listener: psycopg.AsyncConnection, ticker: Ticker) -> None:
        """The schedules' tick, when it is due, on the LISTEN connection. A lost connection raises
        (the listener reconnects); any other error is the ticker's to log and back off from."""
        if ticker.due():
            try:
                await _calls.arun(listener, _calls.tick_schedules())
            except psycopg.OperationalError:
                raise
            except Exception as exc:
                ticker.failed(exc)

    # --- lanes ------------------------------------------------------------------------------

    async def _lane(self, exit_when_idle: bool) -> None:
        """A lane: its jobs one after another, on the pool's connections; a lost one is dropped and
        the lane pauses with the worker's backoff."""
        assert self._pool is not None and self._feeder is not None
        lane = Lane(self.settings, self._watch, self._budget, self._asked_to_stop)
        failures = 0
        hold = AsyncHold(self._pool)
        try:
            while True:
                if failures and self._asked_to_stop():
                    # Stopping after a failure (the server may be down): the jobs in hand go back by
                    # their lease. Trying again would wait out the connect timeout, again and again.
                    return
                mark = self._wake_mark()
                try:
                    why = await self._drive(lane, hold)
                    token_in = None
                    if why == IDLE:
                        token_in = await self._feeder.next_rate_token()
                    failures = 0
                except NoConnection:
                    return  # stopping while the server refuses connections: as after a failure
                except psycopg.OperationalError as exc:
                    if outlived(exc, hold.conn):  # a statement cancelled: the connection goes on
                        await hold.release()
                        failures = await self._pause(
                            failures, f"lane error, group rolled back ({first_line(exc)})"
                        )
                        continue
                    await hold.drop()
                    failures = await self._pause(
                        failures, f"connection lost ({first_line(exc)}); reconnecting"
                    )
                    continue
                except ClaimsConflicted as exc:  # nothing held, nothing undone
                    await hold.release()
                    failures = await self._pause(
                        failures, f"{exc} ({first_line(exc.__cause__)}); claiming again"
                    )
                    continue
                except Exception as exc:  # a statement of the lane failed: its group rolled back
                    if not isinstance(exc, psycopg.Error | PglockkitError):  # a bug: show where
                        log.error("lane error", exc_info=True)
                    await hold.release()
                    failures = await self._pause(
                        failures, f"lane error, group rolled back ({first_line(exc)})"
                    )
                    continue
                if why != IDLE or self._asked_to_stop() or (exit_when_idle and token_in is None):
                    return
                await self._wait_for_work(mark, token_in)
        finally:
            lane.forget()
            if hold.conn is not None:
                if hold.conn.info.transaction_status == TransactionStatus.IDLE:
                    await hold.release()
                else:
                    await hold.drop()

    async def _drive(self, lane: Lane, hold: AsyncHold) -> str:
        """Run ``lane.drain`` until it returns why it stopped, on a pool connection for each of its
        round trips and transactions (given back whenever none is open)."""
        while True:
            gen = lane.drain()
            reply: Any = None
            try:
                while True:
                    request = gen.send(reply)
                    if isinstance(request, Handle):
                        reply = await self._handle(hold, request)
                    elif isinstance(request, Claim):
                        reply = await self._feeder.claim(request.n)
                    elif isinstance(request, Record):
                        reply = await self._feeder.record(request.done, request.failed)
                    else:
                        reply = await _calls.arun_pipeline(await hold.get(), request.calls)
                    await hold.release()
            except StopIteration as end:
                return end.value
            except HandlerEndedTransaction as exc:
                assert hold.conn is not None
                await self._handler_ended_transaction(lane, hold.conn, exc.args[0])
                await hold.release()
            except BaseException:
                lane.abandon_group()
                conn = hold.conn
                if conn is not None:
                    conn.in_job = False
                    if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
                        await _calls.arun_pipeline(conn, [_calls.statement("ROLLBACK")])
                raise
            finally:
                gen.close()

    async def _handle(self, hold: AsyncHold, request: Handle) -> Outcome:
        """Run the handler; an exactly-once one gets the lane's connection if it holds one (a
        group's), else one that takes a pool connection at its first statement."""
        assert self._pool is not None and self._pool.sample is not None
        encoding = self._pool.sample.info.encoding
        if (failed := undecodable(request, encoding)) is not None:
            return failed
        lazy: AsyncLazyConnection | None = None
        conn: Any = hold.conn
        if conn is not None:
            conn.start_job(request.savepoint)
        elif self.settings.exactly_once:
            conn = lazy = AsyncLazyConnection(hold, request.savepoint)
        error = await self._call_handler(request, conn)
        used = hold.conn if lazy is None else lazy.taken
        if used is None:  # the handler never used a connection
            return outcome_without_connection(error, encoding)
        return outcome(used, request, self.settings.exactly_once, error)

    if True:  # ASYNC

        async def _call_handler(self, request: Handle, conn: Any) -> BaseException | None:
            """What the handler raised (None: it returned): the job's failure. The lane's own
            cancellation goes on up."""
            task = asyncio.current_task()
            assert task is not None
            self._in_handler.add(task)
            try:
                if self.settings.exactly_once:
                    await self.handler(request.job, conn)
                else:
                    await self.handler(request.job)
            except asyncio.CancelledError as exc:
                if task in self._interrupted:
                    # run() was cancelled (_wind_down): the job's run is cut short, a failed
                    # attempt like any other (its writes roll back to its savepoint); the lane goes
                    # on to record its group and give back the rest.
                    return asyncio.CancelledError(INTERRUPTED)
                # The lane's own cancellation (the loop ending, run() cancelled past CANCEL_WAIT)
                # goes on up: its group rolls back. One the handler met inside (it awaited a task
                # someone cancelled) is the job's failure: left to rise, it ended the worker, and
                # the job, run again, ended the next one.
                if task.cancelling():
                    raise
                return exc
            except (Exception, SystemExit) as exc:  # a library's sys.exit() too: the job fails
                return exc
            except BaseException as exc:
                # A KeyboardInterrupt raised by code (a signal goes to run()'s handler, which stops
                # the worker), a library's own BaseException: the job's failure too (it ended the
                # worker, and the job, run again, ended the next one). Not GeneratorExit (the
                # coroutine being closed), nor anything raised while the lane itself is being
                # cancelled: those go on up.
                if isinstance(exc, GeneratorExit) or (task.cancelling() and task not in self._interrupted):
                    raise
                return exc
            finally:
                self._in_handler.discard(task)
                if task in self._interrupted:  # the cancellation was delivered: the lane is not cancelled
                    self._interrupted.discard(task)
                    task.uncancel()
            return None

    else:

        def _call_handler(self, request: Handle, conn: Any) -> BaseException | None:
            """What the handler raised (None: it returned): the job's failure.

            Whatever the handler raises fails its job. A BaseException (a library's sys.exit(), an
            asyncio.CancelledError out of an asyncio.run, a KeyboardInterrupt raised by code, a
            library's own unwinding exception) ended the lane's thread without a word, the job
            left running until its lease, and run() returned as if the queue were done. A lane
            thread gets no signal's KeyboardInterrupt: the main thread handles SIGINT."""
            try:
                if self.settings.exactly_once:
                    result = self.handler(request.job, conn)
                else:
                    result = self.handler(request.job)
                if result is not None and inspect.isawaitable(result):
                    raise TypeError(returned_awaitable(result))
            except BaseException as exc:
                return exc
            return None

    async def _handler_ended_transaction(self, lane: Lane, conn: psycopg.AsyncConnection, job: Job) -> None:
        """The handler ran COMMIT or ROLLBACK on the worker's transaction: this job is recorded as
        failed, and the group's earlier jobs as done (or failed) if the group committed, since
        their writes did; rolled back, they go back by their lease (``Lane.handler_ended``)."""
        log.error("job %s: %s", job.id, HANDLER_ENDED_TRANSACTION)
        if conn.info.transaction_status != TransactionStatus.IDLE:  # one the handler began itself
            await _calls.arun_pipeline(conn, [_calls.statement("ROLLBACK")])
        xid = lane.group_xid
        committed = xid is not None and await _calls.arun(conn, _calls.xact_status(xid)) == "committed"
        _, error = await _calls.arun_pipeline(conn, lane.handler_ended(job, committed))
        if error is not None:
            raise error

    # --- waiting, waking, the heartbeat and signals -----------------------------------------

    async def _wait_for_work(self, mark: Any, token_in: float | None) -> None:
        """Until a NOTIFY or a stop (``mark``: what ``_wake_mark`` gave before the lane looked for
        work); one idle lane (the poller) also wakes after the poll interval, or when a rate token
        that due jobs wait for comes (``next_rate_token``). Each of 2,000 idle lanes polling once a
        second sent 2,000 claims a second for an empty queue; a claim that finds jobs wakes the
        others (the feeder's ``found``), as a NOTIFY does."""
        if True:  # ASYNC
            timeout = None
            if not self._poller:
                self._poller = True
                timeout = self._idle_wait(token_in)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(mark.wait(), timeout)
            finally:
                if timeout is not None:
                    self._poller = False
        else:
            with self._wake:
                poller = not self._poller
                self._poller = True
                deadline = time.monotonic() + self._idle_wait(token_in) if poller else None
                try:
                    while self._wakeups == mark and not self._asked_to_stop():
                        left = STOP_LOOK if deadline is None else deadline - time.monotonic()
                        if left <= 0:
                            return
                        self._wake.wait(min(left, STOP_LOOK))
                finally:
                    if poller:
                        self._poller = False

    if True:  # ASYNC

        def _wake_mark(self) -> asyncio.Event:
            """What ``_wait_for_work`` waits on: set by the next ``_notify``."""
            return self._kick

        def _notify(self) -> None:
            if self._stopping.is_set():
                self._stopped.set()
            self._kick.set()
            self._kick = asyncio.Event()

        async def _pause(self, failures: int, what: str) -> int:
            pause = self._backoff(failures, what)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), pause)
            return failures + 1

        async def _heartbeat(self, conn: psycopg.AsyncConnection, application_name: str) -> None:
            """Extends every job in hand, every ``lease / 3``, with one statement; never dies."""
            try:
                while True:
                    await asyncio.sleep(self.settings.lease.total_seconds() / 3)
                    jobs = self._watch.jobs()
                    if not jobs:
                        continue
                    try:
                        if conn.closed:
                            conn = await self._connect(application_name)
                        await _calls.arun(conn, _calls.extend_many(jobs, self.settings.lease))
                    except Exception as exc:  # anything another session did must not end the heartbeat
                        log.warning("heartbeat failed for %d job(s): %s", len(jobs), first_line(exc))
            finally:
                await conn.close()

        async def _listen(self, listener: psycopg.AsyncConnection, application_name: str) -> None:
            failures = 0
            ticker = Ticker(self.settings.tick_schedules)
            try:
                while True:
                    try:
                        if listener.closed and self._stopping.is_set():
                            await asyncio.sleep(0.25)  # the lanes are ending: no reconnects
                            continue
                        if listener.closed:
                            listener = await self._connect(application_name)
                            await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
                            failures = 0
                        async for _ in listener.notifies(timeout=1.0, stop_after=1):
                            self._notify()
                        await self._tick(listener, ticker)
                    except psycopg.OperationalError as exc:
                        await listener.close()
                        failures = await self._pause(
                            failures, f"listen connection lost ({first_line(exc)}); reconnecting"
                        )
            finally:
                await listener.close()

        def _install_signal_handlers(self) -> Callable[[], None]:
            if threading.current_thread() is not threading.main_thread() or self._loop is None:
                return lambda: None
            loop = self._loop
            previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
            # A signal the loop already handles (the application's loop.add_signal_handler: Python
            # sees asyncio's no-op trampoline) is left to that handler, which should call stop():
            # replacing it and then restoring the trampoline left the signal ignored after run()
            # returned.
            trampoline = "asyncio.unix_events"
            previous = {sig: h for sig, h in previous.items() if getattr(h, "__module__", None) != trampoline}
            for sig in previous:
                loop.add_signal_handler(sig, self.stop)

            def restore() -> None:
                # remove_signal_handler resets to the defaults (SIG_DFL, default_int_handler), not
                # to what was there: an application's own SIGTERM handler was gone after run()
                # returned, and so was asyncio.run's SIGINT handling (which cancels the main task).
                for sig, handler in previous.items():
                    loop.remove_signal_handler(sig)
                    if handler is not None:  # None: set outside Python, cannot be put back
                        signal.signal(sig, handler)

            return restore

    else:

        def _wake_mark(self) -> int:
            """What ``_wait_for_work`` compares with: the next ``_notify`` changes it."""
            return self._wakeups

        def _notify(self) -> None:
            with self._wake:
                self._wakeups += 1
                self._wake.notify_all()

        def _pause(self, failures: int, what: str, *, in_run: bool = False) -> int:
            pause = self._backoff(failures, what)
            # Looking for a stop() every quarter of a second (the thread of run() passes it on),
            # with no lock held while it waits.
            deadline = time.monotonic() + pause
            while (left := deadline - time.monotonic()) > 0:
                if in_run:
                    self._pass_on_stop()
                if self._asked_to_stop():
                    break
                time.sleep(min(left, STOP_LOOK))
            return failures + 1

        def _listen(self, listener: psycopg.Connection, lanes: list[threading.Thread]) -> psycopg.Connection:
            """Wake the lanes on every NOTIFY until they have all ended; reconnects when lost."""
            failures = 0
            ticker = Ticker(self.settings.tick_schedules)
            while any(t.is_alive() for t in lanes):
                self._pass_on_stop()
                try:
                    if listener.closed and self._stopping.is_set():
                        time.sleep(0.25)  # the lanes are ending: no reconnects (the pause is 0 now)
                        continue
                    if listener.closed:
                        listener = self._connect(f"pglockkit worker {self.queue} listen")
                        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
                        failures = 0
                    for _ in listener.notifies(timeout=0.25, stop_after=1):
                        self._notify()
                    self._tick(listener, ticker)
                except psycopg.OperationalError as exc:
                    listener.close()
                    failures = self._pause(
                        failures, f"listen connection lost ({first_line(exc)}); reconnecting", in_run=True
                    )
            return listener

        def _install_signal_handlers(self) -> Callable[[], None]:
            if threading.current_thread() is not threading.main_thread():
                return lambda: None
            previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
            for sig in previous:
                signal.signal(sig, lambda *_: self.stop())

            def restore() -> None:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

            return restore
