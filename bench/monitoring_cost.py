"""Monitoring cost: what reading pglockkit's views and recording samples costs with 1,000 locks held.

Setup: --holders idle sessions hold --locks advisory locks in all, spread over five registered
namespaces plus some unregistered keys; --waiters sessions wait behind the first holder (so
`pg_blocking_pids` and the chain search have work to do).

Measured, each as the median latency of --calls calls over --runs runs, next to the baseline a
hand-written monitor would run, `pg_locks` joined to `pg_stat_activity` for advisory locks (the
usual lock-monitor query, which names nothing):

- `SELECT * FROM pglockkit.advisory_locks`, `lock_waits`, `idle_lock_holders`, `namespace_stats`;
- `SELECT pglockkit.sample()` (writes one snapshot; retention pruning included);
- `pglockkit top --once`'s queries (one frame).

Then what sampling costs a swarm: claim + complete throughput of --workers workers with and
without a sampler calling `sample()` every --sample-every seconds (runs interleaved); the ratio
is the throughput kept.

Reproduce: python -m bench.monitoring_cost --embedded   (or --dsn DSN); about 1 minute.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, environment, positive, report, spread, target
from pglockkit import monitor

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "monitoring_cost.json"
NAMESPACES = [f"bench_mon_{i}" for i in range(5)]
BASELINE = """
SELECT l.locktype, l.classid, l.objid, l.objsubid, l.granted, l.pid, a.application_name, a.state, a.query
  FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory'
"""
QUERIES = {
    "pg_locks join (baseline)": BASELINE,
    "advisory_locks": "SELECT * FROM pglockkit.advisory_locks",
    "lock_waits": "SELECT * FROM pglockkit.lock_waits",
    "idle_lock_holders": "SELECT * FROM pglockkit.idle_lock_holders",
    "namespace_stats": "SELECT * FROM pglockkit.namespace_stats",
    "sample()": "SELECT pglockkit.sample()",
}


def _plant(dsn: str, holders: int, locks: int, waiters: int) -> list[psycopg.Connection]:
    """Idle sessions holding `locks` advisory locks, and waiters blocked behind the first one."""
    conns = []
    with psycopg.connect(dsn, autocommit=True) as admin:
        for ns in NAMESPACES:
            admin.execute("SELECT pglockkit.register_namespace(%s)", (ns,))
    per_holder = -(-locks // holders)
    taken = 0
    for h in range(holders):
        conn = psycopg.connect(dsn, autocommit=True, application_name=f"bench holder {h}")
        n = min(per_holder, locks - taken)
        # Four in five keys in registered namespaces, the rest unregistered (bare bigints).
        conn.execute(
            "SELECT count(pg_advisory_lock(CASE WHEN i %% 5 = 4 THEN 900000000 + i "
            "ELSE pglockkit.lock_key((%s::text[])[1 + i %% 4], i::text) END)) "
            "FROM generate_series(%s::int, %s::int) i",
            (NAMESPACES, taken, taken + n - 1),
        )
        taken += n
        conns.append(conn)
    first_key = conns[0].execute("SELECT pglockkit.lock_key(%s, %s)", (NAMESPACES[0], "0")).fetchone()[0]
    for w in range(waiters):
        conn = psycopg.connect(dsn, autocommit=True, application_name=f"bench waiter {w}")
        threading.Thread(
            target=lambda c=conn: _quiet(c.execute, "SELECT pg_advisory_lock(%s)", (first_key,)), daemon=True
        ).start()
        conns.append(conn)
    deadline = time.monotonic() + 10
    with psycopg.connect(dsn, autocommit=True) as check:
        while check.execute("SELECT count(*) FROM pglockkit.lock_waits").fetchone()[0] < waiters:
            if time.monotonic() > deadline:
                raise RuntimeError("waiters did not block")
            time.sleep(0.05)
    return conns


def _quiet(fn, *args) -> None:
    with contextlib.suppress(psycopg.Error):  # the planted waiter's connection is closed at the end
        fn(*args)


def _latencies(conn: psycopg.Connection, query: str, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        conn.execute(query).fetchall()
        out.append((time.perf_counter() - t) * 1000)
    return out


def _swarm(dsn: str, workers: int, seconds: float, sample_every: float | None, queue: str) -> float:
    """Claim + complete cycles/s of `workers` threads, with an optional sampler beside them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pglockkit.enqueue_jobs(%s, array_fill('{}'::jsonb, ARRAY[%s]))", (queue, 50_000))
    stop = threading.Event()
    done = [0] * workers

    def work(i: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                row = conn.execute(
                    "SELECT id, token FROM pglockkit.claim_job(%s, %s, interval '1 minute', 1)",
                    (queue, f"w{i}"),
                ).fetchone()
                if row is None:
                    return
                conn.execute("SELECT pglockkit.complete_job(%s, %s)", row)
                done[i] += 1

    def sampler() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.wait(sample_every):
                conn.execute("SELECT pglockkit.sample()")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    if sample_every:
        threads.append(threading.Thread(target=sampler))
    started = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM pglockkit.jobs WHERE queue = %s", (queue,))
    return sum(done) / elapsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.monitoring_cost", description=__doc__.splitlines()[0]
    )
    add_target_arguments(parser)
    parser.add_argument("--locks", type=positive(int), default=1000, help="advisory locks held (1000)")
    parser.add_argument("--holders", type=positive(int), default=20, help="idle sessions holding them (20)")
    parser.add_argument("--waiters", type=positive(int), default=10, help="sessions waiting (default 10)")
    parser.add_argument("--calls", type=positive(int), default=30, help="calls per query per run (30)")
    parser.add_argument("--runs", type=positive(int), default=3)
    parser.add_argument("--workers", type=positive(int), default=4, help="swarm size (default 4)")
    parser.add_argument("--seconds", type=positive(float), default=4.0, help="per swarm run (default 4)")
    parser.add_argument("--sample-every", type=positive(float), default=1.0, help="seconds (default 1)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    return parser


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    """Measure with parsed ``args``; returns the JSON document, with the report under "markdown"."""
    if args.holders > args.locks:
        raise ValueError("--holders must not exceed --locks")
    pglockkit.install(dsn)

    planted = _plant(dsn, args.holders, args.locks, args.waiters)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
            held = conn.execute("SELECT count(*) FROM pglockkit.advisory_locks WHERE granted").fetchone()[0]
            ms: dict[str, list[float]] = {name: [] for name in [*QUERIES, "top --once frame"]}
            for _ in range(args.runs):
                for name, query in QUERIES.items():
                    ms[name].append(statistics.median(_latencies(conn, query, args.calls)))
                frame = []
                for _ in range(args.calls):
                    t = time.perf_counter()
                    monitor.render_top(conn, 80)
                    frame.append((time.perf_counter() - t) * 1000)
                ms["top --once frame"].append(statistics.median(frame))
            conn.execute("DELETE FROM pglockkit.lock_samples; DELETE FROM pglockkit.queue_samples")
    finally:
        for conn in planted:
            conn.close()

    swarm: dict[str, list[float]] = {"without sampler": [], "with sampler": []}
    for run in range(args.runs):
        order = ["without sampler", "with sampler"] if run % 2 == 0 else ["with sampler", "without sampler"]
        for name in order:
            every = args.sample_every if name == "with sampler" else None
            swarm[name].append(_swarm(dsn, args.workers, args.seconds, every, f"bench_mon_{run}"))
            print(f"run {run + 1} {name}: {swarm[name][-1]:,.0f} jobs/s", file=sys.stderr, flush=True)

    env = environment("bench.monitoring_cost", argv, target_name, version)
    base = statistics.median(ms["pg_locks join (baseline)"])
    kept = statistics.median(swarm["with sampler"]) / statistics.median(swarm["without sampler"])
    lines = ["# pglockkit monitoring cost", ""]
    lines += [f"- {key}: {env[key]}" for key in ("date", "command", "server_version", "platform", "nproc")]
    lines += [
        "",
        f"{held} advisory locks held by {args.holders} idle sessions, {args.waiters} waiters",
        "",
        "| query | ms per call, median (min-max of runs) | x baseline |",
        "|---|--:|--:|",
    ]
    for name, values in ms.items():
        lines.append(f"| {name} | {spread(values, '.2f')} | {statistics.median(values) / base:.1f} |")
    lines += [
        "",
        f"claim + complete with {args.workers} workers: {spread(swarm['without sampler'])} jobs/s without, "
        f"{spread(swarm['with sampler'])} with sample() every {args.sample_every:g}s: "
        f"{kept:.2f} of the throughput kept",
    ]
    return {
        "environment": env,
        "locks_held": held,
        "latency_ms": ms,
        "swarm_jobs_s": swarm,
        "kept": kept,
        "markdown": "\n".join(lines),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.holders > args.locks:
        parser.error("--holders must not exceed --locks")
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    raise SystemExit(main())
