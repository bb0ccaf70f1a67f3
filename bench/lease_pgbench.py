"""Leases under pgbench (a C client, a server process per client): acquire + release, pglockkit vs
the hand-rolled upsert of ``bench.lease_throughput``.

What is measured
----------------
The scripts are ``bench/pgbench/lease.sql`` and ``lease_bare_upsert.sql``: acquire, then (if it
got the lease) release at once, each call one autocommit statement. Two shapes:

- **a name each** (``--clients``, default 1,8): both scripts in one pgbench run, each transaction
  picking one at random, so that the machine's load hits both alike. Reported: the bare script's
  mean transaction latency over pglockkit's (pgbench's per-transaction log), median of the runs.
  This is the cost of a call.
- **one name** (``--one-name-clients``, default 8): every client fights for one name, each design
  in a run of its own, flat out or sleeping ``--miss-pause-ms`` after a miss. Reported: cycles/s
  (acquisitions, each released at once) and attempts/s. The bare upsert's token grows by one at
  each acquisition; pglockkit's tokens skip values, so its cycles are the calls of
  ``release_lease`` (``pg_stat_user_functions``, with ``track_functions = pl`` set for pgbench's
  sessions: this shape needs a superuser DSN). A bare contender locks the row (ON CONFLICT locks
  before it checks), so it waits for a transaction in flight on the row and commits a row lock;
  pglockkit's answers NULL at once and writes nothing.

Reproduce: ``python -m bench.lease_pgbench --embedded`` (or ``--dsn DSN``); about 2 minutes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, environment, int_list, positive, report, spread, target
from bench.lease_throughput import BASELINE_SETUP
from bench.pgbench_compare import find_pgbench, pgbench_version, run_pgbench, run_pgbench_mixed

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "lease_pgbench.json"
SCRIPTS = {"pglockkit": "lease.sql", "bare upsert": "lease_bare_upsert.sql"}
ONE_NAME = "pgbench-lease-0"  # (:client_id + 1) * :spread, :spread = 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lease_pgbench", description=__doc__.splitlines()[0]
    )
    add_target_arguments(parser)
    parser.add_argument("--seconds", type=positive(int), default=5, help="pgbench -T per run (default 5)")
    parser.add_argument("--runs", type=positive(int), default=3, help="runs per shape and design (default 3)")
    parser.add_argument(
        "--clients", type=int_list, default=[1, 8], help="a name each: client counts (default 1,8)"
    )
    parser.add_argument(
        "--one-name-clients", type=int_list, default=[8], help="one name: client counts (default 8)"
    )
    parser.add_argument(
        "--miss-pause-ms",
        default="0,1",
        help="one name: comma-separated pauses after a miss, in ms (default 0,1: flat out, then 1 ms)",
    )
    parser.add_argument(
        "--sample-waits",
        action="store_true",
        help="one name: sample pg_stat_activity every 5 ms and report the share of releases in flight "
        "that wait for a lock (behind another client)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    return parser


def _cycles(conn: psycopg.Connection, design: str) -> int:
    """What grows by one per acquisition of the one name (see the module docstring)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    if design == "bare upsert":
        row = conn.execute("SELECT token FROM bench_bare_leases WHERE name = %s", (ONE_NAME,)).fetchone()
    else:
        row = conn.execute(
            "SELECT calls FROM pg_stat_user_functions"
            " WHERE schemaname = 'pglockkit' AND funcname = 'release_lease'"
        ).fetchone()
    return row[0] if row else 0


def _free_the_name(conn: psycopg.Connection) -> None:
    """A run cut off between acquire and release leaves the name held: free it for the next run."""
    conn.execute(
        "SELECT pglockkit.release_lease(name, holder, token) FROM pglockkit.lease_status"
        " WHERE name = %s AND live",
        (ONE_NAME,),
    )
    conn.execute("UPDATE bench_bare_leases SET expires_at = clock_timestamp() WHERE name = %s", (ONE_NAME,))


# What a release of either design looks like in pg_stat_activity.query.
RELEASES = "query LIKE '%release_lease%' OR query LIKE 'UPDATE bench_bare_leases%'"


def _sample_release_waits(dsn: str, stop: threading.Event, out: dict[str, int]) -> None:
    """Until ``stop``: every 5 ms, count pgbench's releases in flight, and those waiting for a
    heavyweight lock (a row's tuple lock or another transaction's end: behind another client)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(0.005):
            active, waiting = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE wait_event_type = 'Lock') FROM pg_stat_activity"
                f" WHERE application_name = 'pgbench' AND state = 'active' AND ({RELEASES})"
            ).fetchone()
            out["active"] += active
            out["waiting"] += waiting


def run_one_name(
    pgbench: str, dsn: str, design: str, clients: int, seconds: int, pause_ms: float, sample: bool = False
) -> tuple[float, float, float | None]:
    """One pgbench run of ``design`` with every client on one name; returns (cycles/s, attempts/s,
    the share of releases in flight found waiting for a lock if ``sample``, else None)."""
    literals = {"spread": "0", "miss_pause_us": str(round(pause_ms * 1000))}
    env = {**os.environ, "PGOPTIONS": f"{os.environ.get('PGOPTIONS', '')} -c track_functions=pl".strip()}
    waits = {"active": 0, "waiting": 0}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_release_waits, args=(dsn, stop, waits))
    with psycopg.connect(dsn, autocommit=True) as conn:
        _free_the_name(conn)
        before = _cycles(conn, design)
        if sample:
            sampler.start()
        try:
            attempts = run_pgbench(pgbench, dsn, SCRIPTS[design], clients, seconds, literals, env)
        finally:
            stop.set()
            if sample:
                sampler.join()
        # pgbench's sessions report their function counts as they exit: wait until they are in.
        after, deadline = _cycles(conn, design), time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.2)
            settled = _cycles(conn, design)
            if settled == after:
                break
            after = settled
    share = waits["waiting"] / waits["active"] if sample and waits["active"] else None
    return (after - before) / seconds, attempts, share


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    """Measure with parsed ``args``; returns the JSON document, with the report under "markdown"."""
    pgbench = find_pgbench()
    pauses = [float(p) for p in args.miss_pause_ms.split(",")]
    pglockkit.install(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(BASELINE_SETUP)
        version = conn.execute("SHOW server_version").fetchone()[0]
    each = []
    for clients in args.clients:
        latencies = []
        for r in range(args.runs):
            means = run_pgbench_mixed(
                pgbench,
                dsn,
                list(SCRIPTS.values()),
                clients,
                args.seconds,
                {"spread": "1", "miss_pause_us": "0"},
            )
            latencies.append(dict(zip(SCRIPTS, means, strict=True)))
            print(
                f"[lease pgbench] a name each, clients={clients} run {r + 1}: {latencies[-1]}",
                file=sys.stderr,
            )
        each.append(
            {
                "clients": clients,
                "latency_us": latencies,
                "ratio": statistics.median(x["bare upsert"] / x["pglockkit"] for x in latencies),
            }
        )
    one = []
    for clients in args.one_name_clients:
        for pause in pauses:
            rates: dict[str, list[tuple[float, float]]] = {d: [] for d in SCRIPTS}
            waits: dict[str, list[float]] = {d: [] for d in SCRIPTS}
            for r in range(args.runs):
                for design in list(SCRIPTS) if r % 2 == 0 else list(SCRIPTS)[::-1]:
                    cycles, attempts, share = run_one_name(
                        pgbench, dsn, design, clients, args.seconds, pause, args.sample_waits
                    )
                    rates[design].append((cycles, attempts))
                    if share is not None:
                        waits[design].append(share)
                    print(
                        f"[lease pgbench] one name, clients={clients} pause={pause} ms run {r + 1} {design}: "
                        f"{cycles:,.0f} cycles/s, {attempts:,.0f} attempts/s"
                        + ("" if share is None else f", releases waiting for a lock {share:.0%}"),
                        file=sys.stderr,
                    )
            kit = statistics.median(c for c, _ in rates["pglockkit"])
            bare = statistics.median(c for c, _ in rates["bare upsert"])
            one.append(
                {
                    "clients": clients,
                    "miss_pause_ms": pause,
                    "runs": rates,
                    "release_lock_waits": waits if args.sample_waits else None,
                    "ratio": kit / bare if bare else None,
                }
            )
    env = environment("bench.lease_pgbench", argv, target_name, version)
    env["pgbench"] = pgbench_version(pgbench)
    return {
        "environment": env,
        "a_name_each": each,
        "one_name": one,
        "markdown": render_markdown(env, args, each, one),
    }


def render_markdown(env: dict[str, Any], args: argparse.Namespace, each: list[dict], one: list[dict]) -> str:
    lines = [
        "# pgbench: lease acquire + release, pglockkit vs a bare upsert",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']}); {env['pgbench']}",
        f"- machine: {env['platform']}, {env['cpu']}, nproc {env['nproc']}",
        f"- settings: pgbench -M prepared -T {args.seconds} per run, {args.runs} runs",
        "",
        "A name each (both scripts in one run): ratio = bare mean latency / pglockkit's (1.0 = as fast).",
        "",
        "| clients | pglockkit us | bare upsert us | ratio |",
        "|--:|--:|--:|--:|",
    ]
    for r in each:
        kit = [x["pglockkit"] for x in r["latency_us"]]
        bare = [x["bare upsert"] for x in r["latency_us"]]
        lines.append(f"| {r['clients']} | {spread(kit, '.1f')} | {spread(bare, '.1f')} | {r['ratio']:.2f} |")
    lines += [
        "",
        "One name (a run per design): cycles/s = acquisitions released, attempts/s = acquire calls.",
        "",
        "| clients | pause after a miss | pglockkit cycles/s | bare cycles/s | ratio "
        "| attempts/s, pglockkit vs bare |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for r in one:
        kit, bare = r["runs"]["pglockkit"], r["runs"]["bare upsert"]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        attempts = [statistics.median(a for _, a in x) for x in (kit, bare)]
        lines.append(
            f"| {r['clients']} | {r['miss_pause_ms']:g} ms | {spread([c for c, _ in kit])} "
            f"| {spread([c for c, _ in bare])} | {ratio} | {attempts[0]:,.0f} vs {attempts[1]:,.0f} |"
        )
    sampled = [r for r in one if r.get("release_lock_waits")]
    if sampled:
        lines += [
            "",
            "Releases in flight found waiting for a lock (pg_stat_activity every 5 ms: a row's tuple lock",
            "or another transaction's end, i.e. behind another client), median of the runs:",
            "",
            "| clients | pause after a miss | pglockkit | bare upsert |",
            "|--:|--:|--:|--:|",
        ]
        for r in sampled:
            shares = [statistics.median(r["release_lock_waits"][d] or [0.0]) for d in SCRIPTS]
            lines.append(
                f"| {r['clients']} | {r['miss_pause_ms']:g} ms | {shares[0]:.0%} | {shares[1]:.0%} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    sys.exit(main())
