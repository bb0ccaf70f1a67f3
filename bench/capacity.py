"""What one PostgreSQL primary carries: named locks, leases and jobs per second under pgbench, by
client count, with synchronous_commit on and off, and what ran out (CPU or the WAL flush).

What is measured
----------------
pgbench (a C client: no Python in the way, a server process per client) runs one script at a
time, each client on a resource of its own (no client waits for another), ``-M prepared``, ``-j``
= min(clients, nproc):

- ``pg_advisory_xact_lock``: ``bench/pgbench/advisory_xact_lock.sql``, the bare lock on a key of
  the client's own, one autocommit statement per transaction: the baseline of
- ``pglockkit.xact_lock``: ``bench/pgbench/xact_lock.sql``, ``pglockkit.xact_lock('bench',
  :client_id::text)`` (the namespace registered first), measured next to it at every client count
  and setting: ratio = its tps / the bare lock's. Neither writes WAL (a read-only transaction has
  no xid, its commit flushes nothing), so synchronous_commit should not matter to them;
- ``lease``: ``bench/pgbench/lease.sql`` as ``bench.lease_pgbench`` runs it for a name each
  (``:spread`` 1): ``acquire_lease`` then ``release_lease`` of the client's own name, one autocommit
  statement each. One tps = one cycle = two commits that write WAL;
- ``job``: ``bench/pgbench/job.sql``, ``claim_job('bench_capacity', worker)`` then
  ``complete_job(id, token)``, one autocommit statement each. One tps = one job = two commits. The
  queue is filled before every run (``enqueue_jobs`` with ``array_fill``) to 1.5 times the jobs a
  run could take at the highest rate seen so far (first estimated by a 1 s run with
  synchronous_commit off at nproc clients, or the sweep's largest count if smaller: where a
  sweep peaks when CPU is the limit), done jobs pruned and the table vacuumed in between. A
  run that empties the queue is run again once on a queue twice as big; if that runs dry too, the
  report says so (its tps then counts empty claims).

Each runs with ``synchronous_commit`` on and off, set for pgbench's sessions through
``PGOPTIONS=-c synchronous_commit=...``: with on, every writing commit waits for its WAL to be
flushed (several commits in flight share a flush: group commit), with off it does not (the WAL
writer flushes every ``wal_writer_delay``), which leaves CPU as the limit. Client counts
``--clients`` (default 1,2,4,8,16,32,64), ``--runs`` runs of ``--seconds`` seconds per client count,
the 8 (script, setting) pairs in an order rotated run by run.

For every run it also records:

- CPU: the whole machine's busy share (``/proc/stat``: all but idle and iowait, 100% = every CPU),
  from 1 s after pgbench starts (or a quarter of the run, if shorter) to ``--seconds`` after it
  started, and iowait; and pgbench's own CPU (``getrusage`` of the child) as a share of the
  machine. The server's share is roughly the difference; it is the server's only when the server
  runs on this machine (the embedded one does, with pgbench beside it). A machine shared with
  other work shows their CPU too: the report gives the machine's busy share before the runs;
- WAL: fsyncs of WAL per second of the run and per transaction (PostgreSQL 18: ``pg_stat_io``,
  object ``wal``; 14-17: ``pg_stat_wal.wal_sync``), WAL bytes per transaction (``pg_stat_wal``),
  read once pgbench's backends have exited (they report their counts as they exit);
- connections: pgbench's and the server's client backends half-way through the run, against
  ``max_connections`` (a client count that would not fit is skipped).

Saturation point: per workload and setting, the smallest client count whose tps is within 10% of
the highest tps of the sweep (past it, tps stops growing). What limited it there: CPU if the
machine was >= 90% busy; the WAL flush if, with synchronous_commit on, the same client count ran
>= 1.25 times faster with it off; both if both hold (waiting for a flush costs CPU too: a sleep and
a wake-up per commit); else neither (contention, or the client).

Reproduce: ``python -m bench.capacity --embedded`` (or ``--dsn DSN``); about 5 minutes with the
defaults on 2 cores. The report goes to stdout and ``bench/results/capacity.md``, every run to
``capacity.json`` beside it. It deletes its jobs (queue ``bench_capacity``) at the end; pruning
needs nothing special, the ``VACUUM`` between runs needs the table's owner (else it is skipped with
a warning).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, environment, int_list, nproc, positive, report, spread, target
from bench.pgbench_compare import find_pgbench, pgbench_version, run_pgbench

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "capacity.json"
NAMESPACE = "bench"
QUEUE = "bench_capacity"  # as written in bench/pgbench/job.sql
BASELINE, LOCK, LEASE, JOB = "pg_advisory_xact_lock", "pglockkit.xact_lock", "lease", "job"
# workload -> (script in bench/pgbench/, literals written in)
WORKLOADS: dict[str, tuple[str, dict[str, str]]] = {
    BASELINE: ("advisory_xact_lock.sql", {}),
    LOCK: ("xact_lock.sql", {}),
    LEASE: ("lease.sql", {"spread": "1", "miss_pause_us": "0"}),  # a name each, as bench.lease_pgbench
    JOB: ("job.sql", {}),
}
SYNC = ("on", "off")
CPU_BOUND = 0.9  # machine busy share at which CPU is the limit
WAL_BOUND = 1.25  # synchronous_commit off / on tps at which the WAL flush is the limit
PLATEAU = 0.9  # a client count within 10% of the peak tps has reached it


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# What a run costs the machine and the server
# ---------------------------------------------------------------------------------------------


def _cpu_times() -> list[int] | None:
    """The machine's CPU times (``/proc/stat``: user nice system idle iowait irq softirq steal),
    or None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    return [int(v) for v in fields[1:9]]


def _cpu_use(before: list[int] | None, after: list[int] | None) -> dict[str, float] | None:
    """Shares of the machine's CPU time between two ``_cpu_times``: busy (all but idle and
    iowait), iowait, steal."""
    if before is None or after is None:
        return None
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta)
    if total <= 0:
        return None
    idle, iowait, steal = delta[3], delta[4], delta[7]
    return {"busy": (total - idle - iowait) / total, "iowait": iowait / total, "steal": steal / total}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wal_counters(conn: psycopg.Connection, version_num: int) -> dict[str, float | None]:
    """The server's WAL fsyncs (None before PostgreSQL 14), bytes and full-page images so far."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    if version_num < 140000:
        return {"fsyncs": None, "bytes": None, "fpi": None}
    records = conn.execute("SELECT wal_bytes, wal_fpi FROM pg_stat_wal").fetchone()
    if version_num >= 180000:  # the WAL's I/O moved to pg_stat_io
        fsyncs = conn.execute("SELECT sum(fsyncs) FROM pg_stat_io WHERE object = 'wal'").fetchone()[0]
    else:
        fsyncs = conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()[0]
    return {"fsyncs": float(fsyncs or 0), "bytes": float(records[0]), "fpi": float(records[1])}


CONNECTIONS = (
    "SELECT count(*) FILTER (WHERE application_name = 'pgbench'), count(*)"
    " FROM pg_stat_activity WHERE backend_type = 'client backend'"
)


def _watch(
    conn: psycopg.Connection, launched: float, seconds: float, stop: threading.Event, out: dict
) -> None:
    """During a run: the machine's CPU times at its start and end (see the module docstring), and
    the connections half-way."""
    if stop.wait(max(0.0, launched + min(1.0, seconds / 4) - time.monotonic())):
        return  # pgbench failed at once
    out["cpu"].append(_cpu_times())
    if not stop.wait(max(0.0, launched + seconds / 2 - time.monotonic())):
        out["pgbench_connections"], out["server_connections"] = conn.execute(CONNECTIONS).fetchone()
    stop.wait(max(0.0, launched + seconds - time.monotonic()))  # ended early: its end, then
    out["cpu"].append(_cpu_times())


def _settle(conn: psycopg.Connection) -> None:
    """Wait until pgbench's backends have exited (and reported their WAL counts), then for the WAL
    writer's report (every wal_writer_delay, 200 ms by default)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgbench'"
        ).fetchone()[0]
        if not left:
            break
        time.sleep(0.05)
    time.sleep(0.25)


def one_run(
    pgbench: str,
    dsn: str,
    conn: psycopg.Connection,
    version_num: int,
    workload: str,
    clients: int,
    seconds: int,
    sync: str,
) -> dict[str, Any]:
    """One pgbench run of ``workload``; returns its tps and what it cost."""
    script, literals = WORKLOADS[workload]
    options = f"{os.environ.get('PGOPTIONS', '')} -c synchronous_commit={sync}".strip()
    env = {**os.environ, "PGOPTIONS": options}
    watched: dict[str, Any] = {"cpu": [], "pgbench_connections": None, "server_connections": None}
    stop = threading.Event()
    wal_before = wal_counters(conn, version_num)
    child_before = _children_cpu()
    launched = time.monotonic()
    watcher = threading.Thread(target=_watch, args=(conn, launched, seconds, stop, watched))
    watcher.start()
    try:
        tps = run_pgbench(pgbench, dsn, script, clients, seconds, literals, env)
    finally:
        stop.set()
        watcher.join()
    wall = time.monotonic() - launched
    client_cpu = _children_cpu() - child_before
    _settle(conn)
    wal_after = wal_counters(conn, version_num)
    cpu = _cpu_use(*watched["cpu"]) if len(watched["cpu"]) == 2 else None
    transactions = tps * seconds
    wal: dict[str, float | None] = {}
    for name in ("fsyncs", "bytes", "fpi"):
        a, b = wal_before[name], wal_after[name]
        wal[name] = None if a is None or b is None else b - a
    return {
        "workload": workload,
        "sync_commit": sync,
        "clients": clients,
        "tps": tps,
        "cpu": cpu,
        "pgbench_cpu": client_cpu / (wall * nproc()),
        "wal_fsyncs": wal["fsyncs"],
        "wal_fsyncs_s": None if wal["fsyncs"] is None else wal["fsyncs"] / seconds,
        "wal_fsyncs_per_tx": None
        if wal["fsyncs"] is None or not transactions
        else wal["fsyncs"] / transactions,
        "wal_bytes_per_tx": None if wal["bytes"] is None or not transactions else wal["bytes"] / transactions,
        "wal_fpi": wal["fpi"],
        "pgbench_connections": watched["pgbench_connections"],
        "server_connections": watched["server_connections"],
    }


# ---------------------------------------------------------------------------------------------
# The job queue
# ---------------------------------------------------------------------------------------------


def _queued(conn: psycopg.Connection) -> int:
    return conn.execute(
        "SELECT count(*) FROM pglockkit.jobs WHERE queue = %s AND status = 'queued'", (QUEUE,)
    ).fetchone()[0]


def _completed(conn: psycopg.Connection) -> int:
    return conn.execute(
        "SELECT count(*) FROM pglockkit.jobs WHERE queue = %s AND status = 'done'", (QUEUE,)
    ).fetchone()[0]


def fill_queue(conn: psycopg.Connection, size: int) -> int:
    """Done jobs pruned, the table vacuumed, the queue topped up to ``size`` queued jobs; returns
    how many it holds."""
    conn.execute("SELECT pglockkit.prune_jobs(interval '0', %s)", (QUEUE,))
    have = _queued(conn)
    if have < size:
        conn.execute(
            "SELECT pglockkit.enqueue_jobs(%s, array_fill('{}'::jsonb, ARRAY[%s::integer]))",
            (QUEUE, size - have),
        )
    conn.execute("VACUUM (ANALYZE) pglockkit.jobs")  # a WARNING, skipped, unless the owner
    return max(have, size)


def delete_jobs(conn: psycopg.Connection) -> None:
    conn.execute("DELETE FROM pglockkit.jobs WHERE queue = %s", (QUEUE,))


def queue_size(rate: float, seconds: int) -> int:
    """Jobs for a run of ``seconds`` at up to 1.5 times ``rate`` jobs/s."""
    return math.ceil(rate * seconds * 1.5) + 1000


def job_run(
    pgbench: str,
    dsn: str,
    conn: psycopg.Connection,
    version_num: int,
    clients: int,
    seconds: int,
    sync: str,
    rate: float,
) -> dict[str, Any]:
    """A job run on a queue sized for ``rate`` jobs/s; again once, on a queue twice as big, if it
    ran dry. Returns the run, with its queue's size, the jobs completed and whether it ran dry."""
    size = queue_size(rate, seconds)
    for attempt in (1, 2):
        filled = fill_queue(conn, size)
        result = one_run(pgbench, dsn, conn, version_num, JOB, clients, seconds, sync)
        completed, left = _completed(conn), _queued(conn)
        result["jobs"] = {"queued_before": filled, "completed": completed, "drained": left == 0}
        result["jobs"]["rerun"] = attempt == 2
        if left:
            break
        _log(f"[capacity] the queue ran dry ({filled:,} jobs): again with {2 * size:,}")
        size *= 2
    return result


def estimate_job_rate(
    pgbench: str, dsn: str, conn: psycopg.Connection, version_num: int, clients: int
) -> float:
    """Jobs/s of a 1 s run at ``clients`` with synchronous_commit off: what the queue is sized for."""
    probe = job_run(pgbench, dsn, conn, version_num, clients, 1, "off", 20000 / 1.5)
    return max(probe["tps"], probe["jobs"]["completed"])


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


def server_facts(conn: psycopg.Connection) -> dict[str, Any]:
    def setting(name: str) -> str | None:
        return conn.execute("SELECT current_setting(%s, true)", (name,)).fetchone()[0]

    superuser = setting("is_superuser") == "on"
    max_connections = int(setting("max_connections"))
    reserved = int(setting("superuser_reserved_connections") or 0) + int(setting("reserved_connections") or 0)
    return {
        "version": setting("server_version"),
        "version_num": int(setting("server_version_num")),
        "max_connections": max_connections,
        "reserved_connections": reserved,
        "superuser": superuser,
        "usable_connections": max_connections if superuser else max_connections - reserved,
        "synchronous_commit": setting("synchronous_commit"),
        "wal_sync_method": setting("wal_sync_method"),
        "fsync": setting("fsync"),
        "wal_writer_delay": setting("wal_writer_delay"),
        "commit_delay": setting("commit_delay"),
        "shared_buffers": setting("shared_buffers"),
        "local": (conn.info.host or "").startswith("/")
        or conn.info.host in ("localhost", "127.0.0.1", "::1"),
    }


def idle_cpu(seconds: float = 1.0) -> dict[str, float] | None:
    """The machine's CPU use with no run going: other work on it."""
    before = _cpu_times()
    time.sleep(seconds)
    return _cpu_use(before, _cpu_times())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--seconds", type=positive(int), default=5, help="pgbench -T per run (default 5)")
    parser.add_argument(
        "--runs", type=positive(int), default=1, help="runs per client count and workload (default 1)"
    )
    parser.add_argument(
        "--clients",
        type=int_list,
        default=[1, 2, 4, 8, 16, 32, 64],
        help="client counts (default 1,2,4,8,16,32,64)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    return parser


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    """Measure with parsed ``args``; returns the JSON document, with the report under "markdown"."""
    pgbench = find_pgbench()
    pglockkit.install(dsn)
    started = time.monotonic()
    load_start = os.getloadavg()
    background = idle_cpu()
    pairs = [(w, s) for s in SYNC for w in WORKLOADS]
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        server = server_facts(conn)
        version_num = server["version_num"]
        conn.execute("SELECT pglockkit.register_namespace(%s)", (NAMESPACE,))
        delete_jobs(conn)
        try:
            rate = estimate_job_rate(pgbench, dsn, conn, version_num, min(max(args.clients), nproc()))
            _log(f"[capacity] job rate estimate: {rate:,.0f}/s")
            for clients in args.clients:
                in_use = conn.execute(CONNECTIONS).fetchone()[1]
                if in_use + clients > server["usable_connections"]:
                    skipped.append(
                        {"clients": clients, "in_use": in_use, "usable": server["usable_connections"]}
                    )
                    _log(
                        f"[capacity] clients={clients}: skipped, {in_use} connections in use of "
                        f"{server['usable_connections']}"
                    )
                    continue
                for r in range(args.runs):
                    shift = r % len(pairs)
                    for workload, sync in pairs[shift:] + pairs[:shift]:
                        if workload == JOB:
                            got = job_run(pgbench, dsn, conn, version_num, clients, args.seconds, sync, rate)
                            rate = max(rate, got["tps"])
                        else:
                            got = one_run(
                                pgbench, dsn, conn, version_num, workload, clients, args.seconds, sync
                            )
                        got["run"] = r + 1
                        runs.append(got)
                        cpu = "-" if got["cpu"] is None else f"{got['cpu']['busy']:.0%}"
                        fsyncs = "-" if got["wal_fsyncs_s"] is None else f"{got['wal_fsyncs_s']:,.0f}"
                        _log(
                            f"[capacity] clients={clients} run {r + 1} {workload} sync {sync}: "
                            f"{got['tps']:,.0f} tps, CPU {cpu}, pgbench {got['pgbench_cpu']:.0%}, "
                            f"WAL fsyncs/s {fsyncs}"
                        )
        finally:
            delete_jobs(conn)
    rows = summarize(runs)
    saturation = saturation_points(rows)
    env = environment("bench.capacity", argv, target_name, server["version"])
    env["pgbench"] = pgbench_version(pgbench)
    env["load_start"] = load_start
    env["load_end"] = os.getloadavg()
    env["background_cpu"] = background
    env["seconds_total"] = round(time.monotonic() - started, 1)
    settings = {"seconds": args.seconds, "runs": args.runs, "clients": args.clients}
    return {
        "environment": env,
        "server": server,
        "settings": settings,
        "runs": runs,
        "skipped": skipped,
        "rows": rows,
        "saturation": saturation,
        "markdown": render_markdown(env, server, settings, rows, saturation, skipped),
    }


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, synchronous_commit, clients): medians of the runs."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["sync_commit"], r["clients"]), []).append(r)
    rows = []
    for (workload, sync, clients), group in groups.items():
        rows.append(
            {
                "workload": workload,
                "sync_commit": sync,
                "clients": clients,
                "tps": [r["tps"] for r in group],
                "median_tps": statistics.median(r["tps"] for r in group),
                "cpu_busy": _median([r["cpu"] and r["cpu"]["busy"] for r in group]),
                "cpu_iowait": _median([r["cpu"] and r["cpu"]["iowait"] for r in group]),
                "pgbench_cpu": _median([r["pgbench_cpu"] for r in group]),
                "wal_fsyncs_s": _median([r["wal_fsyncs_s"] for r in group]),
                "wal_fsyncs_per_tx": _median([r["wal_fsyncs_per_tx"] for r in group]),
                "wal_bytes_per_tx": _median([r["wal_bytes_per_tx"] for r in group]),
                "pgbench_connections": max((r["pgbench_connections"] or 0) for r in group),
                "server_connections": max((r["server_connections"] or 0) for r in group),
                "drained": any(r.get("jobs", {}).get("drained") for r in group),
            }
        )
    rows.sort(
        key=lambda r: (list(WORKLOADS).index(r["workload"]), SYNC.index(r["sync_commit"]), r["clients"])
    )
    return rows


def _row(rows: list[dict], workload: str, sync: str, clients: int) -> dict | None:
    return next(
        (r for r in rows if (r["workload"], r["sync_commit"], r["clients"]) == (workload, sync, clients)),
        None,
    )


def saturation_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and setting: the peak, the saturation point and what limited it there (see the
    module docstring)."""
    points = []
    for workload in WORKLOADS:
        for sync in SYNC:
            series = sorted(
                (r for r in rows if r["workload"] == workload and r["sync_commit"] == sync),
                key=lambda r: r["clients"],
            )
            if not series:
                continue
            peak = max(series, key=lambda r: r["median_tps"])
            at = next(r for r in series if r["median_tps"] >= PLATEAU * peak["median_tps"])
            growing = len(series) > 1 and at is series[-1]
            other = _row(rows, workload, "off", at["clients"])
            off_over_on = other["median_tps"] / at["median_tps"] if sync == "on" and other else None
            busy = at["cpu_busy"]
            cpu_bound = busy is not None and busy >= CPU_BOUND
            wal_bound = off_over_on is not None and off_over_on >= WAL_BOUND
            limit = {
                (True, True): "CPU and WAL flush",
                (True, False): "CPU",
                (False, True): "WAL flush",
                (False, False): "neither CPU nor WAL flush",
            }[cpu_bound, wal_bound]
            points.append(
                {
                    "workload": workload,
                    "sync_commit": sync,
                    "peak_tps": peak["median_tps"],
                    "peak_clients": peak["clients"],
                    "saturation_clients": at["clients"],
                    "saturation_tps": at["median_tps"],
                    "still_growing": growing,
                    "cpu_busy": busy,
                    "wal_fsyncs_s": at["wal_fsyncs_s"],
                    "off_over_on": off_over_on,
                    "limit": limit,
                    "last_clients": series[-1]["clients"],
                    "last_over_peak": series[-1]["median_tps"] / peak["median_tps"],
                }
            )
    return points


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def _tps(row: dict | None) -> str:
    if row is None:
        return "-"
    text = spread(row["tps"]) if len(row["tps"]) > 1 else f"{row['median_tps']:,.0f}"
    return text + (" (ran dry)" if row["drained"] else "")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _load(values: Sequence[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _num(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else f"{value:{fmt}}"


def render_markdown(
    env: dict[str, Any],
    server: dict[str, Any],
    settings: dict[str, Any],
    rows: list[dict],
    saturation: list[dict],
    skipped: list[dict],
) -> str:
    clients = sorted({r["clients"] for r in rows})
    bg = env["background_cpu"]
    where = (
        "the server runs on this machine too, so this is client and server together"
        if server["local"]
        else "the server is on another host: this is the client's machine only"
    )
    lines = [
        "# Capacity of one primary: locks, leases and jobs per second by client count",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']}); {env['pgbench']}",
        f"- machine: {env['platform']}, {env['cpu']}, nproc {env['nproc']}",
        f"- load average (1, 5, 15 min) at start: {_load(env['load_start'])}; "
        f"at end: {_load(env['load_end'])}; "
        f"machine CPU busy before the runs: {_pct(bg and bg['busy'])}",
        f"- settings: pgbench -M prepared -T {settings['seconds']} per run, {settings['runs']} run(s), "
        f"-j min(clients, {env['nproc']}); every client on a resource of its own; "
        f"{env['seconds_total']:.0f} s in all",
        f"- server settings: max_connections {server['max_connections']} "
        f"({server['reserved_connections']} reserved), wal_sync_method {server['wal_sync_method']}, "
        f"fsync {server['fsync']}, wal_writer_delay {server['wal_writer_delay']}, "
        f"commit_delay {server['commit_delay']}, shared_buffers {server['shared_buffers']}",
        f"- connections: each run uses one per pgbench client plus this module's one; the most seen "
        f"at once on the server: {max((r['server_connections'] for r in rows), default=0)} of "
        f"max_connections {server['max_connections']}",
        "",
        "tps = transactions of the pgbench script per second: one lock; one lease acquire + release",
        "(2 commits); one job claimed + completed (2 commits). Ratio = `pglockkit.xact_lock` tps /",
        "`pg_advisory_xact_lock` tps, the two measured back to back.",
        "",
        "| clients | sync commit | `pg_advisory_xact_lock` | `pglockkit.xact_lock` | ratio "
        "| lease cycles/s | jobs/s |",
        "|--:|:-:|--:|--:|--:|--:|--:|",
    ]
    for sync in SYNC:
        for c in clients:
            base, kit = _row(rows, BASELINE, sync, c), _row(rows, LOCK, sync, c)
            ratio = f"{kit['median_tps'] / base['median_tps']:.2f}" if base and kit else "-"
            lines.append(
                f"| {c} | {sync} | {_tps(base)} | {_tps(kit)} | {ratio} "
                f"| {_tps(_row(rows, LEASE, sync, c))} | {_tps(_row(rows, JOB, sync, c))} |"
            )
    lines += [
        "",
        f"CPU = the machine's busy share during the run (100% = all {env['nproc']} CPUs; {where});",
        "pgbench = pgbench's own CPU, as a share of the machine: the server had the rest, less other",
        "work. fsyncs/s = the server's WAL fsyncs per second; per tx = per pgbench transaction.",
    ]
    for workload in WORKLOADS:
        lines += [
            "",
            f"### {workload}",
            "",
            "| clients | conns | on: tps | CPU | pgbench | WAL fsyncs/s | per tx "
            "| off: tps | CPU | pgbench | WAL fsyncs/s | per tx |",
            "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for c in clients:
            cells = [str(c)]
            pair = [_row(rows, workload, s, c) for s in SYNC]
            cells.append(str(max((r["pgbench_connections"] or 0) for r in pair if r) if any(pair) else "-"))
            for r in pair:
                if r is None:
                    cells += ["-"] * 5
                    continue
                cells += [
                    _tps(r),
                    _pct(r["cpu_busy"]),
                    _pct(r["pgbench_cpu"]),
                    _num(r["wal_fsyncs_s"]),
                    _num(r["wal_fsyncs_per_tx"], ".2f"),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Saturation point: the smallest client count within 10% of the sweep's highest tps. Limit there:",
        f"CPU if the machine was >= {CPU_BOUND:.0%} busy; the WAL flush if synchronous_commit off ran",
        f">= {WAL_BOUND} times faster at that client count; both if both hold (a commit that waits",
        "for its flush also costs CPU: a sleep and a wake-up); else neither.",
        "",
        "| workload | sync commit | peak tps (clients) | saturation point | CPU there | WAL fsyncs/s there "
        "| off / on there | limit | tps at the most clients / peak |",
        "|---|:-:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for p in saturation:
        point = f"{p['saturation_clients']}" + (" (still growing)" if p["still_growing"] else "")
        lines.append(
            f"| {p['workload']} | {p['sync_commit']} | {p['peak_tps']:,.0f} ({p['peak_clients']}) | {point} "
            f"| {_pct(p['cpu_busy'])} | {_num(p['wal_fsyncs_s'])} | {_num(p['off_over_on'], '.2f')} "
            f"| {p['limit']} | {p['last_over_peak']:.2f} ({p['last_clients']}) |"
        )
    if skipped:
        lines += ["", "Skipped (would exceed max_connections):"]
        lines += [
            f"- {s['clients']} clients: {s['in_use']} of {s['usable']} connections in use" for s in skipped
        ]
    if any(r["drained"] for r in rows):
        lines += [
            "",
            "A job run marked (ran dry) emptied its queue even when run again: its jobs/s is a floor.",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dsn, target_name = target(args)
    data = run(dsn, args, target_name, argv)
    markdown = args.output.with_suffix(".md")
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(data["markdown"] + "\n", encoding="utf-8")
    return report(args.output, data)


if __name__ == "__main__":
    sys.exit(main())
