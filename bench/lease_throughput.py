"""Lease throughput: acquire + release cycles per second, pglockkit vs a bare upsert.

What is measured: each client loops `acquire` then (if it got the lease) `release`, each call its
own autocommit statement, for --seconds. Two shapes:

- contended: every client fights for one lease name (only one can hold it at a time);
- spread: every client has its own name (no contention: the per-call cost).

Contenders poll as fast as they can by default; with --miss-pause-ms P a client that did not get
the lease sleeps P ms before it tries again, as a real poller would. Polling flat out, the
cycles/s of the contended shape also measure how much CPU the losers leave the holder: a loser
that answers sooner polls more often. The clients are threads of this process by default, so
there they also share one GIL: a holder's release waits for it behind losers that answer at once.
--processes runs each client in a process of its own, as separate pods would.

The baseline does the same with plain SQL on a plain table: an `INSERT ... ON CONFLICT DO UPDATE
... WHERE expired OR same holder RETURNING token` upsert to acquire and an `UPDATE` to release,
i.e. what a hand-rolled lease costs without validation, fencing state or session binding.

Reported: median cycles/s (successful acquire+release pairs) and attempts/s over --runs runs,
pglockkit runs interleaved with baseline runs, the ratio of the medians pglockkit/baseline, and
the median of the per-run ratios (each pglockkit run over the baseline run next to it in time):
on a shared machine the load drifts between runs, and a pair measured back to back shares it.

Reproduce: python -m bench.lease_throughput --embedded   (or --dsn DSN); about 40 s by default.
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, nproc, report, spread, target

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "lease_throughput.json"

BASELINE_SETUP = """
CREATE TABLE IF NOT EXISTS bench_bare_leases (
    name text PRIMARY KEY, holder text NOT NULL, token bigint NOT NULL, expires_at timestamptz NOT NULL)
"""
BASELINE_ACQUIRE = """
INSERT INTO bench_bare_leases AS l (name, holder, token, expires_at)
VALUES (%(name)s, %(holder)s, 1, clock_timestamp() + interval '30 seconds')
ON CONFLICT (name) DO UPDATE
   SET holder = excluded.holder, token = l.token + 1, expires_at = excluded.expires_at
 WHERE l.expires_at <= clock_timestamp() OR l.holder = excluded.holder
RETURNING token
"""
BASELINE_RELEASE = """
UPDATE bench_bare_leases SET expires_at = clock_timestamp()
 WHERE name = %(name)s AND holder = %(holder)s AND token = %(token)s
"""
KIT_ACQUIRE = "SELECT pglockkit.acquire_lease(%(name)s, %(holder)s, interval '30 seconds')"
KIT_RELEASE = "SELECT pglockkit.release_lease(%(name)s, %(holder)s, %(token)s)"

DESIGNS = {"pglockkit": (KIT_ACQUIRE, KIT_RELEASE), "bare upsert": (BASELINE_ACQUIRE, BASELINE_RELEASE)}


def _client(
    dsn: str,
    design: str,
    name: str,
    holder: str,
    seconds: float,
    barrier: Any,
    out: Any,
    miss_pause: float = 0.0,
) -> None:
    acquire, release = DESIGNS[design]
    cycles = attempts = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        params = {"name": name, "holder": holder, "token": None}
        barrier.wait()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            attempts += 1
            row = conn.execute(acquire, params, prepare=True).fetchone()
            token = row[0] if row else None
            if token is not None:
                params["token"] = token
                conn.execute(release, params, prepare=True)
                cycles += 1
            elif miss_pause:
                time.sleep(miss_pause)
    out.append((cycles, attempts))


class _Results:
    """What a client process appends to: its parent's queue."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def append(self, item: tuple[int, int]) -> None:
        self.queue.put(item)


def run_once(
    dsn: str,
    design: str,
    clients: int,
    contended: bool,
    seconds: float,
    tag: str,
    miss_pause: float = 0.0,
    processes: bool = False,
) -> tuple[float, float]:
    """One run of ``clients`` clients (threads, or processes); returns (cycles/s, attempts/s)."""
    if processes:
        ctx = multiprocessing.get_context("fork")
        barrier: Any = ctx.Barrier(clients)
        queue = ctx.Queue()
        out: Any = _Results(queue)
        spawn: Any = ctx.Process
    else:
        barrier = threading.Barrier(clients)
        out = []
        spawn = threading.Thread
    threads = [
        spawn(
            target=_client,
            args=(
                dsn,
                design,
                f"bench-{tag}" if contended else f"bench-{tag}-{i}",
                f"client-{i}",
                seconds,
                barrier,
                out,
                miss_pause,
            ),
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    if processes:
        results = [queue.get(timeout=seconds + 60) for _ in threads]
    for t in threads:
        t.join()
    if processes:
        if any(t.exitcode != 0 for t in threads):
            raise RuntimeError(f"a client process failed: exit codes {[t.exitcode for t in threads]}")
        out = results
    return sum(c for c, _ in out) / seconds, sum(a for _, a in out) / seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lease_throughput", description=__doc__.splitlines()[0]
    )
    add_target_arguments(parser)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clients", default="1,8", help="comma-separated client counts (default 1,8)")
    parser.add_argument(
        "--miss-pause-ms",
        type=float,
        default=0.0,
        help="a client that did not get the lease sleeps this long before it tries again "
        "(default 0: contenders poll as fast as they can)",
    )
    parser.add_argument(
        "--processes",
        action="store_true",
        help="each client in a process of its own (default: threads of this process, sharing its GIL)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    return parser


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    """Measure with parsed ``args``; returns the JSON document, with the report under "markdown"."""
    pglockkit.install(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(BASELINE_SETUP)
        version = conn.execute("SHOW server_version").fetchone()[0]

    rows = []
    for clients in [int(c) for c in args.clients.split(",")]:
        for contended in (True, False):
            if clients == 1 and not contended:
                continue  # one client: the two shapes are the same
            rates: dict[str, list[tuple[float, float]]] = {d: [] for d in DESIGNS}
            for run in range(args.runs):
                order = list(DESIGNS) if run % 2 == 0 else list(DESIGNS)[::-1]
                for design in order:
                    tag = f"{design[:3]}-{clients}-{int(contended)}-{run}-{time.time_ns()}"
                    pause = args.miss_pause_ms / 1000
                    rates[design].append(
                        run_once(dsn, design, clients, contended, args.seconds, tag, pause, args.processes)
                    )
                    print(
                        f"clients={clients} contended={contended} run={run + 1} {design}: "
                        f"{rates[design][-1][0]:,.0f} cycles/s",
                        file=sys.stderr,
                        flush=True,
                    )
            kit = statistics.median(c for c, _ in rates["pglockkit"])
            bare = statistics.median(c for c, _ in rates["bare upsert"])
            paired = [
                k / b for (k, _), (b, _) in zip(rates["pglockkit"], rates["bare upsert"], strict=True) if b
            ]
            rows.append(
                {
                    "clients": clients,
                    "shape": "one name" if contended else "a name each",
                    "pglockkit_cycles_s": kit,
                    "baseline_cycles_s": bare,
                    "ratio": kit / bare,
                    "paired_ratio": statistics.median(paired) if paired else None,
                    "pglockkit_runs": rates["pglockkit"],
                    "baseline_runs": rates["bare upsert"],
                }
            )

    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.lease_throughput", *argv]),
        "target": target_name,
        "server_version": version,
        "platform": platform.platform(),
        "nproc": nproc(),
        "seconds": args.seconds,
        "miss_pause_ms": args.miss_pause_ms,
        "clients_as": "processes" if args.processes else "threads",
        "runs": args.runs,
    }
    lines = ["# pglockkit lease throughput", ""]
    lines += [
        f"- {key}: {env[key]}"
        for key in ("date", "command", "server_version", "platform", "nproc", "clients_as")
    ]
    lines += [
        "",
        "acquire + release cycles per second (median (min-max) of runs; each call one autocommit statement);",
        "ratio: of the medians; paired: median of each pglockkit run over the baseline run next to it;",
        "attempts/s: acquire calls, won or not (median)",
        "",
        "| clients | lease names | pglockkit cycles/s | bare upsert cycles/s | ratio | paired "
        "| attempts/s, pglockkit vs bare |",
        "|--:|---|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['shape']} | {spread([c for c, _ in r['pglockkit_runs']])} "
            f"| {spread([c for c, _ in r['baseline_runs']])} | {r['ratio']:.2f} "
            f"| {_ratio(r['paired_ratio'])} "
            f"| {statistics.median(a for _, a in r['pglockkit_runs']):,.0f} vs "
            f"{statistics.median(a for _, a in r['baseline_runs']):,.0f} |"
        )
    return {"environment": env, "rows": rows, "markdown": "\n".join(lines)}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    sys.exit(main())
