"""What one job costs the worker: commits, round trips, server CPU and client CPU.

One process drains ``--jobs`` no-op jobs with ``pglockkit.Worker`` (``handler(job, conn)``, one
lane) in each setting below, and the same jobs are drained by the bare ``FOR UPDATE SKIP
LOCKED`` statements at the same batch, on a table of the same shape (``LIKE pglockkit.jobs
INCLUDING ALL``): per batch, ``BEGIN`` and the claim in one round trip, then the completion and
``COMMIT`` in another. That is the ceiling: the fewest statements that claim and complete a
batch in one transaction. Measured per job:

- commits: ``xact_commit`` of the database in ``pg_stat_database`` (after the sessions ended and
  reported), less this benchmark's own;
- round trips: calls into psycopg that wait for the server (a pipeline counts once), counted in
  this process; the worker's LISTEN waits are not counted;
- server CPU: user + system time of the server's backends, read from ``/proc`` (the postmaster's
  ``cutime + cstime`` grows by a backend's time when the backend exits: the worker's sessions end
  with the run). The server must run on this machine, as the embedded one does;
- client CPU: this process's CPU time.

Reproduce: ``python -m bench.worker_cost --embedded`` (under a minute).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, environment, positive, report, target
from bench.peers import create_database, drop_database, dsn_for
from pglockkit import _calls

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "worker_cost.json"
QUEUE = "bench_cost"
SETUP = """
DROP TABLE IF EXISTS bench_cost_jobs;
CREATE TABLE bench_cost_jobs (LIKE pglockkit.jobs INCLUDING ALL);
DROP SEQUENCE IF EXISTS bench_cost_tokens;
CREATE SEQUENCE bench_cost_tokens;
"""
BARE_FILL = "INSERT INTO bench_cost_jobs (queue) SELECT %s FROM generate_series(1, %s)"
BARE_CLAIM = """
UPDATE bench_cost_jobs SET status = 'running', attempt = attempt + 1, token = nextval('bench_cost_tokens'),
       lease_expires_at = clock_timestamp() + interval '1 minute', worker = 'bare',
       started_at = clock_timestamp()
 WHERE id IN (SELECT id FROM bench_cost_jobs
               WHERE queue = %s AND status = 'queued' AND run_at <= clock_timestamp()
               ORDER BY priority DESC, run_at, id LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING id, token
"""
BARE_COMPLETE = """
UPDATE bench_cost_jobs SET status = 'done', finished_at = clock_timestamp(), lease_expires_at = NULL
  FROM unnest(%s::bigint[], %s::bigint[]) AS c(id, token)
 WHERE bench_cost_jobs.id = c.id AND bench_cost_jobs.token = c.token AND status = 'running'
"""


def noop(job: Any, conn: psycopg.Connection) -> None:
    """The handler: does nothing."""


class RoundTrips:
    """Counts the worker's calls that wait for the server (``_calls.run`` and ``run_pipeline``)."""

    def __init__(self) -> None:
        self.n = 0
        self._saved: list[tuple[str, Callable[..., Any]]] = []

    def __enter__(self) -> RoundTrips:
        for name in ("run", "run_pipeline"):
            original = getattr(_calls, name)
            self._saved.append((name, original))

            def counted(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                self.n += 1
                return _original(*args, **kwargs)

            setattr(_calls, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved:
            setattr(_calls, name, original)


def _postmaster_pid(conn: psycopg.Connection) -> int:
    data_dir = conn.execute("SHOW data_directory").fetchone()[0]
    return int(Path(data_dir, "postmaster.pid").read_text().split()[0])


def _children_cpu(pid: int) -> float:
    """Seconds of CPU of the exited children of ``pid`` (its backends, once they end)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime


def _commits(conn: psycopg.Connection) -> int:
    return conn.execute(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()[0]


def _settled(conn: psycopg.Connection, postmaster: int) -> tuple[int, float]:
    """The commit count and the backends' CPU once the other sessions of this database have ended
    and what they did is counted: a session's statistics and its CPU reach pg_stat_database and
    the postmaster's cutime when its backend exits, shortly after the client closes it. Polled
    (no other client backend left, both values unchanged over 50 ms), not slept for: a fixed 1.1 s before
    and after each measure was 9 of the quick suite's 34 s. ``conn`` reads in one transaction
    that it never commits, so it adds no commit of its own to the count."""
    deadline = time.monotonic() + 10.0
    last = None  # the values of the last poll that saw no other session
    while True:
        conn.execute("SELECT pg_stat_clear_snapshot()")  # this transaction's cached statistics
        others = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"  # not an autovacuum worker
        ).fetchone()[0]
        now = (_commits(conn), _children_cpu(postmaster))
        if others == 0 and now == last:
            return now
        if time.monotonic() > deadline:
            raise RuntimeError(f"{others} other session(s) of the database still open after 10 s")
        last = now if others == 0 else None
        time.sleep(0.05)


def measure(dsn: str, jobs: int, run: Callable[[], int]) -> dict[str, float]:
    """Run ``run`` (which drains ``jobs`` jobs on connections that it closes) and cost it."""
    with psycopg.connect(dsn) as conn:  # not autocommit: see _settled
        postmaster = _postmaster_pid(conn)
        commits0, cpu0 = _settled(conn, postmaster)  # the fill's sessions counted
        client0 = time.process_time()
        started = time.perf_counter()
        with RoundTrips() as trips:
            done = run()
        elapsed = time.perf_counter() - started
        client = time.process_time() - client0
        commits1, cpu1 = _settled(conn, postmaster)
        conn.rollback()
    if done != jobs:
        raise RuntimeError(f"drained {done} of {jobs} jobs")
    return {
        "jobs_s": jobs / elapsed,
        "commits_per_job": (commits1 - commits0) / jobs,
        "round_trips_per_job": trips.n / jobs,
        "server_cpu_us_per_job": (cpu1 - cpu0) / jobs * 1e6,
        "client_cpu_us_per_job": client / jobs * 1e6,
    }


def kit_run(dsn: str, jobs: int, batch: int, group: int) -> Callable[[], int]:
    def run() -> int:
        worker = pglockkit.Worker(dsn, QUEUE, noop, batch=batch, group=group)
        return worker.run(exit_when_idle=True)

    return run


def bare_run(dsn: str, jobs: int, batch: int) -> Callable[[], int]:
    def run() -> int:
        done = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                claimed, _ = _calls.run_pipeline(
                    conn,
                    [
                        _calls.statement("BEGIN"),
                        _calls.Call(BARE_CLAIM, (QUEUE, batch), decode=lambda rows: rows),
                    ],
                )
                rows = claimed[1]
                if rows:
                    _calls.run_pipeline(
                        conn,
                        [
                            _calls.Call(
                                BARE_COMPLETE,
                                ([r[0] for r in rows], [r[1] for r in rows]),
                                decode=lambda _: None,
                            ),
                            _calls.statement("COMMIT"),
                        ],
                    )
                else:
                    _calls.run_pipeline(conn, [_calls.statement("COMMIT")])
                    return done
                done += len(rows)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_cost", description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--jobs", type=positive(int), default=5000, help="no-op jobs per setting (5000)")
    parser.add_argument("--database", default="pglockkit_bench_cost", help="created and dropped")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    return parser


SETTINGS = [  # (label, batch, group); the bare ceiling runs at each batch
    ("default (batch 32, group 32)", 32, 32),
    ("batch 1, group 1", 1, 1),
]


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    rows = []
    with psycopg.connect(dsn, autocommit=True) as admin:
        version = admin.execute("SHOW server_version").fetchone()[0]
        create_database(admin, args.database)
        try:
            db = dsn_for(dsn, args.database)
            pglockkit.install(db)
            with psycopg.connect(db, autocommit=True) as conn:
                conn.execute(SETUP)
            for label, batch, group in SETTINGS:
                with psycopg.connect(db, autocommit=True) as conn:
                    conn.execute(
                        "SELECT pglockkit.enqueue_jobs(%s, array_fill('{}'::jsonb, ARRAY[%s]))",
                        (QUEUE, args.jobs),
                    )
                kit = measure(db, args.jobs, kit_run(db, args.jobs, batch, group))
                with psycopg.connect(db, autocommit=True) as conn:
                    conn.execute(BARE_FILL, (QUEUE, args.jobs))
                bare = measure(db, args.jobs, bare_run(db, args.jobs, batch))
                rows.append({"setting": label, "batch": batch, "group": group, "worker": kit, "bare": bare})
                print(f"[worker_cost] {label}: {kit} / bare {bare}", file=sys.stderr)
        finally:
            drop_database(admin, args.database)
    env = environment("bench.worker_cost", argv, target_name, version)
    lines = [
        "# What one job costs: pglockkit.Worker vs the bare SKIP LOCKED statements at the same batch",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']})",
        f"- machine: {env['platform']}, {env['cpu']}, nproc {env['nproc']}",
        f"- {args.jobs:,} no-op jobs per setting, one process, one lane (`handler(job, conn)`: exactly once)",
        "",
        "| setting | drained by | jobs/s | commits / job | round trips / job | server CPU µs / job "
        "| client CPU µs / job |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        for who in ("worker", "bare"):
            m = r[who]
            name = "`pglockkit.Worker`" if who == "worker" else f"bare statements, batch {r['batch']}"
            lines.append(
                f"| {r['setting']} | {name} | {m['jobs_s']:,.0f} | {m['commits_per_job']:.3f} "
                f"| {m['round_trips_per_job']:.3f} | {m['server_cpu_us_per_job']:,.0f} "
                f"| {m['client_cpu_us_per_job']:,.0f} |"
            )
    return {"environment": env, "settings": {"jobs": args.jobs}, "rows": rows, "markdown": "\n".join(lines)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    sys.exit(main())
