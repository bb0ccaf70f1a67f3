"""The job queue from Python: one function per SQL call, and a ``Worker`` loop.

The worker runs each handler inside a transaction on its own connection and completes the job in
that same transaction: the handler's writes and the job's ``done`` commit together or not at all.
A worker that lost its claim (lease expired, job reclaimed by another worker) gets ``false`` from
``complete_job`` and rolls its writes back, so a job's effects are recorded exactly once even when
workers die mid-job.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg

from pglockkit import _calls
from pglockkit._calls import Job
from pglockkit.connection import connect
from pglockkit.leases import default_holder
from pglockkit.retry import backoff

log = logging.getLogger("pglockkit.queue")

NOTIFY_CHANNEL = "pglockkit_jobs"


def enqueue(
    conn: psycopg.Connection,
    queue: str,
    payload: Any = None,
    *,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    priority: int = 0,
    dedup_key: str | None = None,
    max_attempts: int = 5,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
) -> int:
    """Add a job; returns its id (the existing job's id when ``dedup_key`` matches a pending one).

    With ``concurrency_key`` (a tenant, an account, a graph) and ``concurrency_limit``, at most that
    many jobs of the queue with that key run at once; jobs of other keys are not held up.

    >>> enqueue(conn, "emails", {"to": "ana@example.com"}, priority=10)  # doctest: +SKIP
    1
    """
    call = _calls.enqueue(
        queue,
        payload,
        run_at=run_at,
        delay=delay,
        priority=priority,
        dedup_key=dedup_key,
        max_attempts=max_attempts,
        concurrency_key=concurrency_key,
        concurrency_limit=concurrency_limit,
    )
    return _calls.run(conn, call)


def enqueue_many(
    conn: psycopg.Connection, queue: str, payloads: Sequence[Any], *, priority: int = 0, max_attempts: int = 5
) -> list[int]:
    """Add one job per payload in one statement; returns the ids in payload order."""
    return _calls.run(conn, _calls.enqueue_many(queue, payloads, priority, max_attempts))


def claim(
    conn: psycopg.Connection, queue: str, worker: str, *, lease: float | timedelta = 300, batch: int = 1
) -> list[Job]:
    """Claim up to ``batch`` jobs; never waits on other claimers."""
    return _calls.run(conn, _calls.claim(queue, worker, lease, batch))


def complete(conn: psycopg.Connection, job: Job) -> bool:
    """Mark done; False if this claim is stale (the job was reclaimed or cancelled)."""
    return _calls.run(conn, _calls.complete(job))


def complete_many(conn: psycopg.Connection, jobs: Sequence[Job]) -> int:
    """Complete a batch in one statement; returns how many claims were current."""
    return _calls.run(conn, _calls.complete_many(jobs))


def fail(conn: psycopg.Connection, job: Job, error: str, retry_in: float | timedelta | None = None) -> str:
    """Record a failed attempt; returns 'queued' (will retry), 'dead' or 'stale'."""
    return _calls.run(conn, _calls.fail(job, error, retry_in))


def extend(conn: psycopg.Connection, job: Job, lease: float | timedelta) -> bool:
    """Heartbeat; False if the claim is stale."""
    return _calls.run(conn, _calls.extend(job, lease))


def extend_many(conn: psycopg.Connection, jobs: Sequence[Job], lease: float | timedelta) -> int:
    """Heartbeat for many jobs in one statement; returns how many claims were current and extended
    (a job whose row another transaction holds is passed over, never waited for)."""
    return _calls.run(conn, _calls.extend_many(jobs, lease))


def release(conn: psycopg.Connection, job: Job) -> bool:
    """Give a claimed job back unstarted (its attempt does not count)."""
    return _calls.run(conn, _calls.release(job))


def cancel(conn: psycopg.Connection, job_id: int) -> bool:
    """Cancel a queued or running job; False if it had already finished. A running job's worker
    finds its claim stale at its next complete, fail or extend."""
    return _calls.run(conn, _calls.cancel(job_id))


def load_handler(spec: str) -> Callable[[Job, psycopg.Connection], Any]:
    """``'package.module:function'`` to the function."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"handler must look like module:function, got {spec!r}")
    return getattr(importlib.import_module(module_name), func_name)


class _Heartbeat:
    """Extends the leases of the jobs being worked on, every ``lease / 3``, on its own connection."""

    def __init__(self, dsn: str, lease: timedelta, application_name: str):
        self.lease = lease
        self.jobs: list[Job] = []
        self.lost: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._dsn, self._app = dsn, application_name
        self._conn = connect(dsn, autocommit=True, application_name=application_name)
        self._thread = threading.Thread(target=self._run, name="pglockkit-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, jobs: list[Job]) -> None:
        with self._lock:
            self.jobs = list(jobs)

    def _run(self) -> None:
        while not self._stop.wait(self.lease.total_seconds() / 3):
            with self._lock:
                jobs = list(self.jobs)
            if jobs and self._conn.closed:
                try:  # the connection was lost (server restart, network): try again each tick
                    self._conn = connect(self._dsn, autocommit=True, application_name=self._app)
                except psycopg.OperationalError as exc:
                    log.warning("heartbeat cannot reconnect: %s", exc)
                    continue
            for job in jobs:
                try:
                    # A job finished meanwhile is no longer watched: its failed extension is no loss.
                    if not extend(self._conn, job, self.lease) and self._watching(job):
                        self.lost.add(job.id)
                        log.warning(
                            "lost claim of job %s (token %s): lease expired or job reclaimed",
                            job.id,
                            job.token,
                        )
                except psycopg.Error as exc:
                    log.warning("heartbeat failed for job %s: %s", job.id, exc)

    def _watching(self, job: Job) -> bool:
        with self._lock:
            return job in self.jobs

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()


class Worker:
    """Claim, run, heartbeat, complete or fail; wake on NOTIFY, poll as a fallback; stop gracefully.

    ``handler(job, conn)`` runs inside a transaction on ``conn``; returning completes the job in
    that same transaction, raising records a failed attempt (retried with backoff until
    ``max_attempts``, then dead). SIGTERM/SIGINT (when ``run`` is called in the main thread)
    finish the job in hand, give back the rest of the batch, and return.

    When a connection is lost after the worker has started (server restart, failover, network,
    terminated backend), it reconnects with full-jitter exponential backoff (0.1 s doubling up to
    ``reconnect_cap``), forever, so that a swarm does not reconnect in lockstep. The job in hand
    is left to its lease: its transaction rolled back with the connection, and it is claimed
    again once the lease expires. A first connection that fails raises at once (a wrong DSN is
    not an outage).

    >>> def send(job, conn):  # doctest: +SKIP
    ...     conn.execute("INSERT INTO sent (job_id, email) VALUES (%s, %s)", (job.id, job.payload["to"]))
    >>> Worker(dsn, "emails", send, batch=10).run()  # doctest: +SKIP
    """

    def __init__(
        self,
        dsn: str,
        queue: str,
        handler: Callable[[Job, psycopg.Connection], Any],
        *,
        name: str | None = None,
        batch: int = 1,
        lease: float | timedelta = 60.0,
        poll_interval: float = 1.0,
        reconnect_cap: float = 10.0,
    ):
        self.dsn = dsn
        self.queue = queue
        self.handler = handler
        self.name = name or default_holder()
        self.batch = batch
        self.lease = _calls.seconds(lease)
        self.poll_interval = poll_interval
        self.reconnect_cap = reconnect_cap
        self.processed = 0
        self.reconnects = 0
        self._stopping = threading.Event()

    def stop(self) -> None:
        """Ask the loop to finish the job in hand and return."""
        self._stopping.set()

    def run(self, *, max_jobs: int | None = None, exit_when_idle: bool = False) -> int:
        """Work until stopped (or ``max_jobs`` done, or the queue is empty with ``exit_when_idle``).
        Returns the number of jobs processed."""
        restore = self._install_signal_handlers()
        self._connected_once = False
        failures = 0
        try:
            while not self._stopping.is_set():
                try:
                    self._session(max_jobs, exit_when_idle)
                    break
                except psycopg.OperationalError as exc:
                    if not self._connected_once:
                        raise
                    if self._connected:
                        failures = 0  # this session had connected: a new outage starts
                    pause = backoff(failures, base=0.1, cap=self.reconnect_cap)
                    failures += 1
                    self.reconnects += 1
                    log.warning(
                        "connection lost (%s); reconnecting in %.2f s (attempt %d)",
                        str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                        pause,
                        failures,
                    )
                    self._stopping.wait(pause)
        finally:
            restore()
        return self.processed

    def _session(self, max_jobs: int | None, exit_when_idle: bool) -> None:
        """One connected stretch of the loop; raises OperationalError when a connection is lost."""
        self._connected = False
        app = f"pglockkit worker {self.queue}"
        with (
            connect(self.dsn, autocommit=True, application_name=app) as conn,
            connect(self.dsn, autocommit=True, application_name=f"{app} listen") as listener,
        ):
            listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
            heartbeat = _Heartbeat(self.dsn, self.lease, f"{app} heartbeat")
            self._connected = self._connected_once = True
            ahead: list[Job] = []  # claimed in the transaction that completed the previous job
            try:
                while not self._stopping.is_set():
                    if max_jobs is not None and self.processed >= max_jobs:
                        return
                    jobs, ahead = ahead, []
                    if not jobs:
                        want = self._want(max_jobs, 0)
                        jobs = claim(conn, self.queue, self.name, lease=self.lease, batch=want)
                    if not jobs:
                        if exit_when_idle:
                            return
                        self._wait(listener)
                        continue
                    heartbeat.watch(jobs)
                    ahead = self._work(conn, jobs, heartbeat, max_jobs)
                    heartbeat.watch(ahead)
            finally:
                if ahead and not conn.closed:  # stopped with jobs claimed ahead: give them back
                    with contextlib.suppress(psycopg.Error):
                        for job in ahead:
                            release(conn, job)
                heartbeat.close()

    def _want(self, max_jobs: int | None, in_hand: int) -> int:
        """How many jobs to claim next, with ``in_hand`` jobs not yet counted as processed."""
        if self._stopping.is_set():
            return 0
        if max_jobs is None:
            return self.batch
        return max(0, min(self.batch, max_jobs - self.processed - in_hand))

    def _work(
        self, conn: psycopg.Connection, jobs: list[Job], heartbeat: _Heartbeat, max_jobs: int | None
    ) -> list[Job]:
        """Run a claimed batch; returns the jobs claimed ahead with the last one's completion."""
        for i, job in enumerate(jobs):
            if self._stopping.is_set():
                for rest in jobs[i:]:
                    release(conn, rest)
                log.info("stopping: gave back %d unstarted job(s)", len(jobs) - i)
                return []
            last = i == len(jobs) - 1
            if job.id in heartbeat.lost:
                log.warning("job %s: claim lost before it started (reclaimed or cancelled); skipped", job.id)
            elif last:
                return self._run_one(conn, job, heartbeat, claim_next=self._want(max_jobs, 1))
            else:
                self._run_one(conn, job, heartbeat)
            heartbeat.watch(jobs[i + 1 :])  # finished: stop extending it
        return []

    def _run_one(
        self, conn: psycopg.Connection, job: Job, heartbeat: _Heartbeat, claim_next: int = 0
    ) -> list[Job]:
        """Run the handler and complete the job in one transaction. With ``claim_next``, the next
        jobs are claimed in that same transaction too, so that a job costs one commit, not two."""
        started = time.monotonic()
        ahead: list[Job] = []
        try:
            with conn.transaction():
                self.handler(job, conn)
                if not complete(conn, job):
                    raise _StaleClaim()
                if claim_next and not self._stopping.is_set():
                    ahead = claim(conn, self.queue, self.name, lease=self.lease, batch=claim_next)
        except _StaleClaim:
            log.warning(
                "job %s: claim %s is stale (reclaimed or cancelled); its writes were rolled back",
                job.id,
                job.token,
            )
            return []
        except Exception as exc:
            if conn.closed:
                raise  # the connection is gone, and the attempt with it: the lease hands the job back
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            status = fail(conn, job, error)
            log.info(
                "job %s failed (attempt %d/%d): %s -> %s",
                job.id,
                job.attempt,
                job.max_attempts,
                error,
                status,
            )
            self.processed += 1
            return []
        self.processed += 1
        log.info(
            "job %s done in %.1f ms (attempt %d)", job.id, (time.monotonic() - started) * 1000, job.attempt
        )
        return ahead

    def _wait(self, listener: psycopg.Connection) -> None:
        # Any notification (for any queue) or the poll interval ends the wait; the claim decides.
        for _ in listener.notifies(timeout=self.poll_interval, stop_after=1):
            pass

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


class _StaleClaim(Exception):
    pass
