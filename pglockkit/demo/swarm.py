"""The swarm: connections, the three designs' units of work, and the sweep of steps."""

from __future__ import annotations

import math
import random
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TextIO

import psycopg
from psycopg import sql

from pglockkit import leases, locks, queue
from pglockkit.connection import connect
from pglockkit.demo.measure import Unit, _run_step
from pglockkit.demo.model import (
    APPLICATION_NAME,
    DESIGNS,
    DROP,
    GLOBAL_RESOURCE,
    INSERT_REFRESH,
    INSERT_UNIT,
    LEASE,
    NAMESPACE,
    PHASES,
    REPORT,
    SCHEMA,
    SETUP,
    TITLES,
    Live,
    NotInstalled,
    Report,
    Settings,
    Step,
)
from pglockkit.errors import LockTimeout, StaleToken
from pglockkit.keys import lock_key


class Demo:
    """The run: connections, names, and the steps measured so far."""

    def __init__(self, dsn: str, settings: Settings, out: TextIO = sys.stdout):
        self.dsn, self.settings, self.out = dsn, settings, out
        self.run_id = uuid.uuid4().hex[:8]
        self.queue = f"demo-{self.run_id}"
        self.steps: list[Step] = []
        self.step_no = 0
        self.tty = out.isatty()
        self.work_s = settings.work_ms / 1000
        self.names: dict[int, str] = {}  # lock key -> 'demo/resource', for the reports
        self.server = ""

    # -- setup and cleanup ------------------------------------------------------------------

    def _setup(self, conn: psycopg.Connection) -> None:
        found = conn.execute(
            "SELECT EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'pglockkit' AND p.proname = 'contention_report')"
        ).fetchone()[0]
        if not found:
            raise NotInstalled(
                "pglockkit (with contention_report) is not installed in this database: "
                "run `pglockkit install` with the same --dsn first"
            )
        known = {r["name"] for r in locks.namespaces(conn)}
        description = None if NAMESPACE in known else "pglockkit demo: a swarm behind locks, a queue, a lease"
        ns_id = locks.register_namespace(conn, NAMESPACE, description=description)
        conn.execute(SETUP)
        self.names = {lock_key(ns_id, GLOBAL_RESOURCE): f"{NAMESPACE}/{GLOBAL_RESOURCE}"}
        for t in range(self.settings.tenants):
            self.names[lock_key(ns_id, f"tenant:{t}")] = f"{NAMESPACE}/tenant:{t}"

    def _warm_up(self, conns: list[psycopg.Connection], conn: psycopg.Connection) -> None:
        """Each connection's first calls plan and compile the functions: not part of any step."""
        queue.enqueue_many(conn, self.queue, [{"tenant": 0}] * len(conns))
        for i, c in enumerate(conns):
            for job in queue.claim(c, self.queue, f"demo-{self.run_id}-warm-up", lease=60):
                queue.complete(c, job)
            with c.transaction():
                locks.xact_lock(c, NAMESPACE, GLOBAL_RESOURCE, timeout=10)
            token = leases.acquire_lease(c, LEASE, f"demo-{self.run_id}-warm-up-{i}", self.settings.lease_ttl)
            if token is not None:
                with c.transaction():
                    leases.check_fence(c, LEASE, token)
                leases.release_lease(c, LEASE, f"demo-{self.run_id}-warm-up-{i}", token)

    def _cleanup(self, conn: psycopg.Connection) -> None:
        conn.execute(DROP)
        conn.execute("SELECT pglockkit.prune_jobs('0 seconds', %s, true)", (self.queue,))

    # -- units of work ----------------------------------------------------------------------

    def _lock_timeout(self, deadline: float) -> float:
        # A wait still going at the deadline would only finish a unit that no longer counts.
        return max(deadline - time.monotonic(), 0.0) + 0.1

    def _global_unit(self, step: int) -> Unit:
        def unit(conn: psycopg.Connection, agent: int, deadline: float) -> float | None:
            t0 = time.monotonic()
            try:
                with conn.transaction():
                    locks.xact_lock(conn, NAMESPACE, GLOBAL_RESOURCE, timeout=self._lock_timeout(deadline))
                    waited = time.monotonic() - t0
                    time.sleep(self.work_s)
                    conn.execute(INSERT_UNIT, (step, agent, None))
            except LockTimeout:
                return None
            return waited

        return unit

    def _queue_unit(self, step: int, dry: list[bool]) -> Unit:
        def unit(conn: psycopg.Connection, agent: int, deadline: float) -> float | None:
            t0 = time.monotonic()
            jobs = queue.claim(conn, self.queue, f"demo-{self.run_id}-agent-{agent}", lease=60)
            waited = time.monotonic() - t0
            if not jobs:
                dry[0] = True
                return None
            job = jobs[0]
            with conn.transaction():
                time.sleep(self.work_s)
                conn.execute(INSERT_UNIT, (step, agent, job.payload["tenant"]))
                if not queue.complete(conn, job):
                    raise RuntimeError(f"complete_job({job.id}, {job.token}) refused a current claim")
            return waited

        return unit

    def _sharded_unit(self, step: int) -> tuple[Unit, Callable[[psycopg.Connection, int], None]]:
        tokens: dict[int, int | None] = {}
        next_try: dict[int, float] = {}
        rngs: dict[int, random.Random] = {}

        def holder(agent: int) -> str:
            return f"demo-{self.run_id}-agent-{agent}"

        def refresh(conn: psycopg.Connection, agent: int) -> bool:
            """True if this agent did the refresh (a unit of work like the others)."""
            # Every agent asks; acquire_lease gives a token to one only (the live holder asking
            # again renews it, same token). The holder computes outside any lock, then publishes
            # under check_fence, which rejects it if the lease changed hands meanwhile.
            token = leases.acquire_lease(conn, LEASE, holder(agent), self.settings.lease_ttl)
            tokens[agent] = token
            if token is None:
                return False
            time.sleep(self.work_s)
            try:
                with conn.transaction():
                    leases.check_fence(conn, LEASE, token)
                    conn.execute(INSERT_REFRESH, (step, holder(agent), token))
            except StaleToken:
                tokens[agent] = None
                return False
            return True

        def unit(conn: psycopg.Connection, agent: int, deadline: float) -> float | None:
            now = time.monotonic()
            if now >= next_try.get(agent, 0.0):
                next_try[agent] = now + self.settings.refresh_every
                if refresh(conn, agent):
                    return 0.0
            rng = rngs.setdefault(agent, random.Random(f"{self.run_id}-{step}-{agent}"))
            tenant = rng.randrange(self.settings.tenants)
            t0 = time.monotonic()
            try:
                with conn.transaction():
                    locks.xact_lock(conn, NAMESPACE, f"tenant:{tenant}", timeout=self._lock_timeout(deadline))
                    waited = time.monotonic() - t0
                    time.sleep(self.work_s)
                    conn.execute(INSERT_UNIT, (step, agent, tenant))
            except LockTimeout:
                return None
            return waited

        def finish(conn: psycopg.Connection, agent: int) -> None:
            token = tokens.get(agent)
            if token is not None:
                leases.release_lease(conn, LEASE, holder(agent), token)

        return unit, finish

    # -- running ----------------------------------------------------------------------------

    def _print(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _line(self, design: str, n: int, elapsed: float, jobs: int, live: Live | None) -> str:
        rate = jobs / elapsed if elapsed > 0 else 0.0
        base = next((s.jobs_s for s in self.steps if s.design == design and s.agents == 1), None)
        par = f"x{rate / base:5.2f}" if base else "x  -  "
        if live is None:
            locks_now = "no demo lock held"
        else:
            locks_now = f"{live.holding} holding, {live.waiting} waiting on {live.resource}"
        return (
            f"[{self.step_no:>2}/{self.total_steps}] {TITLES[design]:<21} {n:>3} agents "
            f"{elapsed:4.1f}s {jobs:>5} jobs {rate:7.1f}/s {par}  {locks_now}"
        )

    def _step(self, conns: list[psycopg.Connection], sampler_conn: psycopg.Connection, design: str, n: int):
        self.step_no += 1
        step_no, dry = self.step_no, [False]
        finish: Callable[[psycopg.Connection, int], None] | None = None
        job_ids: list[int] = []
        if design == "global":
            unit = self._global_unit(step_no)
        elif design == "queue":
            # Enough jobs for every agent to stay busy (work dominates each unit), plus slack.
            needed = math.ceil(n * self.settings.seconds / self.work_s * 1.5) + 20 * n
            job_ids = queue.enqueue_many(
                sampler_conn, self.queue, [{"tenant": i % self.settings.tenants} for i in range(needed)]
            )
            unit = self._queue_unit(step_no, dry)
        else:
            unit, finish = self._sharded_unit(step_no)

        def progress(elapsed: float, jobs: int, live: Live | None) -> None:
            if self.tty:  # cut to the terminal's width: a wrapped line would not redraw in place
                width = shutil.get_terminal_size().columns - 1
                self.out.write("\r\x1b[K" + self._line(design, n, elapsed, jobs, live)[:width])
                self.out.flush()

        jobs, longest, sampler, server_start = _run_step(
            conns, sampler_conn, n, self.settings, unit, self.names, progress
        )
        if finish is not None:
            for i in range(n):
                finish(conns[i], i)
        if job_ids:
            sampler_conn.execute(
                "SELECT count(*) FILTER (WHERE pglockkit.cancel_job(id)) FROM unnest(%s::bigint[]) AS id",
                (job_ids,),
            )
        step = Step(
            design,
            n,
            self.settings.seconds,
            jobs,
            jobs / self.settings.seconds,
            longest,
            self._rows(sampler_conn, "units", step_no) + self._rows(sampler_conn, "refreshes", step_no),
            samples_taken=sampler.taken,
            live=sampler.busiest,
            report=self._report(sampler_conn, server_start),
            queue_ran_dry=dry[0],
        )
        if design == "sharded":
            query = sql.SQL("SELECT count(*), array_agg(DISTINCT holder) FROM {}.refreshes WHERE step = %s")
            count, holders = sampler_conn.execute(query.format(sql.Identifier(SCHEMA)), (step_no,)).fetchone()
            step.refreshes, step.refreshers = count, holders or []
        base = next((s for s in self.steps if s.design == design and s.agents == 1), step)
        step.parallelism = step.jobs_s / base.jobs_s if base.jobs_s else 0.0
        self.steps.append(step)
        if self.tty:
            self.out.write("\r\x1b[K")
        self._print(self._line(design, n, self.settings.seconds, jobs, step.live))
        if step.queue_ran_dry:
            self._print("        (the queue ran dry: the jobs/s above is a lower bound)")

    def _rows(self, conn: psycopg.Connection, table: str, step: int) -> int:
        query = sql.SQL("SELECT count(*) FROM {}.{} WHERE step = %s").format(
            sql.Identifier(SCHEMA), sql.Identifier(table)
        )
        return conn.execute(query, (step,)).fetchone()[0]

    def _report(self, conn: psycopg.Connection, since: Any) -> Report:
        rows = conn.execute(REPORT, (since, NAMESPACE)).fetchall()
        if not rows:
            return Report()
        top = rows[0]  # ordered by samples with waiters, then max waiters
        return Report(
            keys=len(rows),
            top_key=top[0],
            top_resource=self.names.get(top[0], str(top[0])),
            samples=max(r[1] for r in rows),
            samples_with_waiters=top[2],
            max_waiters=max(r[3] for r in rows),
            avg_waiters=top[4],
            longest_wait_s=max((r[5] for r in rows if r[5] is not None), default=None),
            sessions=top[6],
            parallelism=top[7],
        )

    def run(self) -> list[Step]:
        s = self.settings
        counts = sorted({1, *s.steps})
        self.total_steps = len(counts) * len(DESIGNS)
        sampler_conn = connect(self.dsn, autocommit=True, application_name=f"{APPLICATION_NAME} sampler")
        conns: list[psycopg.Connection] = []
        try:
            self._setup(sampler_conn)
        except BaseException:
            sampler_conn.close()
            raise
        try:
            self.server = sampler_conn.execute("SHOW server_version").fetchone()[0]
            for i in range(s.agents):
                name = f"{APPLICATION_NAME} agent {i}"
                conns.append(connect(self.dsn, autocommit=True, application_name=name))
            self._warm_up(conns, sampler_conn)
            for number, design in enumerate(DESIGNS, 1):
                self._print()
                self._print(f"{number}. {TITLES[design]}: {PHASES[design]}")
                for n in counts:
                    self._step(conns, sampler_conn, design, n)
        finally:
            try:
                self._cleanup(sampler_conn)
            finally:
                for c in [*conns, sampler_conn]:
                    c.close()
        return self.steps
