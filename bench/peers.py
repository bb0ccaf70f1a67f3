"""pglockkit's queue next to procrastinate, pgqueuer, graphile-worker and pg-boss: the same no-op jobs
drained by each one's own workers, on the same server, in the same run.

What is measured
----------------
Each system gets a database of its own, created here (``<prefix>_<system>``) and set up by its
own tooling: ``pglockkit.install``, procrastinate's ``schema_manager.apply_schema()``, pgqueuer's
``Queries.install()``, graphile-worker's ``runMigrations()``, pg-boss's ``start()`` and
``createQueue()``. For each of its rounds, ``--workers`` worker processes of the system are
started, warmed up by a round of ``--warmup`` jobs that is not recorded, left idle waiting on LISTEN
(pg-boss polls), given the recorded round and stopped: one system's workers run at a time, so the
others' neither poll during its round nor hold connections (all eight entries' pools at 4 processes
each would need more than the default max_connections of 100). Its workers:

- pglockkit: ``pglockkit work --queue bench_peers --handler bench.peers:noop`` with its defaults
  (``handler(job, conn)``: exactly once, group commit); as a second entry the best setting
  documented in the README (``--batch 64 --group 64``); as a third, ``bench.peers:noop_job``
  (``handler(job)``: at least once, completions recorded in batches, as the peers do);
- procrastinate: ``App.run_worker(queues=['bench_peers'])`` with its defaults (concurrency 1), an
  ``async def`` no-op task;
- pgqueuer: ``QueueManager.run()`` with its defaults (batch 10, durable tables), an ``async def``
  no-op entrypoint, over a psycopg ``AsyncConnection``;
- graphile-worker (Node.js, ``bench/node/graphile_worker.mjs``): ``run()`` with a ``taskList`` of
  one ``async`` no-op task and its defaults (concurrency 1, a pool of 10, a job fetched and
  completed at a time); as a second entry, "graphile-worker fast", concurrency 10 (the CLI's
  ``--jobs 10``), else the same; as a third, "graphile-worker batched", the settings of its
  performance page (worker.graphile.org/docs/performance), with which it reports its highest
  rates: concurrency 24, a pool of 25, ``localQueue: {size: 500}`` (the pool fetches and locks 500
  jobs at a time and hands them out), ``completeJobBatchDelay: 0, failJobBatchDelay: 0``
  (completions batched: a crash may run more done jobs again). Its logger prints warnings and
  errors only (its default writes a line per job; the Python peers log at WARNING);
- pg-boss (Node.js, ``bench/node/pgboss_worker.mjs``): ``work()`` with an ``async`` no-op
  handler and the constructor's defaults, but ``batchSize: 100, pollingIntervalSeconds: 0.5``.
  pg-boss does not LISTEN: each ``work()`` loop fetches a batch, runs the handler on it, then
  sleeps out the rest of the interval whether it found jobs or not. Its defaults (1 job, every
  2 s) do 0.5 jobs/s a process, a round of 5,000 jobs in hours; 0.5 s is the shortest interval it
  accepts, and 100 a fetch caps a process at 200 jobs/s: its row measures that setting more than
  the database.

One round enqueues ``--jobs`` jobs with the system's own API in one call (procrastinate
``batch_defer``, pgqueuer ``enqueue`` with lists, ``pglockkit.enqueue_jobs``, graphile-worker
``addJobs``, pg-boss ``insert``; the Node.js ones by a ``node`` process that says when the jobs
are committed) and times from its commit until no job of the round is left unfinished (polled
every 20 ms with one ``count(*)`` query: graphile-worker deletes a finished job from
``graphile_worker._private_jobs``, pg-boss keeps it in ``pgboss.job`` as 'completed'):
drain jobs/s = jobs / that time, what a burst costs, start-up latency included; steady
jobs/s = the jobs done between the polls that saw 10% and 90% of the round done / the time
between them, the rate once the workers are running (pgqueuer, for one, takes about a second to
get going on a round). The workers wake by NOTIFY (pg-boss's at their next poll). Rounds of the
systems alternate in an order rotated run by run (``--runs``), so drift of the machine hits them
all. Reported: median (min-max) jobs/s and each system's median / the best peer's median (the best
of every entry that is not pglockkit's, tuned ones included).

Every worker is its own Python or Node.js process, as it would be in production; on a small
machine they share the CPUs with the server, which is part of what is measured (a lighter client
drains faster).

procrastinate and pgqueuer are the optional extra ``peers`` (``pip install -e '.[peers]'``);
graphile-worker and pg-boss are the Node.js project ``bench/node`` (``npm ci --prefix bench/node``,
Node.js 20+: ``$NODE``, else ``node`` on PATH). A missing one is reported as not installed, with
the command that installs it. The databases are dropped at the end.

``--workers 1,4`` measures every system with 1 worker process, then with 4.

Reproduce: ``python -m bench.peers --embedded --workers 1,4`` (or ``--dsn DSN`` of a role that
may create databases); about 4-5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pglockkit
from bench.common import add_target_arguments, environment, int_list, positive, report, spread, target

ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = ROOT / "bench" / "results" / "peers.json"
QUEUE = "bench_peers"
POLL_S = 0.02
READY_TIMEOUT_S = 120.0
NOT_INSTALLED = "not installed (pip install -e '.[peers]')"
NODE_DIR = ROOT / "bench" / "node"  # graphile-worker and pg-boss, in node_modules after `npm ci`
NPM_NOT_INSTALLED = "not installed (npm ci --prefix bench/node)"
NODE_MISSING = "not installed (Node.js 20+: $NODE, else node on PATH)"
NODE_TIMEOUT_S = 120.0


def noop(job: Any, conn: psycopg.Connection) -> None:
    """The pglockkit handler: does nothing (``pglockkit work --handler bench.peers:noop``)."""


def noop_job(job: Any) -> None:
    """The at-least-once pglockkit handler, with no connection: does nothing."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------------------------------------
# Node.js, for the JavaScript peers
# ---------------------------------------------------------------------------------------------


@functools.cache
def node() -> tuple[str, str] | None:
    """(path, version) of ``$NODE``, else of ``node`` on PATH, if it is Node.js 20 or newer."""
    path = os.environ.get("NODE") or shutil.which("node")
    if not path:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        version = out.strip().lstrip("v")
        major = int(version.split(".")[0])
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return (path, version) if major >= 20 else None


def npm_installed(package: str) -> bool:
    return (NODE_DIR / "node_modules" / package / "package.json").is_file()


def npm_version(package: str) -> str:
    text = (NODE_DIR / "node_modules" / package / "package.json").read_text(encoding="utf-8")
    return json.loads(text)["version"]


def node_url(dsn: str) -> str:
    """A ``postgresql://`` URL, what node-postgres parses, for a libpq DSN (key=value or URL)."""
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    user = quote(params.pop("user", ""), safe="")
    password = params.pop("password", "")
    auth = f"{user}:{quote(password, safe='')}@" if password else (f"{user}@" if user else "")
    host = params.pop("host", "")
    port = params.pop("port", "")
    dbname = quote(params.pop("dbname", ""), safe="")
    if host.startswith("/"):  # a Unix socket directory: a query parameter, as node-postgres takes it
        netloc, params = "", {"host": host, **({"port": port} if port else {}), **params}
    else:
        netloc = f"{host}:{port}" if host and port else host
    query = f"?{urlencode(params)}" if params else ""
    return f"postgresql://{auth}{netloc}/{dbname}{query}"


def _node_argv(script: str, command: str, dsn: str, *args: str) -> list[str]:
    found = node()
    if found is None:
        raise RuntimeError(NODE_MISSING)
    return [found[0], str(NODE_DIR / script), command, node_url(dsn), *args]


def _node_setup(script: str) -> Callable[[str], None]:
    def setup(dsn: str) -> None:
        done = subprocess.run(
            _node_argv(script, "setup", dsn), capture_output=True, text=True, timeout=NODE_TIMEOUT_S
        )
        if done.returncode != 0:
            raise RuntimeError(f"{script} setup exited ({done.returncode}):\n{done.stderr[-2000:]}")

    return setup


def _node_enqueue(script: str) -> Callable[[str, int], None]:
    """Enqueue by the script, and return once it says the jobs are committed (the round's clock
    starts then, as it does after the Python peers' calls): its pool closes while the round runs."""

    def enqueue(dsn: str, jobs: int) -> None:
        proc = subprocess.Popen(
            _node_argv(script, "enqueue", dsn, str(jobs)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("enqueued "):
            out, err = proc.communicate(timeout=NODE_TIMEOUT_S)
            raise RuntimeError(f"{script} enqueue exited ({proc.returncode}):\n{line}{out}{err[-2000:]}")
        threading.Thread(target=proc.communicate, daemon=True).start()  # reap it, its output unread

    return enqueue


def _node_worker(script: str, *args: str) -> Callable[[str, str], list[str]]:
    def argv(dsn: str, name: str) -> list[str]:
        return _node_argv(script, "work", dsn, *args)

    return argv


# ---------------------------------------------------------------------------------------------
# The systems
# ---------------------------------------------------------------------------------------------


def _procrastinate_app(dsn: str) -> tuple[Any, Any]:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="bench_noop", queue=QUEUE)
    async def bench_noop() -> None:
        return None

    return app, bench_noop


def _procrastinate_setup(dsn: str) -> None:
    app, _ = _procrastinate_app(dsn)
    with app.open():
        app.schema_manager.apply_schema()


def _procrastinate_enqueue(dsn: str, jobs: int) -> None:
    app, task = _procrastinate_app(dsn)
    with app.open():
        task.batch_defer(*({} for _ in range(jobs)))


def _procrastinate_worker(dsn: str, name: str) -> None:
    app, _ = _procrastinate_app(dsn)
    app.run_worker(queues=[QUEUE], name=name, install_signal_handlers=True)


async def _pgqueuer_queries(dsn: str) -> tuple[Any, psycopg.AsyncConnection]:
    from pgqueuer import Queries
    from pgqueuer.db import PsycopgDriver

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    return Queries(PsycopgDriver(conn)), conn


def _pgqueuer_setup(dsn: str) -> None:
    async def setup() -> None:
        queries, conn = await _pgqueuer_queries(dsn)
        async with conn:
            await queries.install()

    asyncio.run(setup())


def _pgqueuer_enqueue(dsn: str, jobs: int) -> None:
    async def enqueue() -> None:
        queries, conn = await _pgqueuer_queries(dsn)
        async with conn:
            await queries.enqueue(["bench_noop"] * jobs, [None] * jobs, [0] * jobs)

    asyncio.run(enqueue())


def _pgqueuer_worker(dsn: str, name: str) -> None:
    from pgqueuer import Queries, QueueManager
    from pgqueuer.db import PsycopgDriver

    async def work() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            qm = QueueManager(Queries(PsycopgDriver(conn)))

            @qm.entrypoint("bench_noop")
            async def bench_noop(job: Any) -> None:
                return None

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, qm.shutdown.set)
            await qm.run()

    asyncio.run(work())


def _pglockkit_enqueue(dsn: str, jobs: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pglockkit.enqueue_jobs(%s, array_fill('{}'::jsonb, ARRAY[%s]))", (QUEUE, jobs))


@dataclass(frozen=True)
class System:
    """One queue system: how to set it up, start a worker, enqueue, and see whether work is left."""

    name: str
    module: str  # what must be importable, or with npm=True the package in bench/node/node_modules
    setup: Callable[[str], None]
    enqueue: Callable[[str, int], None]
    worker: Callable[[str, str], list[str]]  # (dsn, worker name) -> argv of one worker process
    unfinished_sql: str  # how many jobs are left (queued or running)
    settings: str
    npm: bool = False  # a JavaScript peer, run by Node.js


def _pglockkit_worker(handler: str, *settings: str) -> Callable[[str, str], list[str]]:
    def argv(dsn: str, name: str) -> list[str]:
        return [
            sys.executable,
            *("-m", "pglockkit.cli", "work", "--dsn", dsn, "--queue", QUEUE),
            *("--handler", f"bench.peers:{handler}", "--name", name, *settings),
        ]

    return argv


def _peer_worker(system: str) -> Callable[[str, str], list[str]]:
    def argv(dsn: str, name: str) -> list[str]:
        # Imported as bench.peers, not run as __main__: procrastinate wants its tasks importable.
        boot = "import sys; from bench import peers; sys.exit(peers.main())"
        return [sys.executable, "-c", boot, "--worker", system, "--dsn", dsn, "--name", name]

    return argv


TUNED = ("--batch", "64", "--group", "64")  # the README's best documented setting
GRAPHILE_FAST = ("--concurrency", "10")  # "graphile-worker fast" (its default concurrency is 1)
# "graphile-worker batched": the settings of graphile-worker's performance page (worker.graphile.org,
# docs/performance), with which it reports its highest rates: a local queue, completions batched.
GRAPHILE_BATCHED = (
    *("--concurrency", "24", "--max-pool-size", "25", "--local-queue-size", "500"),
    *("--complete-job-batch-delay", "0", "--fail-job-batch-delay", "0"),
)
# pg-boss's work() defaults (batchSize 1, a poll every 2 s) do 0.5 jobs/s a process: a round would take
# hours. Its fastest poll (0.5 s, the least it allows) and 100 jobs a fetch: at most 200 jobs/s a process.
PGBOSS = ("--batch-size", "100", "--polling-interval-seconds", "0.5")
GRAPHILE_UNFINISHED = "SELECT count(*) FROM graphile_worker._private_jobs"  # done jobs are deleted
PGLOCKKIT_UNFINISHED = (
    f"SELECT count(*) FROM pglockkit.jobs WHERE queue = '{QUEUE}' AND status IN ('queued', 'running')"
)
SYSTEMS = [
    System(
        "pglockkit",
        "pglockkit",
        lambda dsn: pglockkit.install(dsn),
        _pglockkit_enqueue,
        _pglockkit_worker("noop"),
        PGLOCKKIT_UNFINISHED,
        "`pglockkit work` (defaults), `handler(job, conn)`: exactly once",
    ),
    System(
        "pglockkit tuned",
        "pglockkit",
        lambda dsn: pglockkit.install(dsn),
        _pglockkit_enqueue,
        _pglockkit_worker("noop", *TUNED),
        PGLOCKKIT_UNFINISHED,
        f"`pglockkit work {' '.join(TUNED)}`, `handler(job, conn)`: exactly once",
    ),
    System(
        "pglockkit at least once",
        "pglockkit",
        lambda dsn: pglockkit.install(dsn),
        _pglockkit_enqueue,
        _pglockkit_worker("noop_job"),
        PGLOCKKIT_UNFINISHED,
        "`pglockkit work` (defaults), `handler(job)`: at least once",
    ),
    System(
        "procrastinate",
        "procrastinate",
        _procrastinate_setup,
        _procrastinate_enqueue,
        _peer_worker("procrastinate"),
        "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')",
        "`run_worker`, defaults (concurrency 1), async task",
    ),
    System(
        "pgqueuer",
        "pgqueuer",
        _pgqueuer_setup,
        _pgqueuer_enqueue,
        _peer_worker("pgqueuer"),
        "SELECT count(*) FROM pgqueuer",
        "`QueueManager.run`, defaults (batch 10, durable), async entrypoint",
    ),
    System(
        "graphile-worker",
        "graphile-worker",
        _node_setup("graphile_worker.mjs"),
        _node_enqueue("graphile_worker.mjs"),
        _node_worker("graphile_worker.mjs"),
        GRAPHILE_UNFINISHED,
        "`run()`, defaults (concurrency 1), async task",
        npm=True,
    ),
    System(
        "graphile-worker fast",
        "graphile-worker",
        _node_setup("graphile_worker.mjs"),
        _node_enqueue("graphile_worker.mjs"),
        _node_worker("graphile_worker.mjs", *GRAPHILE_FAST),
        GRAPHILE_UNFINISHED,
        "`run()`, concurrency 10 (the CLI's `--jobs 10`), else defaults, async task",
        npm=True,
    ),
    System(
        "graphile-worker batched",
        "graphile-worker",
        _node_setup("graphile_worker.mjs"),
        _node_enqueue("graphile_worker.mjs"),
        _node_worker("graphile_worker.mjs", *GRAPHILE_BATCHED),
        GRAPHILE_UNFINISHED,
        "`run()`, its performance page's settings: concurrency 24, pool 25, `localQueue.size` 500, "
        "completions and failures batched (delay 0), async task",
        npm=True,
    ),
    System(
        "pg-boss",
        "pg-boss",
        _node_setup("pgboss_worker.mjs"),
        _node_enqueue("pgboss_worker.mjs"),
        _node_worker("pgboss_worker.mjs", *PGBOSS),
        # Done jobs stay, as 'completed'; the enum orders created < retry < active < completed.
        f"SELECT count(*) FROM pgboss.job WHERE name = '{QUEUE}' AND state < 'completed'",
        "`work()`, batchSize 100, pollingIntervalSeconds 0.5 (defaults: 1, 2), async handler; "
        "polls, no LISTEN",
        npm=True,
    ),
]
WORKERS = {"procrastinate": _procrastinate_worker, "pgqueuer": _pgqueuer_worker}


def missing(system: System) -> str | None:
    """Why ``system`` cannot run here (its "not installed" status), or None."""
    if not system.npm:
        return None if installed(system.module) else NOT_INSTALLED
    if not npm_installed(system.module):
        return NPM_NOT_INSTALLED
    return None if node() else NODE_MISSING


def system_version(system: System) -> str:
    from importlib.metadata import version

    if system.npm:
        found = node()
        return f"{npm_version(system.module)} (Node.js {found[1] if found else '?'})"
    return version(system.module)


# ---------------------------------------------------------------------------------------------
# Databases, workers, rounds
# ---------------------------------------------------------------------------------------------


def _db_name(prefix: str, system: System) -> str:
    return f"{prefix}_{system.name.replace(' ', '_')}"


def dsn_for(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)


def drop_database(admin: psycopg.Connection, name: str) -> None:
    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def create_database(admin: psycopg.Connection, name: str) -> None:
    drop_database(admin, name)
    admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))


@dataclass
class Running:
    """A system set up in its own database, with its idle workers."""

    system: System
    dsn: str
    procs: list[subprocess.Popen]
    log_path: Path

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def check_alive(self) -> None:
        dead = [p for p in self.procs if p.poll() is not None]
        if dead:
            tail = self.log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise RuntimeError(f"{self.system.name}: a worker exited ({dead[0].returncode}):\n{tail}")


def _log_path(system: System, log_dir: Path) -> Path:
    return log_dir / f"peers-{system.name.replace(' ', '_')}.log"


def start(system: System, dsn: str, workers: int, log_dir: Path) -> Running:
    """Start ``workers`` worker processes of ``system`` (set up in ``dsn``), their output appended
    to its log."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    env["PYTHONWARNINGS"] = "ignore"
    log_path = _log_path(system, log_dir)
    log = log_path.open("a", encoding="utf-8")
    procs = [
        subprocess.Popen(
            system.worker(dsn, f"bench-{i}"), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        for i in range(workers)
    ]
    log.close()
    return Running(system, dsn, procs, log_path)


@dataclass
class Round:
    """One recorded round: the whole drain, and its middle (from 10% to 90% of the jobs done)."""

    jobs_s: float  # jobs / time from the enqueue's commit until none is unfinished
    steady_jobs_s: float  # jobs done between the polls that saw 10% and 90% done / the time between them
    seconds: float


def drain(running: Running, jobs: int, timeout: float) -> Round:
    """Enqueue ``jobs`` and poll until none is unfinished."""
    seen: list[tuple[float, int]] = []
    with psycopg.connect(running.dsn, autocommit=True) as conn:
        running.system.enqueue(running.dsn, jobs)
        started = time.perf_counter()
        deadline = started + timeout
        while True:
            left = conn.execute(running.system.unfinished_sql, prepare=True).fetchone()[0]
            seen.append((time.perf_counter(), left))
            if left == 0:
                break
            running.check_alive()
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{running.system.name}: {jobs} jobs not drained in {timeout:.0f} s")
            time.sleep(POLL_S)
    running.check_alive()
    elapsed = seen[-1][0] - started
    t10, left10 = next((t, n) for t, n in seen if n <= 0.9 * jobs)
    t90, left90 = next((t, n) for t, n in seen if n <= 0.1 * jobs)
    steady = (left10 - left90) / (t90 - t10) if t90 > t10 else jobs / elapsed
    return Round(jobs / elapsed, steady, elapsed)


# ---------------------------------------------------------------------------------------------
# Command line and report
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument(
        "--workers", type=int_list, default=[4], help="worker processes per system, e.g. 1,4 (default 4)"
    )
    parser.add_argument("--jobs", type=positive(int), default=5000, help="no-op jobs per round (5000)")
    parser.add_argument("--runs", type=positive(int), default=3, help="rounds per system (default 3)")
    parser.add_argument(
        "--warmup", type=positive(int), default=200, help="jobs of the unrecorded first round"
    )
    parser.add_argument("--timeout", type=positive(float), default=120.0, help="seconds per round at most")
    parser.add_argument("--prefix", default="pglockkit_bench_peers", help="database name prefix")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)  # a worker process
    parser.add_argument("--name", default="bench", help=argparse.SUPPRESS)
    return parser


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    """Measure with parsed ``args``; returns the JSON document, with the report under "markdown"."""
    absent = {s.name: why for s in SYSTEMS if (why := missing(s))}
    systems = [s for s in SYSTEMS if s.name not in absent]
    log_dir = args.output.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with psycopg.connect(dsn, autocommit=True) as admin:
        version = admin.execute("SHOW server_version").fetchone()[0]
        for workers in args.workers:
            rounds = measure(admin, dsn, systems, workers, args, log_dir)
            rows += _rows(rounds, absent, workers)
    env = environment("bench.peers", argv, target_name, version)
    settings = {"workers": args.workers, "jobs": args.jobs, "runs": args.runs, "warmup": args.warmup}
    return {
        "environment": env,
        "settings": settings,
        "rows": rows,
        "markdown": render_markdown(env, settings, rows),
    }


def measure(
    admin: psycopg.Connection,
    dsn: str,
    systems: Sequence[System],
    workers: int,
    args: argparse.Namespace,
    log_dir: Path,
) -> dict[str, list[Round]]:
    """Every system with ``workers`` worker processes, rounds alternating; their rounds by name.

    A system's workers run for its own rounds only: started, warmed up by a round of
    ``args.warmup`` jobs that is not recorded (which also waits for them to start), a recorded round,
    stopped. So the other systems' idle workers neither poll during its round nor hold connections
    (all eight systems' pools, at 4 processes each, need more than a default max_connections of 100).
    """
    rounds: dict[str, list[Round]] = {s.name: [] for s in systems}
    dsns: dict[str, str] = {}
    try:
        for system in systems:
            name = _db_name(args.prefix, system)
            create_database(admin, name)
            dsns[system.name] = dsn_for(dsn, name)
            system.setup(dsns[system.name])
            _log_path(system, log_dir).write_text("", encoding="utf-8")
        for i in range(args.runs):
            shift = i % len(systems)
            for system in [*systems[shift:], *systems[:shift]]:
                running = start(system, dsns[system.name], workers, log_dir)
                try:
                    drain(running, args.warmup, READY_TIMEOUT_S)
                    rounds[system.name].append(rnd := drain(running, args.jobs, args.timeout))
                finally:
                    running.stop()
                _log(
                    f"[peers] {workers} workers, run {i + 1}/{args.runs} {system.name}: "
                    f"{rnd.jobs_s:,.0f} jobs/s, {rnd.steady_jobs_s:,.0f} from 10% to 90% done"
                )
    finally:
        for system in systems:
            drop_database(admin, _db_name(args.prefix, system))
    return rounds


def _rows(rounds: dict[str, list[Round]], absent: dict[str, str], workers: int) -> list[dict[str, Any]]:
    peers = [s.name for s in SYSTEMS if s.module != "pglockkit" and s.name in rounds]
    best = max((statistics.median(r.jobs_s for r in rounds[p]) for p in peers), default=None)
    best_steady = max((statistics.median(r.steady_jobs_s for r in rounds[p]) for p in peers), default=None)
    rows = []
    for system in SYSTEMS:
        if system.name in absent:
            rows.append(
                {
                    "system": system.name,
                    "workers": workers,
                    "status": absent[system.name],
                    "settings": system.settings,
                }
            )
            continue
        mine = rounds[system.name]
        median = statistics.median(r.jobs_s for r in mine)
        steady = statistics.median(r.steady_jobs_s for r in mine)
        rows.append(
            {
                "system": system.name,
                "workers": workers,
                "status": "measured",
                "version": system_version(system),
                "settings": system.settings,
                "jobs_s": [r.jobs_s for r in mine],
                "median_jobs_s": median,
                "vs_best_peer": None if best is None else median / best,
                "steady_jobs_s": [r.steady_jobs_s for r in mine],
                "median_steady_jobs_s": steady,
                "steady_vs_best_peer": None if best_steady is None else steady / best_steady,
                "round_seconds": [r.seconds for r in mine],
            }
        )
    return rows


def render_markdown(env: dict[str, Any], settings: dict[str, Any], rows: list[dict]) -> str:
    lines = [
        "# Queue peers: no-op jobs drained by each system's own workers",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']}); each system in a database of its own",
        f"- machine: {env['platform']}, {env['cpu']}, nproc {env['nproc']}",
        f"- settings: {', '.join(map(str, settings['workers']))} worker processes per system, "
        f"{settings['jobs']:,} no-op jobs per round, {settings['runs']} rounds per system (rotated), "
        f"after a warm-up of {settings['warmup']}",
        "",
        "Drain: jobs / time from the enqueue's commit until no job is left unfinished (what a burst "
        "costs, start-up latency included). Steady: jobs done between the polls that saw 10% and 90% "
        "of the round done / the time between them (the rate once running). Median (min-max) of "
        "rounds; ratio = median / the best peer's median.",
        "",
        "| system | processes | version | workers run as | drain jobs/s | vs best peer | steady jobs/s "
        "| vs best peer |",
        "|---|--:|---|---|--:|--:|--:|--:|",
    ]

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for r in rows:
        if r["status"] != "measured":
            lines.append(
                f"| {r['system']} | {r['workers']} | - | {r['settings']} | {r['status']} | - | - | - |"
            )
            continue
        lines.append(
            f"| {r['system']} | {r['workers']} | {r['version']} | {r['settings']} | {spread(r['jobs_s'])} "
            f"| {ratio(r['vs_best_peer'])} | {spread(r['steady_jobs_s'])} "
            f"| {ratio(r['steady_vs_best_peer'])} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.worker:  # one worker process of a peer, started by start()
        logging.basicConfig(level=logging.WARNING)
        with contextlib.suppress(KeyboardInterrupt):
            WORKERS[args.worker](args.dsn, args.name)
        return 0
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    from bench import peers  # this module under its own name, so that procrastinate's tasks are importable

    sys.exit(peers.main())
