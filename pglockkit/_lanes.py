"""What a worker lane does, written once for ``pglockkit.Worker`` (threads) and
``pglockkit.aio.Worker`` (asyncio).

A worker process runs ``concurrency`` lanes. A lane holds one connection and runs jobs one after
another on it; ``Lane.drain`` is a generator that decides every step and yields the I/O it needs
(``Pipeline``: statements sent in one round trip; ``Handle``: run the handler on a job). The
sync and async drivers perform that I/O and send the result back, so both workers share one
definition of group commit.

Group commit, exactly once (``handler(job, conn)``)
    Jobs that run one after another on a lane share one transaction: ``SAVEPOINT`` before each
    job; after it, ``complete_job`` (or, if the handler raised, ``ROLLBACK TO SAVEPOINT`` and
    ``fail_job``) pipelined with the next job's savepoint and, when the lane has no job left in
    hand, the next claim; one ``COMMIT`` per group. ``complete_job`` locks the job's row until
    the group commits, so no other worker can reclaim or cancel the job meanwhile; a completion
    that finds its claim stale (reclaimed after its lease expired, cancelled) rolls back to the
    job's savepoint, so its writes are not committed. A crash or a lost connection before the
    commit loses the group's writes and completions together: its jobs run again after their
    lease. A group ends after ``group`` jobs or, at the next job boundary, ``group_time``
    seconds after it began, or when the lane has no job left.

At least once (``handler(job)``, no connection)
    The handler runs outside any transaction; its completions (and failures) are buffered and
    recorded with the next claim in one transaction per group. A crash before that commit runs
    the group's jobs again after their lease: their handlers' outside effects happen twice.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pglockkit import _calls
from pglockkit._calls import Call, Job

log = logging.getLogger("pglockkit.queue")

NOTIFY_CHANNEL = "pglockkit_jobs"
MAX_GROUP = 64  # a transaction's first 64 subtransactions are tracked cheaply by the server


@dataclass(frozen=True)
class Pipeline:
    """Send these statements in one round trip; the reply is ``(results, error)``."""

    calls: list[Call[Any]]


@dataclass(frozen=True)
class Handle:
    """Run the handler on ``job``; the reply is None, or the failure's text."""

    job: Job


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
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


def error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


@dataclass(frozen=True)
class Settings:
    """A worker's settings, checked once."""

    queue: str
    name: str
    concurrency: int
    batch: int
    group: int
    group_time: float
    lease: timedelta
    poll_interval: float
    reconnect_cap: float
    exactly_once: bool

    @classmethod
    def checked(
        cls,
        queue: str,
        name: str,
        *,
        concurrency: int,
        batch: int,
        group: int,
        group_time: float,
        lease: float | timedelta,
        poll_interval: float,
        reconnect_cap: float,
        exactly_once: bool,
    ) -> Settings:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        if not isinstance(batch, int) or not 1 <= batch <= 1000:
            raise ValueError(f"batch must be between 1 and 1000, got {batch!r}")
        if not isinstance(group, int) or not 1 <= group <= MAX_GROUP:
            raise ValueError(
                f"group must be between 1 and {MAX_GROUP} jobs, got {group!r} (a savepoint per job; "
                f"past {MAX_GROUP} the server tracks a transaction's subtransactions the slow way)"
            )
        if group_time < 0:
            raise ValueError(f"group_time must not be negative, got {group_time!r}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval!r}")
        return cls(
            queue,
            name,
            concurrency,
            batch,
            group,
            group_time,
            _calls.seconds(lease),
            poll_interval,
            reconnect_cap,
            exactly_once,
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

    def exhausted(self) -> bool:
        return self.max_jobs is not None and self.processed >= self.max_jobs


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


IDLE, STOPPED, SPENT = "idle", "stopped", "spent"


class Lane:
    """One lane's jobs in hand and its group commit; ``drain`` is driven by a worker."""

    def __init__(self, settings: Settings, watch: Watch, budget: Budget, stopping: Callable[[], bool]):
        self.s = settings
        self.watch = watch
        self.budget = budget
        self.stopping = stopping
        self.hand: deque[Job] = deque()  # claimed by committed transactions: ours
        self.tentative: list[Job] = []  # claimed in the open group: ours once it commits
        self.job_seconds = 0.0  # a moving average of this lane's handler time
        self.in_group = False

    # --- claims ---------------------------------------------------------------------------

    def _claim_size(self) -> int:
        """At most ``batch``, and no more than the lane expects to finish in one group time, so
        jobs do not wait in one lane's hand while other lanes and workers could run them."""
        if self.stopping():
            return 0
        n = self.s.batch
        if self.job_seconds > 0:
            n = min(n, max(1, int(max(self.s.group_time, 0.001) / self.job_seconds)))
        return self.budget.take(n)

    def _claim(self, n: int) -> Call[list[Job]]:
        return _calls.claim(self.s.queue, self.s.name, self.s.lease, n)

    def _claimed(self, jobs: list[Job], asked: int, *, tentative: bool) -> None:
        self.budget.give_back(asked - len(jobs))
        self.hand.extend(jobs)
        if tentative:
            self.tentative.extend(jobs)
        self.watch.add(jobs)

    def abandon_group(self) -> None:
        """The open group rolled back (or its connection is gone): forget what it claimed."""
        for job in self.tentative:
            if job in self.hand:
                self.hand.remove(job)
        self.budget.give_back(len(self.tentative))
        self.watch.remove(self.tentative)
        self.tentative = []
        self.in_group = False

    def forget(self) -> None:
        """The lane stops with jobs in hand it could not give back: their leases hand them back."""
        self.abandon_group()
        self.watch.remove(list(self.hand))
        self.budget.give_back(len(self.hand))
        self.hand.clear()

    def _timed(self, seconds: float) -> None:
        self.job_seconds = seconds if self.job_seconds == 0 else 0.8 * self.job_seconds + 0.2 * seconds

    # --- the loop -------------------------------------------------------------------------

    def drain(self) -> Generator[Pipeline | Handle, Any, str]:
        """Claim and run groups until the queue has no job for this lane (IDLE), the worker
        stops (STOPPED: unstarted jobs are given back) or ``max_jobs`` is reached (SPENT)."""
        while True:
            if self.stopping():
                yield from self._give_back()
                return STOPPED
            if not self.hand:
                n = self._claim_size()
                if n == 0:  # stopping, or max_jobs reached or reserved by other lanes
                    return STOPPED if self.stopping() else SPENT
                results, error = yield Pipeline([self._claim(n)])
                if error is not None:
                    self.budget.give_back(n)
                    raise error
                self._claimed(results[0], n, tentative=False)
                if not self.hand:
                    return IDLE
            group = self._group() if self.s.exactly_once else self._buffered_group()
            if (yield from group) == IDLE:
                return IDLE

    def _give_back(self) -> Generator[Pipeline, Any, None]:
        jobs = list(self.hand)
        if jobs:
            _, error = yield Pipeline([_calls.release(job) for job in jobs])
            if error is not None:
                log.warning("could not give back %d unstarted job(s): %s", len(jobs), error)
            else:
                log.info("stopping: gave back %d unstarted job(s)", len(jobs))
            self.watch.remove(jobs)
            self.budget.give_back(len(jobs))
            self.hand.clear()

    def _closing(self, started: float, finished: int) -> bool:
        return finished >= self.s.group or time.monotonic() - started >= self.s.group_time or self.stopping()

    def _group(self) -> Generator[Pipeline | Handle, Any, str | None]:
        """One group of exactly-once jobs in one transaction; returns IDLE when the claim riding
        on its last job found the queue empty."""
        started = time.monotonic()
        sp = 1
        finished = 0
        _, error = yield Pipeline([_calls.statement("BEGIN"), _calls.savepoint(sp)])
        if error is not None:
            raise error
        self.in_group = True
        empty = False
        while True:
            job = self.hand.popleft()
            t0 = time.monotonic()
            failure = yield Handle(job)
            self._timed(time.monotonic() - t0)
            finished += 1
            closing = self._closing(started, finished)
            claim_n = 0 if self.hand else self._claim_size()
            outcome_calls = [_calls.rollback_to(sp), _calls.fail(job, failure, None)] if failure else [
                _calls.complete(job)
            ]
            # The claim gets a savepoint of its own, before the next job's: a claim that fails is
            # undone alone, and the next job's rollback does not undo the claim.
            claim_sp, next_sp = (sp + 1, sp + 2) if claim_n else (0, sp + 1)
            calls = [*outcome_calls]
            if claim_n:
                calls += [_calls.savepoint(claim_sp), self._claim(claim_n)]
            calls.append(_calls.savepoint(next_sp))
            results, error = yield Pipeline(calls)
            if len(results) < len(outcome_calls):  # the job's own statements failed
                self.budget.give_back(claim_n)
                raise error or RuntimeError("pipeline returned no result")
            outcome = results[len(outcome_calls) - 1]
            self.watch.remove([job])
            claimed: list[Job] = []
            if not failure and outcome is False:
                log.warning(
                    "job %s: claim %s is stale (reclaimed or cancelled); its writes were rolled back",
                    job.id,
                    job.token,
                )
                # Back to the job's savepoint: its writes, and the claim that rode with it, undone.
                _, error = yield Pipeline([_calls.rollback_to(sp), _calls.savepoint(next_sp)])
                if error is not None:
                    raise error
            elif claim_n and error is not None:  # the claim failed (a deadlock, say): keep the job's outcome
                log.warning("claim after job %s failed, retried later: %s", job.id, error)
                _, error = yield Pipeline([_calls.rollback_to(claim_sp), _calls.savepoint(next_sp)])
                if error is not None:
                    raise error
            elif error is not None:
                raise error
            elif claim_n:
                claimed = results[len(outcome_calls) + 1]
                empty = len(claimed) < claim_n
            self.budget.give_back(claim_n - len(claimed))
            self.hand.extend(claimed)
            self.tentative.extend(claimed)
            self.watch.add(claimed)
            self._log_outcome(job, failure, outcome, t0)
            sp = next_sp
            if closing or not self.hand:
                _, error = yield Pipeline([_calls.statement("COMMIT")])
                if error is not None:
                    raise error
                self.in_group = False
                self.tentative = []
                self.budget.spend(finished)
                return IDLE if empty and not self.hand else None

    def _buffered_group(self) -> Generator[Pipeline | Handle, Any, str | None]:
        """At-least-once jobs: handlers outside any transaction, their outcomes recorded with the
        next claim in one transaction."""
        started = time.monotonic()
        done: list[Job] = []
        failed: list[tuple[Job, str]] = []
        while True:
            job = self.hand.popleft()
            t0 = time.monotonic()
            failure = yield Handle(job)
            self._timed(time.monotonic() - t0)
            if failure:
                failed.append((job, failure))
            else:
                done.append(job)
            if not (self._closing(started, len(done) + len(failed)) or not self.hand):
                continue
            claim_n = 0 if self.hand else self._claim_size()
            calls: list[Call[Any]] = [_calls.statement("BEGIN")]
            if done:
                calls.append(_calls.complete_many(done))
            calls += [_calls.fail(j, f, None) for j, f in failed]
            n_outcomes = len(calls)
            if claim_n:
                calls += [_calls.savepoint(1), self._claim(claim_n)]
            calls.append(_calls.statement("COMMIT"))
            results, error = yield Pipeline(calls)
            claimed: list[Job] = []
            if error is not None:
                if len(results) < n_outcomes + 1:  # the outcomes themselves failed
                    self.budget.give_back(claim_n)
                    raise error
                log.warning("claim after %d job(s) failed, retried later: %s", len(done) + len(failed), error)
                _, error = yield Pipeline([_calls.rollback_to(1), _calls.statement("COMMIT")])
                if error is not None:
                    raise error
            elif claim_n:
                claimed = results[-2]
            if done and results[1] < len(done):
                log.warning(
                    "%d of %d completions were stale (reclaimed or cancelled)",
                    len(done) - results[1],
                    len(done),
                )
            self.budget.give_back(claim_n - len(claimed))
            self._claimed(claimed, len(claimed), tentative=False)
            self.watch.remove(done + [j for j, _ in failed])
            self.budget.spend(len(done) + len(failed))
            for j, f in failed:
                self._log_outcome(j, f, None, started)
            return IDLE if claim_n and len(claimed) < claim_n and not self.hand else None

    def _log_outcome(self, job: Job, failure: str | None, outcome: Any, started: float) -> None:
        if failure:
            log.info(
                "job %s failed (attempt %d/%d): %s -> %s",
                job.id,
                job.attempt,
                job.max_attempts,
                failure,
                outcome,
            )
        elif log.isEnabledFor(logging.DEBUG):
            log.debug(
                "job %s done in %.1f ms (attempt %d)",
                job.id,
                (time.monotonic() - started) * 1000,
                job.attempt,
            )
