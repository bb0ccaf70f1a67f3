"""Jobs that wait on the network: one worker process, many jobs in flight.

Each job sleeps ``--sleep`` seconds (100 ms: an API or a model call) and does nothing else. One
worker process with ``--concurrency`` jobs in flight drains ``--jobs`` of them; the ideal rate is
concurrency / sleep (160 jobs/s for 16 and 100 ms). Measured: from starting the worker process
until no job is left unfinished (polled every 20 ms), so Python's start-up, imports and
connecting are included. Reported: median (min-max) jobs/s of ``--runs`` rounds, and the median
as a fraction of the ideal.

Workers measured (each in a database of its own):

- pglockkit, ``def handler(job, conn): time.sleep(...)`` on ``--concurrency`` threads;
- pglockkit, ``async def handler(job, conn): await asyncio.sleep(...)`` on an asyncio loop;
- procrastinate (the optional extra ``peers``), an ``async def`` task, ``run_worker(concurrency=N)``.

Reproduce: ``python -m bench.io_bound --embedded`` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, environment, positive, report, spread, target
from bench.peers import create_database, drop_database, dsn_for, installed

ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = ROOT / "bench" / "results" / "io_bound.json"
QUEUE = "bench_io"
POLL_S = 0.02
SLEEP_ENV = "PGLOCKKIT_BENCH_SLEEP"


def _sleep_s() -> float:
    return float(os.environ.get(SLEEP_ENV, "0.1"))


def sleep_sync(job: Any, conn: psycopg.Connection) -> None:
    """pglockkit, on a thread: wait as a blocking API call would."""
    time.sleep(_sleep_s())


async def sleep_async(job: Any, conn: psycopg.AsyncConnection) -> None:
    """pglockkit, on the loop: wait as an awaited API call would."""
    await asyncio.sleep(_sleep_s())


def _procrastinate_app(dsn: str) -> tuple[Any, Any]:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="bench_io_sleep", queue=QUEUE)
    async def bench_io_sleep() -> None:
        await asyncio.sleep(_sleep_s())

    return app, bench_io_sleep


@dataclass(frozen=True)
class Case:
    name: str
    module: str
    setup: Callable[[str], None]
    enqueue: Callable[[str, int], None]
    worker: Callable[[str, int], list[str]]  # (dsn, concurrency) -> argv
    unfinished_sql: str
    settings: str


def _pglockkit_enqueue(dsn: str, jobs: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pglockkit.enqueue_jobs(%s, array_fill('{}'::jsonb, ARRAY[%s]))", (QUEUE, jobs))


def _pglockkit_worker(handler: str) -> Callable[[str, int], list[str]]:
    def argv(dsn: str, concurrency: int) -> list[str]:
        return [
            sys.executable,
            *("-m", "pglockkit.cli", "work", "--dsn", dsn, "--queue", QUEUE),
            *("--handler", f"bench.io_bound:{handler}", "--concurrency", str(concurrency)),
        ]

    return argv


def _procrastinate_setup(dsn: str) -> None:
    app, _ = _procrastinate_app(dsn)
    with app.open():
        app.schema_manager.apply_schema()


def _procrastinate_enqueue(dsn: str, jobs: int) -> None:
    app, task = _procrastinate_app(dsn)
    with app.open():
        task.batch_defer(*({} for _ in range(jobs)))


def _procrastinate_worker(dsn: str, concurrency: int) -> list[str]:
    boot = "import sys; from bench import io_bound; sys.exit(io_bound.main())"
    return [sys.executable, "-c", boot, "--worker", "--dsn", dsn, "--concurrency", str(concurrency)]


def run_procrastinate_worker(dsn: str, concurrency: int) -> None:
    app, _ = _procrastinate_app(dsn)
    app.run_worker(queues=[QUEUE], concurrency=concurrency, install_signal_handlers=True)


PGLOCKKIT_UNFINISHED = (
    f"SELECT count(*) FROM pglockkit.jobs WHERE queue = '{QUEUE}' AND status IN ('queued', 'running')"
)
CASES = [
    Case(
        "pglockkit threads",
        "pglockkit",
        lambda dsn: pglockkit.install(dsn),
        _pglockkit_enqueue,
        _pglockkit_worker("sleep_sync"),
        PGLOCKKIT_UNFINISHED,
        "`pglockkit work --concurrency N`, `def handler(job, conn)`: time.sleep",
    ),
    Case(
        "pglockkit asyncio",
        "pglockkit",
        lambda dsn: pglockkit.install(dsn),
        _pglockkit_enqueue,
        _pglockkit_worker("sleep_async"),
        PGLOCKKIT_UNFINISHED,
        "`pglockkit work --concurrency N`, `async def handler(job, conn)`: asyncio.sleep",
    ),
    Case(
        "procrastinate",
        "procrastinate",
        _procrastinate_setup,
        _procrastinate_enqueue,
        _procrastinate_worker,
        "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')",
        "`run_worker(concurrency=N)`, `async def` task: asyncio.sleep",
    ),
]


def one_round(case: Case, dsn: str, jobs: int, concurrency: int, sleep_s: float, timeout: float) -> float:
    """Enqueue, start one worker process, poll until drained; jobs/s from the process's start."""
    case.enqueue(dsn, jobs)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    env[SLEEP_ENV] = str(sleep_s)
    env["PYTHONWARNINGS"] = "ignore"
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        proc = subprocess.Popen(
            case.worker(dsn, concurrency),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            while conn.execute(case.unfinished_sql).fetchone()[0]:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{case.name}: worker exited ({proc.returncode}): {proc.stderr.read()[-2000:]}"
                    )
                if time.perf_counter() - started > timeout:
                    raise RuntimeError(f"{case.name}: {jobs} jobs not drained in {timeout:.0f} s")
                time.sleep(POLL_S)
            elapsed = time.perf_counter() - started
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stderr.close()
    return jobs / elapsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.io_bound", description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--jobs", type=positive(int), default=400, help="jobs per round (400)")
    parser.add_argument("--concurrency", type=positive(int), default=16, help="jobs in flight (16)")
    parser.add_argument("--sleep", type=positive(float), default=0.1, help="seconds each job waits (0.1)")
    parser.add_argument("--runs", type=positive(int), default=3, help="rounds per worker (3)")
    parser.add_argument("--timeout", type=positive(float), default=120.0, help="seconds per round at most")
    parser.add_argument("--prefix", default="pglockkit_bench_io", help="database name prefix")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a procrastinate worker
    return parser


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    ideal = args.concurrency / args.sleep
    rows = []
    with psycopg.connect(dsn, autocommit=True) as admin:
        version = admin.execute("SHOW server_version").fetchone()[0]
        for case in CASES:
            if not installed(case.module):
                rows.append({"case": case.name, "status": "not installed (pip install -e '.[peers]')"})
                continue
            name = f"{args.prefix}_{case.name.replace(' ', '_')}"
            create_database(admin, name)
            try:
                case_dsn = dsn_for(dsn, name)
                case.setup(case_dsn)
                rates = [
                    one_round(case, case_dsn, args.jobs, args.concurrency, args.sleep, args.timeout)
                    for _ in range(args.runs)
                ]
            finally:
                drop_database(admin, name)
            median = statistics.median(rates)
            print(
                f"[io_bound] {case.name}: {median:,.1f} jobs/s ({median / ideal:.2f} of ideal)",
                file=sys.stderr,
            )
            rows.append(
                {
                    "case": case.name,
                    "status": "measured",
                    "settings": case.settings,
                    "jobs_s": rates,
                    "median_jobs_s": median,
                    "of_ideal": median / ideal,
                }
            )
    env = environment("bench.io_bound", argv, target_name, version)
    settings = {"jobs": args.jobs, "concurrency": args.concurrency, "sleep_s": args.sleep, "runs": args.runs}
    lines = [
        "# I/O-bound jobs: one worker process, many in flight",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']})",
        f"- machine: {env['platform']}, {env['cpu']}, nproc {env['nproc']}",
        f"- settings: {args.jobs} jobs of {args.sleep * 1000:.0f} ms, one worker process, concurrency "
        f"{args.concurrency} (ideal {ideal:,.0f} jobs/s), {args.runs} rounds, start-up included",
        "",
        "| worker | settings | jobs/s | of ideal |",
        "|---|---|--:|--:|",
    ]
    for r in rows:
        if r["status"] != "measured":
            lines.append(f"| {r['case']} | - | {r['status']} | - |")
        else:
            lines.append(
                f"| {r['case']} | {r['settings']} | {spread(r['jobs_s'], ',.1f')} | {r['of_ideal']:.2f} |"
            )
    return {"environment": env, "settings": settings, "rows": rows, "markdown": "\n".join(lines)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.worker:
        run_procrastinate_worker(args.dsn, args.concurrency)
        return 0
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    from bench import io_bound  # under its own name, so that procrastinate's task is importable

    sys.exit(io_bound.main())
