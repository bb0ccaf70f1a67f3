"""``pglockkit demo``: a swarm serialized behind one advisory lock, measured live on a real server.

A swarm of agents (threads, one connection each) does units of simulated work, a sleep plus one
``INSERT``, coordinated in three ways, for each agent count of a sweep:

1. ``global``: every unit under ONE advisory lock, ``xact_lock('demo', 'global')``;
2. ``queue``: the units are jobs, claimed with ``claim_job`` (``FOR UPDATE SKIP LOCKED``);
3. ``sharded``: a lock per tenant, ``xact_lock('demo', 'tenant:' || t)``, plus one shared refresh
   that exactly one agent does, behind a lease (``acquire_lease`` / ``check_fence``).

A sampler thread calls ``pglockkit.sample()`` every ``sample_every`` seconds and reads
``pglockkit.advisory_locks`` live; after each step ``contention_report`` is read for the step's
window. Every number printed is measured in this run. The demo works in schema ``pglockkit_demo``
(dropped at start and at the end), a queue named per run (its jobs are pruned at the end) and the
lease ``demo:shared-refresh``; samples stay in the contention history like any other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import psycopg
from psycopg import sql

from pglockkit import leases, locks, queue
from pglockkit.connection import connect
from pglockkit.errors import LockTimeout, StaleToken
from pglockkit.keys import lock_key

NAMESPACE = "demo"
SCHEMA = "pglockkit_demo"
LEASE = "demo:shared-refresh"
GLOBAL_RESOURCE = "global"
DESIGNS = ("global", "queue", "sharded")
TITLES = {"global": "global lock", "queue": "queue (SKIP LOCKED)", "sharded": "sharded keys + lease"}
PHASES = {
    "global": "every unit under ONE advisory lock: xact_lock('demo', 'global'), work, commit",
    "queue": "units are jobs: claim_job (FOR UPDATE SKIP LOCKED), work, complete_job in that transaction",
    "sharded": "xact_lock('demo', 'tenant:' || t) per unit (t random); a shared refresh (a unit too), "
    "done by one agent only, behind a lease",
}
APPLICATION_NAME = "pglockkit demo"

SETUP = sql.SQL("""
DROP SCHEMA IF EXISTS {schema} CASCADE;
CREATE SCHEMA {schema};
CREATE TABLE {schema}.units (step integer NOT NULL, agent integer NOT NULL, tenant integer,
                             done_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {schema}.refreshes (step integer NOT NULL, holder text NOT NULL, token bigint NOT NULL,
                                 done_at timestamptz NOT NULL DEFAULT clock_timestamp());
""").format(schema=sql.Identifier(SCHEMA))
DROP = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA))
INSERT_UNIT = sql.SQL("INSERT INTO {}.units (step, agent, tenant) VALUES (%s, %s, %s)").format(
    sql.Identifier(SCHEMA)
)
INSERT_REFRESH = sql.SQL("INSERT INTO {}.refreshes (step, holder, token) VALUES (%s, %s, %s)").format(
    sql.Identifier(SCHEMA)
)
LIVE_LOCKS = """
SELECT key, count(*) FILTER (WHERE granted) AS holding, count(*) FILTER (WHERE NOT granted) AS waiting,
       array_agg(pid ORDER BY pid) FILTER (WHERE granted) AS holder_pids,
       extract(epoch FROM max(wait_time))::float8 AS longest_wait_s, count(*) OVER () AS keys
  FROM pglockkit.advisory_locks WHERE namespace = %s
 GROUP BY key ORDER BY waiting DESC, holding DESC LIMIT 1
"""
REPORT = """
SELECT key, samples, samples_with_waiters, max_waiters, avg_waiters::float8,
       extract(epoch FROM longest_wait)::float8, namespace_sessions::float8, namespace_parallelism::float8
  FROM pglockkit.contention_report(clock_timestamp() - %s::timestamptz) WHERE namespace = %s
"""


class NotInstalled(RuntimeError):
    """The target database lacks pglockkit (or its contention history)."""


# ---------------------------------------------------------------------------------------------
# Settings and results
# ---------------------------------------------------------------------------------------------


@dataclass
class Settings:
    """What to run. ``steps`` are the agent counts of the sweep; 1 is always measured first."""

    agents: int = 16
    steps: list[int] = field(default_factory=lambda: default_steps(16))
    seconds: float = 3.0
    work_ms: float = 50.0
    tenants: int = 64
    sample_every: float = 0.25
    refresh_every: float = 0.5
    lease_ttl: float = 5.0


def default_steps(agents: int) -> list[int]:
    """1, 2, 4, ... below ``agents``, then ``agents``."""
    steps, n = [], 1
    while n < agents:
        steps.append(n)
        n *= 2
    return [*steps, agents]


@dataclass
class Live:
    """The busiest ``demo`` key in ``pglockkit.advisory_locks``, read live during a step."""

    at_s: float
    key: int
    resource: str
    holding: int
    waiting: int
    holder_pids: list[int]
    longest_wait_s: float | None
    keys: int


@dataclass
class Report:
    """``contention_report`` for namespace ``demo`` over a step's window."""

    keys: int = 0
    top_key: int | None = None
    top_resource: str | None = None
    samples: int = 0
    samples_with_waiters: int = 0
    max_waiters: int = 0
    avg_waiters: float = 0.0
    longest_wait_s: float | None = None
    sessions: float | None = None
    parallelism: float | None = None


@dataclass
class Step:
    design: str
    agents: int
    seconds: float
    jobs: int
    jobs_s: float
    longest_wait_s: float
    rows_written: int
    parallelism: float = 0.0
    samples_taken: int = 0
    live: Live | None = None
    report: Report = field(default_factory=Report)
    refreshes: int = 0
    refreshers: list[str] = field(default_factory=list)
    queue_ran_dry: bool = False


# ---------------------------------------------------------------------------------------------
# Argument types (used by the CLI)
# ---------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def agent_counts(text: str) -> list[int]:
    """'1,2,4,8,16' -> [1, 2, 4, 8, 16]; every count at least 1."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated agent counts, got {text!r}")
    return sorted({positive_int(p) for p in parts})


def plot_path(text: str) -> Path:
    """--plot FILE.png: fails at once, before any work, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError(
            "--plot needs matplotlib, which is not installed: pip install 'pglockkit[plot]'"
        ) from None
    return Path(text)


# ---------------------------------------------------------------------------------------------
# One step: N agents of one design for `seconds`
# ---------------------------------------------------------------------------------------------


class _Sampler(threading.Thread):
    """Calls sample() and reads advisory_locks every ``every`` seconds until stopped."""

    def __init__(
        self, conn: psycopg.Connection, every: float, names: dict[int, str], started: float, deadline: float
    ):
        super().__init__(name="pglockkit-demo-sampler", daemon=True)
        self.conn, self.every, self.names = conn, every, names
        self.started, self.deadline = started, deadline
        self.stop = threading.Event()
        self.taken = 0
        self.latest: Live | None = None
        self.busiest: Live | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        # Samples fall inside the step only (the first half an interval in, none after the
        # deadline), so that the idle edges of a step do not dilute the report.
        delay = self.every / 2
        try:
            while not self.stop.wait(delay) and time.monotonic() < self.deadline:
                delay = self.every
                self.conn.execute("SELECT pglockkit.sample()")
                self.taken += 1
                row = self.conn.execute(LIVE_LOCKS, (NAMESPACE,)).fetchone()
                live = None
                if row is not None:
                    key, holding, waiting, pids, longest, keys = row
                    name = self.names.get(key, str(key))
                    at = time.monotonic() - self.started
                    live = Live(round(at, 2), key, name, holding, waiting, pids or [], longest, keys)
                    if self.busiest is None or _rank(live) > _rank(self.busiest):
                        self.busiest = live
                self.latest = live
        except BaseException as exc:  # reported by the step
            self.error = exc


def _rank(live: Live) -> tuple[int, float]:
    return live.waiting, live.longest_wait_s or 0.0


Unit = Callable[[psycopg.Connection, int, float], float | None]
"""(conn, agent, deadline) -> seconds waited for the lock or claim; None: stop (step over, or dry)."""


def _run_step(
    conns: list[psycopg.Connection],
    sampler_conn: psycopg.Connection,
    n: int,
    settings: Settings,
    unit: Unit,
    names: dict[int, str],
    progress: Callable[[float, int, Live | None], None],
) -> tuple[int, float, _Sampler, Any]:
    """Run ``unit`` in a loop on ``n`` agents until the deadline; returns (jobs done by the
    deadline, longest wait, the sampler, the server time at the start)."""
    done = [0] * n
    waits = [0.0] * n
    errors: list[BaseException] = []
    go = threading.Event()
    clock: dict[str, float] = {}

    def agent(i: int) -> None:
        go.wait()
        deadline = clock["deadline"]
        try:
            while time.monotonic() < deadline:
                waited = unit(conns[i], i, deadline)
                if waited is None:
                    return
                waits[i] = max(waits[i], waited)
                if time.monotonic() <= deadline:
                    done[i] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=agent, args=(i,), name=f"demo-agent-{i}", daemon=True) for i in range(n)
    ]
    for t in threads:
        t.start()
    server_start = sampler_conn.execute("SELECT clock_timestamp()").fetchone()[0]
    started = time.monotonic()
    clock["deadline"] = started + settings.seconds
    sampler = _Sampler(sampler_conn, settings.sample_every, names, started, clock["deadline"])
    go.set()
    sampler.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
            progress(min(time.monotonic() - started, settings.seconds), sum(done), sampler.latest)
    sampler.stop.set()
    sampler.join()
    if errors:
        raise errors[0]
    if sampler.error is not None:
        raise sampler.error
    return sum(done), max(waits), sampler, server_start


# ---------------------------------------------------------------------------------------------
# The three designs
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _report_text(step: Step) -> str:
    r = step.report
    if r.keys == 0:
        return f"no `demo` lock in {step.samples_taken} samples"
    if r.keys == 1:
        return (
            f"`{r.top_resource}`: waiters in {r.samples_with_waiters}/{r.samples} samples, "
            f"max {r.max_waiters}, avg {r.avg_waiters:.1f}; parallelism {r.parallelism:.2f}"
        )
    waits = f"at most {r.max_waiters} waiting on one" if r.max_waiters else "no waiter"
    return f"{r.keys} keys, {waits}; parallelism {r.parallelism:.2f}"


def summary(steps: list[Step], settings: Settings) -> str:
    """The markdown tables: throughput by agent count, then each design at the largest count."""
    counts = sorted({s.agents for s in steps})
    at = {(s.design, s.agents): s for s in steps}
    top = counts[-1]
    lines = [
        "",
        "Throughput (jobs/s) and effective parallelism (jobs/s / the same design's 1-agent jobs/s):",
        "",
        "| agents | " + " | ".join(TITLES[d] for d in DESIGNS) + " |",
        "|--:|" + "--:|" * len(DESIGNS),
    ]
    for n in counts:
        cells = [f"{at[d, n].jobs_s:,.1f} (x{at[d, n].parallelism:.2f})" for d in DESIGNS if (d, n) in at]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"At {top} agents ({settings.seconds:g} s per step; a unit is {settings.work_ms:g} ms of work "
        "and one INSERT):",
        "",
        "| design | jobs/s | parallelism | longest wait | contention_report: keys, waiters, parallelism |",
        "|---|--:|--:|--:|---|",
    ]
    for d in DESIGNS:
        s = at.get((d, top))
        if s is not None:
            lines.append(
                f"| {TITLES[d]} | {s.jobs_s:,.1f} | {s.parallelism:.2f} | {_ms(s.longest_wait_s)} "
                f"| {_report_text(s)} |"
            )
    g, sh = at.get(("global", top)), at.get(("sharded", top))
    lines.append("")
    if g is not None and g.live is not None:
        live = g.live
        lines.append(
            f"pglockkit.advisory_locks, read live {live.at_s:.1f} s into the global-lock step at {top} "
            "agents: "
            f"`{live.resource}` {live.holding} holding (pid {', '.join(map(str, live.holder_pids))}), "
            f"{live.waiting} waiting, longest wait {_ms(live.longest_wait_s)}."
        )
    if sh is not None:
        who = ", ".join(sh.refreshers) or "nobody"
        lines.append(
            f"Shared refresh at {top} agents: {sh.refreshes} refreshes behind lease `{LEASE}`, "
            f"done by {len(sh.refreshers)} agent(s) ({who}); acquire_lease gave the others NULL at once."
        )
    return "\n".join(lines)


def environment(dsn_label: str, server: str) -> dict[str, Any]:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "server": f"PostgreSQL {server}",
        "target": dsn_label,
        "cores": cores,
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
    }


def plot(steps: list[Step], path: Path) -> None:
    """Throughput against agents for the three designs, with each design's ideal (1-agent x N)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for design, style in zip(DESIGNS, ("o-", "s-", "^-"), strict=True):
        mine = sorted((s for s in steps if s.design == design), key=lambda s: s.agents)
        ax.plot([s.agents for s in mine], [s.jobs_s for s in mine], style, label=TITLES[design])
    base = [s for s in steps if s.design == "queue"]
    one = next((s.jobs_s for s in base if s.agents == 1), None)
    if one:
        counts = sorted({s.agents for s in steps})
        ax.plot(
            counts, [one * n for n in counts], ":", color="grey", label="ideal (queue's 1-agent rate x N)"
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({s.agents for s in steps}), [str(n) for n in sorted({s.agents for s in steps})])
    ax.set_xlabel("agents")
    ax.set_ylabel("jobs/s")
    ax.set_title("pglockkit demo: one global lock vs SKIP LOCKED queue vs sharded keys")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args: argparse.Namespace, dsn: str, dsn_label: str, out: TextIO = sys.stdout) -> int:
    """Run the demo from parsed ``pglockkit demo`` arguments on ``dsn``."""
    steps = args.steps or default_steps(args.agents)
    settings = Settings(args.agents, steps, args.seconds, args.work_ms, args.tenants)
    demo = Demo(dsn, settings, out)
    counts = sorted({1, *steps})
    expected = len(counts) * len(DESIGNS) * settings.seconds
    out.write(
        f"pglockkit demo: {settings.agents} agents, steps {','.join(map(str, counts))}, "
        f"{settings.seconds:g} s per step (about {expected:.0f} s); a unit of work = "
        f"{settings.work_ms:g} ms sleep + one INSERT\n"
    )
    try:
        measured = demo.run()
    except NotInstalled as exc:
        print(f"pglockkit demo: error: {exc}", file=sys.stderr)
        return 1
    env = environment(dsn_label, demo.server)
    out.write(summary(measured, settings) + "\n")
    out.write(
        f"\nMeasured {env['date']} on {env['server']} ({dsn_label}), {env['cores']} cores, "
        f"{env['platform']}.\n"
    )
    if args.plot:
        plot(measured, args.plot)
        out.write(f"wrote {args.plot}\n")
    if args.json:
        data = {"environment": env, "settings": asdict(settings), "steps": [asdict(s) for s in measured]}
        Path(args.json).write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        out.write(f"wrote {args.json}\n")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pglockkit demo``."""
    parser.add_argument(
        "--dsn", help="run on this database (pglockkit installed) instead of the embedded server"
    )
    parser.add_argument(
        "--data", metavar="DIR", help="the embedded server's data directory (default: the user data dir)"
    )
    parser.add_argument(
        "--agents", type=positive_int, default=16, metavar="N", help="swarm size (default %(default)s)"
    )
    parser.add_argument(
        "--steps",
        type=agent_counts,
        metavar="N,N,...",
        help="agent counts to sweep, each at most --agents (default 1,2,4,... up to --agents); "
        "1 is always measured: it is the baseline of the parallelism",
    )
    parser.add_argument(
        "--seconds", type=positive_float, default=3.0, help="length of each step (default %(default)g)"
    )
    parser.add_argument(
        "--work-ms",
        type=positive_float,
        default=50.0,
        metavar="MS",
        help="simulated work per unit, a sleep (default %(default)g)",
    )
    parser.add_argument(
        "--tenants", type=positive_int, default=64, help="tenants of the sharded design (default %(default)s)"
    )
    parser.add_argument("--plot", type=plot_path, metavar="FILE.png", help="draw jobs/s against agents")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")
