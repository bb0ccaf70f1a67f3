"""Overhead of pglockkit's advisory-lock helpers over the bare PostgreSQL functions they wrap.

What is measured
----------------
1. Round trips. Each iteration is one transaction on an ``autocommit=False`` psycopg 3
   connection: one statement, then COMMIT. Every client thread has its own connection and its own
   resources, so no call ever waits for a lock: this measures call overhead, not contention.

   Each pglockkit statement is compared with a baseline taking the same lock keys, precomputed
   in Python with ``pglockkit.lock_key``:

   - ``pglockkit.xact_lock('bench', %s)`` vs ``pg_advisory_xact_lock(%s)``;
   - ``pglockkit.try_xact_lock('bench', %s)`` vs the same ``pg_advisory_xact_lock(%s)`` runs;
   - ``pglockkit.xact_lock_all('bench', %s::text[])`` with 4 resources vs
     ``SELECT pg_advisory_xact_lock(k) FROM unnest(%s::bigint[]) k`` with their 4 keys;
   - the Python helper ``pglockkit.xact_lock(conn, 'bench', resource)`` vs
     ``conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))``: what a Python caller pays for
     naming a lock. The helper computes the key locally from the namespace id it caches per
     process and sends one statement that, for a free lock, costs the server one
     ``pg_try_advisory_xact_lock``; the baseline's keys
     are precomputed, so it costs only the call. Both sides go through psycopg's
     ``conn.execute`` (a cursor per call), as a caller's code would;
   - the same for ``pglockkit.xact_lock_all(conn, 'bench', resources)`` with 4 resources (their
     keys computed locally and tried in one statement) vs ``conn.execute`` of the 4 bare locks.

   For every client count, each statement runs ``--runs`` times for ``--seconds``; within a run
   the baseline and the pglockkit statements alternate (in a rotated order from run to run), so
   drift of the machine hits both sides. Reported: median ops/s with min-max, the throughput
   ratio pglockkit/baseline of the medians (1.0 = no overhead; the range of the per-run paired
   ratios shows the noise), and the overhead per transaction in microseconds as one client sees
   it, ``clients / ops_s(pglockkit) - clients / ops_s(baseline)``.

2. Server side, no round trips. One statement takes N locks in one transaction, rolled back::

       SELECT count(pglockkit.xact_lock('bench', 'r' || g)) FROM generate_series(1, N) g
       SELECT count(pg_advisory_xact_lock(<bench key base> + g)) FROM generate_series(1, N) g

   N is kept well inside the shared lock table (``max_locks_per_transaction * max_connections``,
   6400 slots on a default server), at most 2000, and the statement is repeated until about 20000
   calls per side. Reported: microseconds per call, the cost ratio pglockkit/baseline (1.0 = no
   overhead; higher is worse) and the overhead per call. Each timing includes one round trip per
   statement, spread over its N calls (well under 0.1 us per call on a local server).

Only ratios and differences measured in the same run are meaningful; absolute numbers depend on
the machine. Transactions that take only advisory locks write no WAL, so disk speed plays no part.
With several clients the Python client threads share the GIL and the CPUs with the server, which
dilutes the round-trip ratios towards 1.0; the server-side section is free of that.

Reproduce
---------
::

    pip install -e '.[dev,embedded]'
    python -m bench.lock_overhead --embedded --seconds 3 --runs 3
    python -m bench.lock_overhead --dsn postgresql://user@host/db   # installs pglockkit if missing

Without ``--dsn`` or ``--embedded`` the DSN is ``$PGLOCKKIT_DSN``, else libpq's ``PG*`` variables.
The defaults (2 s per run, clients 1 and 4, 3 runs: 7 statements x 2 x 3 runs) take about 90 s.

The markdown report goes to stdout, the full results (every run) to
``bench/results/lock_overhead.json``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, environment, int_list, positive, report, spread, target

NAMESPACE = "bench"
RESULTS_PATH = Path(__file__).resolve().parent / "results" / "lock_overhead.json"
WARMUP_ITERATIONS = 50  # per client before each timed run: plans prepared, caches warm
BARRIER_TIMEOUT_S = 60.0
SERVER_SIDE_CALLS = 20_000  # per side, in total
SERVER_SIDE_MAX_BATCH = 2_000  # locks held at once by one statement
APPLICATION_NAME = "pglockkit bench lock_overhead"

Params = tuple[Any, ...]


def _execute(conn: psycopg.Connection, cur: psycopg.Cursor, sql: str, params: Params) -> None:
    cur.execute(sql, params)


@dataclass(frozen=True)
class Statement:
    """One SQL statement (or Python call) run once per transaction, with per-client parameters."""

    label: str
    sql: str
    params: Callable[[int, int], Params]  # (client index, namespace id) -> bound parameters
    # How one transaction's statement runs: by default ``sql`` on the client's one cursor.
    run: Callable[[psycopg.Connection, psycopg.Cursor, str, Params], None] = _execute


@dataclass(frozen=True)
class Workload:
    """A baseline statement and the pglockkit statements compared with it."""

    name: str
    baseline: Statement
    candidates: tuple[Statement, ...]


@dataclass
class Comparison:
    """Round-trip results of one pglockkit statement against its baseline at one client count."""

    workload: str
    statement: str
    baseline: str
    clients: int
    baseline_ops_s: list[float]
    pglockkit_ops_s: list[float]
    baseline_median: float
    pglockkit_median: float
    ratio: float  # throughput, pglockkit / baseline, of the medians
    run_ratio_min: float  # of the per-run paired ratios
    run_ratio_max: float
    overhead_us_per_txn: float


@dataclass
class ServerSide:
    """Server-side cost of many lock calls in one statement."""

    batch: int
    statements: int
    baseline_us_per_call: list[float]
    pglockkit_us_per_call: list[float]
    baseline_median: float
    pglockkit_median: float
    cost_ratio: float  # pglockkit / baseline time per call
    overhead_us_per_call: float


def _resource(client: int) -> str:
    return f"client-{client}"


def _resources(client: int, count: int = 4) -> list[str]:
    return [f"client-{client}.{i}" for i in range(count)]


def workloads() -> list[Workload]:
    """The round-trip workloads; every client locks resources of its own."""
    one_key = Statement(
        "pg_advisory_xact_lock(bigint)",
        "SELECT pg_advisory_xact_lock(%s)",
        lambda c, ns_id: (pglockkit.lock_key(ns_id, _resource(c)),),
    )
    four_keys = Statement(
        "4 x pg_advisory_xact_lock(bigint)",
        "SELECT pg_advisory_xact_lock(k) FROM unnest(%s::bigint[]) k",
        lambda c, ns_id: ([pglockkit.lock_key(ns_id, r) for r in _resources(c)],),
    )
    return [
        Workload(
            "single lock",
            one_key,
            (
                Statement(
                    "pglockkit.xact_lock(ns, text)",
                    f"SELECT pglockkit.xact_lock('{NAMESPACE}', %s)",
                    lambda c, _ns_id: (_resource(c),),
                ),
                Statement(
                    "pglockkit.try_xact_lock(ns, text)",
                    f"SELECT pglockkit.try_xact_lock('{NAMESPACE}', %s)",
                    lambda c, _ns_id: (_resource(c),),
                ),
            ),
        ),
        Workload(
            "Python helper",
            Statement(
                "conn.execute(pg_advisory_xact_lock(key))",
                "SELECT pg_advisory_xact_lock(%s)",
                lambda c, ns_id: (pglockkit.lock_key(ns_id, _resource(c)),),
                lambda conn, _cur, sql, params: conn.execute(sql, params),
            ),
            (
                Statement(
                    "pglockkit.xact_lock(conn, ns, text)",
                    "",
                    lambda c, _ns_id: (_resource(c),),
                    lambda conn, _cur, _sql, params: pglockkit.xact_lock(conn, NAMESPACE, *params),
                ),
            ),
        ),
        Workload(
            "4 locks",
            four_keys,
            (
                Statement(
                    "pglockkit.xact_lock_all(ns, text[4])",
                    f"SELECT pglockkit.xact_lock_all('{NAMESPACE}', %s::text[])",
                    lambda c, _ns_id: (_resources(c),),
                ),
            ),
        ),
        Workload(
            "Python helper, 4 locks",
            Statement(
                "conn.execute(4 x pg_advisory_xact_lock(key))",
                four_keys.sql,
                four_keys.params,
                lambda conn, _cur, sql, params: conn.execute(sql, params),
            ),
            (
                Statement(
                    "pglockkit.xact_lock_all(conn, ns, text[4])",
                    "",
                    lambda c, _ns_id: (_resources(c),),
                    lambda conn, _cur, _sql, params: pglockkit.xact_lock_all(conn, NAMESPACE, *params),
                ),
            ),
        ),
    ]


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


def _connect(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=False, application_name=APPLICATION_NAME)


def _client(
    conn: psycopg.Connection,
    stmt: Statement,
    params: Params,
    seconds: float,
    barrier: threading.Barrier,
    rates: list[float],
    index: int,
) -> None:
    """Warm up, wait for every client, then run transactions for ``seconds``; store ops/s."""
    run, sql = stmt.run, stmt.sql
    try:
        with conn.cursor() as cur:
            for _ in range(WARMUP_ITERATIONS):
                run(conn, cur, sql, params)
                conn.commit()
            barrier.wait(BARRIER_TIMEOUT_S)
            ops = 0
            started = time.perf_counter()
            deadline = started + seconds
            now = started
            while now < deadline:
                run(conn, cur, sql, params)
                conn.commit()
                ops += 1
                now = time.perf_counter()
            rates[index] = ops / (now - started)
    except BaseException:
        barrier.abort()
        raise


def measure(conns: Sequence[psycopg.Connection], stmt: Statement, ns_id: int, seconds: float) -> float:
    """Total ops/s of ``stmt`` with one thread per connection, all starting together."""
    barrier = threading.Barrier(len(conns))
    rates = [math.nan] * len(conns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            _client(conns[i], stmt, stmt.params(i, ns_id), seconds, barrier, rates, i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(conns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return sum(rates)


def _rotated(items: Sequence[Statement], by: int) -> list[Statement]:
    shift = by % len(items)
    return list(items[shift:]) + list(items[:shift])


def _compare(workload: Workload, stmt: Statement, clients: int, rates: dict[str, list[float]]) -> Comparison:
    base, cand = rates[workload.baseline.label], rates[stmt.label]
    base_med, cand_med = statistics.median(base), statistics.median(cand)
    paired = [c / b for b, c in zip(base, cand, strict=True)]
    return Comparison(
        workload=workload.name,
        statement=stmt.label,
        baseline=workload.baseline.label,
        clients=clients,
        baseline_ops_s=base,
        pglockkit_ops_s=cand,
        baseline_median=base_med,
        pglockkit_median=cand_med,
        ratio=cand_med / base_med,
        run_ratio_min=min(paired),
        run_ratio_max=max(paired),
        overhead_us_per_txn=(clients / cand_med - clients / base_med) * 1e6,
    )


def round_trips(
    dsn: str, ns_id: int, clients: int, seconds: float, runs: int, log: Callable[[str], None]
) -> list[Comparison]:
    """Every workload at one client count, baseline and pglockkit runs interleaved."""
    conns = [_connect(dsn) for _ in range(clients)]
    try:
        rates: dict[tuple[str, str], list[float]] = {}
        for run in range(runs):
            for workload in workloads():
                for stmt in _rotated([workload.baseline, *workload.candidates], run):
                    ops_s = measure(conns, stmt, ns_id, seconds)
                    rates.setdefault((workload.name, stmt.label), []).append(ops_s)
                    log(f"clients={clients} run={run + 1}/{runs} {stmt.label}: {ops_s:,.0f} ops/s")
    finally:
        for conn in conns:
            conn.close()
    results = []
    for workload in workloads():
        per_stmt = {
            s.label: rates[(workload.name, s.label)] for s in (workload.baseline, *workload.candidates)
        }
        results.extend(_compare(workload, stmt, clients, per_stmt) for stmt in workload.candidates)
    return results


# ---------------------------------------------------------------------------------------------
# Server side
# ---------------------------------------------------------------------------------------------

SERVER_BASELINE_SQL = "SELECT count(pg_advisory_xact_lock(%s::int8 + g)) FROM generate_series(1, %s) g"
SERVER_PGLOCKKIT_SQL = (
    f"SELECT count(pglockkit.xact_lock('{NAMESPACE}', 'r' || g)) FROM generate_series(1, %s) g"
)


def _setting(conn: psycopg.Connection, name: str) -> int:
    row = conn.execute("SELECT current_setting(%s)::int", (name,)).fetchone()
    conn.rollback()
    return row[0]


def server_batch(conn: psycopg.Connection) -> int:
    """Locks one statement may hold: a quarter of the shared lock table, at most 2000, at least 100.

    The lock table has ``max_locks_per_transaction * (max_connections + max_prepared_transactions)``
    slots shared by every session; filling it would make other sessions fail, so stay well inside.
    """
    slots = _setting(conn, "max_locks_per_transaction") * (
        _setting(conn, "max_connections") + _setting(conn, "max_prepared_transactions")
    )
    return max(100, min(SERVER_SIDE_MAX_BATCH, slots // 4))


def _time_statement(conn: psycopg.Connection, sql: str, params: Params, calls: int) -> float:
    """Microseconds per call of one statement making ``calls`` lock calls; rolled back."""
    started = time.perf_counter()
    count = conn.execute(sql, params).fetchone()[0]
    elapsed = time.perf_counter() - started
    conn.rollback()
    if count != calls:
        raise RuntimeError(f"expected {calls} lock calls, the statement made {count}")
    return elapsed / calls * 1e6


def server_side(dsn: str, ns_id: int, runs: int) -> ServerSide:
    """Per-call cost of the lock functions inside one statement, interleaved, rolled back."""
    with _connect(dsn) as conn:
        batch = server_batch(conn)
        statements = max(runs, math.ceil(SERVER_SIDE_CALLS / batch))
        sides = {
            "baseline": (SERVER_BASELINE_SQL, (pglockkit.lock_key(ns_id, 0), batch)),
            "pglockkit": (SERVER_PGLOCKKIT_SQL, (batch,)),
        }
        for sql, params in sides.values():  # warm-up, not recorded
            _time_statement(conn, sql, params, batch)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(statements):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                sql, params = sides[name]
                times[name].append(_time_statement(conn, sql, params, batch))
    base_med = statistics.median(times["baseline"])
    cand_med = statistics.median(times["pglockkit"])
    return ServerSide(
        batch=batch,
        statements=statements,
        baseline_us_per_call=times["baseline"],
        pglockkit_us_per_call=times["pglockkit"],
        baseline_median=base_med,
        pglockkit_median=cand_med,
        cost_ratio=cand_med / base_med,
        overhead_us_per_call=cand_med - base_med,
    )


# ---------------------------------------------------------------------------------------------
# Setup, environment, report
# ---------------------------------------------------------------------------------------------


def prepare(dsn: str) -> tuple[int, str]:
    """Install pglockkit (idempotent), register the namespace; returns (namespace id, server version)."""
    pglockkit.install(dsn)
    with psycopg.connect(dsn, autocommit=True, application_name=APPLICATION_NAME) as conn:
        ns_id = conn.execute("SELECT pglockkit.register_namespace(%s)", (NAMESPACE,)).fetchone()[0]
        version = conn.execute("SELECT version()").fetchone()[0]
    return ns_id, version


def render_markdown(
    env: dict[str, Any], settings: dict[str, Any], rows: list[Comparison], server: ServerSide
) -> str:
    """The report: environment, round-trip table, server-side table."""
    lines = [
        "# pglockkit lock overhead",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']})",
        f"- machine: {env['platform']}, {env['machine']}, nproc {env['nproc']}",
        f"- client: Python {env['python']}, psycopg {env['psycopg']}, pglockkit {env['pglockkit']}",
        f"- settings: {settings['seconds']:g} s per run, {settings['runs']} runs, "
        f"clients {','.join(map(str, settings['clients']))}, baseline and pglockkit runs interleaved",
        "",
        "## One transaction per iteration (statement + COMMIT), no contention",
        "",
        "Throughput ratio pglockkit/baseline of the medians: 1.0 = no overhead, lower is worse. "
        "In brackets, the range of the per-run paired ratios. Overhead: extra microseconds per "
        "transaction as one client sees it.",
        "",
        "| pglockkit call | baseline | clients | baseline ops/s median (min-max) "
        "| pglockkit ops/s median (min-max) | ratio (per-run range) | overhead µs/txn |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.statement}` | `{r.baseline}` | {r.clients} "
            f"| {spread(r.baseline_ops_s, ',.0f')} | {spread(r.pglockkit_ops_s, ',.0f')} "
            f"| {r.ratio:.3f} ({r.run_ratio_min:.3f}-{r.run_ratio_max:.3f}) | {r.overhead_us_per_txn:+.1f} |"
        )
    lines += [
        "",
        f"## Server side: {server.batch} lock calls in one statement, no round trips "
        f"({server.statements} statements per side, rolled back)",
        "",
        "Cost ratio pglockkit/baseline of the median time per call: 1.0 = no overhead, higher is worse.",
        "",
        "| pglockkit call | baseline | baseline µs/call median (min-max) "
        "| pglockkit µs/call median (min-max) | cost ratio | overhead µs/call |",
        "|---|---|--:|--:|--:|--:|",
        f"| `pglockkit.xact_lock('{NAMESPACE}', 'r' \\|\\| g)` | `pg_advisory_xact_lock(base + g)` "
        f"| {spread(server.baseline_us_per_call, '.3f')} | {spread(server.pglockkit_us_per_call, '.3f')} "
        f"| {server.cost_ratio:.2f} | {server.overhead_us_per_call:+.2f} |",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lock_overhead",
        description="Overhead of pglockkit.xact_lock & co. over bare pg_advisory_xact_lock, as ratios.",
    )
    add_target_arguments(parser)
    parser.add_argument("--seconds", type=positive(float), default=2.0, help="length of one run (default 2)")
    parser.add_argument("--clients", type=int_list, default=[1, 4], help="client counts (default 1,4)")
    parser.add_argument("--runs", type=positive(int), default=3, help="runs per statement (default 3)")
    parser.add_argument(
        "--output", type=Path, default=RESULTS_PATH, help=f"JSON path (default {RESULTS_PATH})"
    )
    return parser


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    """Measure with parsed ``args``; returns the JSON document, with the report under "markdown"."""
    ns_id, version = prepare(dsn)
    settings = {"seconds": args.seconds, "runs": args.runs, "clients": args.clients, "namespace_id": ns_id}
    rows: list[Comparison] = []
    for clients in args.clients:
        rows.extend(round_trips(dsn, ns_id, clients, args.seconds, args.runs, _log))
    _log("server side ...")
    server = server_side(dsn, ns_id, args.runs)
    env = environment("bench.lock_overhead", argv, target_name, version)
    return {
        "environment": env,
        "settings": settings,
        "round_trips": [asdict(r) for r in rows],
        "server_side": asdict(server),
        "markdown": render_markdown(env, settings, rows, server),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    sys.exit(main())
