"""What ticking schedules costs: ``pglockkit.tick_schedules()`` with 1,000 schedules, when none is
due (what every worker process pays about once a second) and when all are due (each enqueues one
job), next to a tick with no schedules at all.

    python -m bench.schedule_tick --embedded        # or --dsn DSN; about 20 s

Method: the schedules are ``* * * * *`` into a queue of their own. "Nothing due" times autocommit
``SELECT pglockkit.tick_schedules()`` calls, one round trip each (median of --calls). "All due"
moves every schedule's next run to the last minute boundary (a slot), then times the one tick that
enqueues a job for each (median of --runs, each on a fresh start: jobs deleted, next runs moved
back). The schedules and their jobs are deleted at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, environment, report, spread, target

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "schedule_tick.json"
QUEUE = "bench_schedule_tick"


def _tick_latency(conn: psycopg.Connection, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        conn.execute("SELECT pglockkit.tick_schedules()").fetchone()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _clean(conn: psycopg.Connection) -> None:
    conn.execute("SELECT pglockkit.unschedule(name) FROM pglockkit.schedules WHERE queue = %s", (QUEUE,))
    conn.execute("DELETE FROM pglockkit.jobs WHERE queue = %s", (QUEUE,))


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    pglockkit.install(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
        _clean(conn)
        others = conn.execute("SELECT count(*) FROM pglockkit.schedules").fetchone()[0]
        empty = _tick_latency(conn, args.calls)
        conn.execute(
            "SELECT pglockkit.schedule('bench-' || i, '* * * * *', %s) FROM generate_series(1, %s) i",
            (QUEUE, args.schedules),
        )
        idle = _tick_latency(conn, args.calls)
        due = []
        try:
            for _ in range(args.runs):
                conn.execute("DELETE FROM pglockkit.jobs WHERE queue = %s", (QUEUE,))
                conn.execute(
                    "UPDATE pglockkit.job_schedules SET next_run = date_trunc('minute', now()) "
                    "WHERE queue = %s",
                    (QUEUE,),
                )
                t0 = time.perf_counter()
                n = conn.execute("SELECT pglockkit.tick_schedules()").fetchone()[0]
                due.append((time.perf_counter() - t0) * 1e3)
                assert n >= args.schedules, n
        finally:
            _clean(conn)
    env = environment("bench.schedule_tick", argv, target_name, version)
    result = {
        "schedules": args.schedules,
        "other_schedules": others,
        "empty_tick_us": statistics.median(empty),
        "idle_tick_us": statistics.median(idle),
        "all_due_tick_ms": statistics.median(due),
        "all_due_per_schedule_us": statistics.median(due) * 1000 / args.schedules,
        "empty_runs": empty,
        "idle_runs": idle,
        "due_runs": due,
    }
    lines = ["# Ticking schedules", ""]
    lines += [f"- {k}: {env[k]}" for k in ("date", "command", "server_version", "cpu", "nproc")]
    lines += [
        "",
        "| tick | median (min-max) | per schedule |",
        "|---|--:|--:|",
        f"| no schedules, one round trip | {spread(empty, ',.0f')} µs | - |",
        f"| {args.schedules:,} schedules, none due, one round trip | {spread(idle, ',.0f')} µs | - |",
        f"| {args.schedules:,} schedules, all due (enqueues {args.schedules:,} jobs) "
        f"| {spread(due, ',.1f')} ms | {result['all_due_per_schedule_us']:,.0f} µs |",
    ]
    return {"environment": env, "result": result, "markdown": "\n".join(lines)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.schedule_tick", description=__doc__.splitlines()[0]
    )
    add_target_arguments(parser)
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=2000, help="ticks timed when none is due")
    parser.add_argument("--runs", type=int, default=5, help="all-due ticks timed")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    sys.exit(main())
