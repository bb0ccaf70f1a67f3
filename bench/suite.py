"""The benchmark suite: every ratio the issues promise, in one run, on one server.

``python -m bench`` runs, with smaller settings than each module's own defaults, and one after
another on the same server:

- ``lock``: ``bench.lock_overhead`` (helpers vs bare ``pg_advisory_xact_lock``);
- ``queue``: ``bench.queue_throughput`` (claim vs bare SQL, scaling with workers, backlog
  independence, batch claim);
- ``lease``: ``bench.lease_throughput`` (acquire + release vs a bare upsert);
- ``monitoring``: ``bench.monitoring_cost`` (views and ``sample()`` vs the bare ``pg_locks`` join);
- ``pgbench``: ``bench.pgbench_compare`` (``xact_lock`` and the ``pglockkit.key`` hot-loop forms vs
  ``pg_advisory_xact_lock`` vs ``SELECT ... FOR UPDATE`` with pgbench);
- ``peers``: ``bench.peers`` (pglockkit's ``Worker`` next to procrastinate, pgqueuer, graphile-worker
  and pg-boss).
- ``worker``: ``bench.worker_cost`` (commits, round trips and CPU per job vs the bare statements).
- ``io``: ``bench.io_bound`` (jobs that wait 100 ms, 16 in flight in one process).
- ``schedules``: ``bench.schedule_tick`` (a tick with 1,000 schedules, none due and all due).
- ``rate``: ``bench.rate_limit_cost`` (claim + complete with rate limits on some keys vs none).

Each section has a time budget; the report flags a section that overran it. The defaults take about
7 minutes on 2 cores (the budgets add up to 16). ``--quick`` runs every section with tiny settings (the smoke
test; its numbers mean nothing). The target is ``--dsn``, else ``$PGLOCKKIT_DSN``, else the
embedded PostgreSQL 18 (started if needed). The suite works in a database of its own on that server
(``--database``, created, pglockkit installed, dropped at the end), so it needs a role that may
create databases; the peers section creates one per queue system.

Output: the markdown report on stdout (progress on stderr), and ``suite.md`` and ``suite.json`` in
``--output-dir`` (default ``bench/results``, git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench import (
    io_bound,
    lease_throughput,
    lock_overhead,
    monitoring_cost,
    peers,
    pgbench_compare,
    queue_throughput,
    rate_limit_cost,
    schedule_tick,
    worker_cost,
)
from bench.common import environment, spread
from pglockkit.connection import DSN_ENV

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Section:
    """One module of the suite, with the settings it runs with (its own argv) and a time budget."""

    name: str
    title: str
    module: Any  # has build_parser() and run(dsn, args, target_name, argv)
    argv: tuple[str, ...]
    quick_argv: tuple[str, ...]
    budget_s: float


SECTIONS = [
    Section(
        "lock",
        "Lock helper overhead",
        lock_overhead,
        ("--seconds", "1", "--runs", "3", "--clients", "1,4"),
        ("--seconds", "0.1", "--runs", "1", "--clients", "1"),
        75,
    ),
    Section(
        "queue",
        "Job queue: claim vs bare SQL, scaling, backlog, batch",
        queue_throughput,
        ("--seconds", "1", "--runs", "3", "--workers", "1,2,4,8,16", "--batches", "1,10,100"),
        (
            *("--seconds", "0.2", "--runs", "1", "--clients", "1", "--workers", "1,2"),
            *("--backlog-small", "1500", "--backlog-large", "4000", "--batches", "1,10"),
        ),
        210,
    ),
    Section(
        "lease",
        "Lease throughput",
        lease_throughput,
        ("--seconds", "1", "--runs", "3", "--clients", "1,8"),
        ("--seconds", "0.2", "--runs", "1", "--clients", "1,2"),
        40,
    ),
    Section(
        "monitoring",
        "Monitoring cost",
        monitoring_cost,
        ("--runs", "3", "--calls", "20", "--seconds", "2"),
        (
            *("--locks", "40", "--holders", "2", "--waiters", "1", "--calls", "2", "--runs", "1"),
            *("--seconds", "0.3", "--workers", "2"),
        ),
        50,
    ),
    Section(
        "pgbench",
        "pgbench: xact_lock vs pg_advisory_xact_lock vs SELECT ... FOR UPDATE",
        pgbench_compare,
        ("--seconds", "1", "--runs", "3", "--clients", "1,2,4,8,16"),
        ("--seconds", "1", "--runs", "1", "--clients", "2"),
        110,
    ),
    Section(
        "peers",
        "Queue peers: pglockkit vs procrastinate, pgqueuer, graphile-worker, pg-boss",
        peers,
        ("--workers", "1,4", "--jobs", "3000", "--runs", "3", "--warmup", "200"),
        ("--workers", "1", "--jobs", "30", "--runs", "1", "--warmup", "5"),
        240,
    ),
    Section(
        "worker",
        "What one job costs the worker: commits, round trips, CPU vs the bare statements",
        worker_cost,
        ("--jobs", "5000"),
        ("--jobs", "100"),
        60,
    ),
    Section(
        "io",
        "I/O-bound jobs: one worker process, 16 in flight",
        io_bound,
        ("--jobs", "400", "--concurrency", "16", "--sleep", "0.1", "--runs", "3"),
        ("--jobs", "16", "--concurrency", "4", "--sleep", "0.01", "--runs", "1"),
        90,
    ),
    Section(
        "rate",
        "Rate limits: claim + complete with limits on some keys vs none",
        rate_limit_cost,
        ("--seconds", "1", "--runs", "3", "--clients", "1,4"),
        ("--seconds", "0.2", "--runs", "1", "--clients", "1", "--jobs", "2000"),
        40,
    ),
]
SECTIONS.append(
    Section(
        "schedules",
        "Ticking 1,000 schedules: none due, all due",
        schedule_tick,
        ("--schedules", "1000", "--calls", "1000", "--runs", "3"),
        ("--schedules", "20", "--calls", "20", "--runs", "1"),
        60,
    )
)
BY_NAME = {s.name: s for s in SECTIONS}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:  # not available
        return "unknown"


# ---------------------------------------------------------------------------------------------
# The summary: one row per promised ratio
# ---------------------------------------------------------------------------------------------

Row = tuple[str, str, str, str]  # section, what, result, target or meaning


def _lock_rows(d: dict) -> list[Row]:
    rows: list[Row] = []
    for r in d["round_trips"]:
        rows.append(
            (
                "lock",
                f"`{r['statement']}` / `{r['baseline']}`, {r['clients']} client(s), ops/s",
                f"{r['ratio']:.2f} ({r['run_ratio_min']:.2f}-{r['run_ratio_max']:.2f})",
                "1.0 = no overhead",
            )
        )
    s = d["server_side"]
    rows.append(
        (
            "lock",
            f"server side, {s['batch']} calls per statement: cost per call, pglockkit / bare",
            f"{s['cost_ratio']:.2f} ({s['pglockkit_median']:.2f} vs {s['baseline_median']:.2f} µs)",
            "1.0 = no overhead",
        )
    )
    return rows


def _queue_rows(d: dict) -> list[Row]:
    res, rows = d["results"], []
    for r in res.get("claim_complete", []):
        rows.append(
            (
                "queue",
                f"claim + complete / bare SKIP LOCKED SQL (same table shape), {r['clients']} client(s)",
                f"{r['ratio']:.2f} ({r['run_ratio_min']:.2f}-{r['run_ratio_max']:.2f})",
                ">= 0.8",
            )
        )
    if res.get("scaling"):
        top = res["scaling"][-1]
        rows.append(
            (
                "queue",
                f"scaling, {top['workers']} workers with {d['settings']['work_ms']:g} ms work: parallelism "
                "queue / global lock",
                f"{top['queue_parallelism']:.1f} / {top['global_lock_parallelism']:.1f}",
                f"queue rises toward {top['workers']}, global lock stays 1",
            )
        )
    if res.get("backlog"):
        for c in res["backlog"]["cases"][1:]:
            rows.append(
                (
                    "queue",
                    f"backlog: ({c['case']}) {c['label']} / (a), jobs/s",
                    f"{c['ratio_vs_a']:.2f}",
                    "0.8-1.2",
                )
            )
    for r in res.get("batch", [])[1:]:
        rows.append(
            ("queue", f"batch claim {r['batch']} / batch 1, jobs/s", f"{r['ratio_vs_first']:.2f}", "> 1")
        )
    return rows


def _lease_rows(d: dict) -> list[Row]:
    return [
        (
            "lease",
            f"acquire + release / bare upsert, {r['clients']} client(s), {r['shape']}",
            f"{r['ratio']:.2f}"
            + (f" (paired runs: {r['paired_ratio']:.2f})" if r.get("paired_ratio") is not None else ""),
            "1.0 = as fast",
        )
        for r in d["rows"]
    ]


def _monitoring_rows(d: dict) -> list[Row]:
    ms = d["latency_ms"]
    base = statistics.median(ms["pg_locks join (baseline)"])
    rows: list[Row] = [
        (
            "monitoring",
            f"`{name}` / bare pg_locks join, {d['locks_held']} locks held, ms per call",
            f"{statistics.median(v) / base:.1f} ({statistics.median(v):.2f} ms)",
            "cost of naming the locks",
        )
        for name, v in ms.items()
        if name in ("advisory_locks", "sample()")
    ]
    rows.append(
        (
            "monitoring",
            "claim + complete throughput kept with sample() every second",
            f"{d['kept']:.2f}",
            "~1.0",
        )
    )
    return rows


def _pgbench_rows(d: dict) -> list[Row]:
    rows: list[Row] = []
    for r in d["rows"]:
        for name, goal in (
            ("pglockkit.xact_lock", ">= 0.8"),
            ("pglockkit.key hot loop", ">= 0.95"),
            ("pglockkit.key hot loop, integer", ">= 0.95"),
            ("key formula written out", "the text forms' floor"),
            ("SELECT ... FOR UPDATE", "1.0 = as fast"),
        ):
            rows.append(
                (
                    "pgbench",
                    f"`{name}` / `pg_advisory_xact_lock`, {r['clients']} client(s), tps",
                    f"{r['ratio_vs_advisory'][name]:.2f} ({r['median_tps'][name]:,.0f} tps)",
                    goal,
                )
            )
    return rows


def _peers_rows(d: dict) -> list[Row]:
    s = d["settings"]
    rows: list[Row] = []
    for r in d["rows"]:
        what = f"{r['system']}: {s['jobs']:,} no-op jobs, {r['workers']} workers, jobs/s"
        if r["status"] != "measured":
            rows.append(("peers", what, r["status"], "-"))
            continue
        for kind, key, ratio in (
            ("drain", "jobs_s", "vs_best_peer"),
            ("steady", "steady_jobs_s", "steady_vs_best_peer"),
        ):
            versus = "" if r[ratio] is None else f"; {r[ratio]:.2f} x best peer"
            goal = {
                "pglockkit": ">= 1.2 x best peer (steady)",
                "pglockkit tuned": ">= 1.5 x best peer (steady)",
            }
            rows.append(
                ("peers", f"{what} ({kind})", f"{spread(r[key])}{versus}", goal.get(r["system"], "-"))
            )
    return rows


def _worker_rows(d: dict) -> list[Row]:
    rows: list[Row] = []
    for r in d["rows"]:
        kit, bare = r["worker"], r["bare"]
        rows.append(
            (
                "worker",
                f"{r['setting']}: `Worker` / bare statements at batch {r['batch']}, jobs/s",
                f"{kit['jobs_s'] / bare['jobs_s']:.2f} ({kit['jobs_s']:,.0f} vs {bare['jobs_s']:,.0f}); "
                "per job: "
                f"{kit['commits_per_job']:.3f} vs {bare['commits_per_job']:.3f} commits, "
                f"{kit['round_trips_per_job']:.3f} vs {bare['round_trips_per_job']:.3f} round trips, "
                f"{kit['server_cpu_us_per_job']:,.0f} vs {bare['server_cpu_us_per_job']:,.0f} µs server CPU",
                "1.0 = the bare statements",
            )
        )
    return rows


def _io_rows(d: dict) -> list[Row]:
    s = d["settings"]
    what = f"{s['jobs']} jobs of {s['sleep_s'] * 1000:.0f} ms, concurrency {s['concurrency']}, one process"
    rows: list[Row] = []
    for r in d["rows"]:
        if r["status"] != "measured":
            rows.append(("io", f"{r['case']}: {what}", r["status"], "-"))
        else:
            result = f"{spread(r['jobs_s'], ',.1f')} jobs/s; {r['of_ideal']:.2f} of ideal"
            rows.append(("io", f"{r['case']}: {what}", result, ">= 0.8 of ideal, start-up included"))
    return rows


def _schedule_rows(d: dict) -> list[Row]:
    r = d["result"]
    return [
        (
            "schedules",
            f"tick with {r['schedules']:,} schedules, none due / no schedules, µs per round trip",
            f"{r['idle_tick_us'] / r['empty_tick_us']:.2f} "
            f"({r['idle_tick_us']:,.0f} vs {r['empty_tick_us']:,.0f})",
            "1.0 = idle schedules cost nothing",
        ),
        (
            "schedules",
            f"tick with {r['schedules']:,} schedules all due (one job each)",
            f"{r['all_due_tick_ms']:,.1f} ms ({r['all_due_per_schedule_us']:,.0f} µs per schedule)",
            "cost per tick",
        ),
    ]


def _rate_rows(d: dict) -> list[Row]:
    return [
        (
            "rate",
            f"claim + complete, limits on 2 of 8 keys / none, {r['clients']} client(s)",
            spread(r["some_over_none"], ".2f"),
            ">= 0.9",
        )
        for r in d["rows"]
    ]


SUMMARY: dict[str, Callable[[dict], list[Row]]] = {
    "lock": _lock_rows,
    "queue": _queue_rows,
    "lease": _lease_rows,
    "monitoring": _monitoring_rows,
    "pgbench": _pgbench_rows,
    "peers": _peers_rows,
    "worker": _worker_rows,
    "io": _io_rows,
    "schedules": _schedule_rows,
    "rate": _rate_rows,
}


# ---------------------------------------------------------------------------------------------
# Running and reporting
# ---------------------------------------------------------------------------------------------


def _demote(markdown: str) -> str:
    """A section's report under the suite's heading: its own title dropped, headings one level down."""
    lines = markdown.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join("#" + line if line.startswith("#") else line for line in lines).strip("\n")


def render(env: dict[str, Any], sections: dict[str, dict], rows: list[Row]) -> str:
    total = sum(s["seconds"] for s in sections.values())
    lines = [
        "# pglockkit benchmark suite",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: PostgreSQL {env['server_short']} ({env['target']})",
        f"- machine: {env['cpu']}, nproc {env['nproc']}, {env['platform']}",
        f"- load average (1, 5, 15 min) at start: {env['load_start']}; at end: {env['load_end']}",
        f"- client: Python {env['python']}, psycopg {env['psycopg']}, pglockkit {env['pglockkit']}",
        f"- time: {total:.0f} s in all; "
        + ", ".join(
            f"{name} {s['seconds']:.0f} s"
            + (f" (**over its {s['budget_s']:.0f} s budget**)" if s["over"] else "")
            for name, s in sections.items()
        ),
        "",
        "Ratios are medians of runs measured in the same run on the same server (per-run range in "
        "brackets where there is one); absolute rates depend on the machine.",
        "",
        "| section | measure | result | target |",
        "|---|---|--:|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    for name, s in sections.items():
        lines += ["", f"## {BY_NAME[name].title}", "", _demote(s["markdown"])]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help=f"libpq DSN (default ${DSN_ENV}, else the embedded server)")
    parser.add_argument(
        "--sections",
        default=",".join(s.name for s in SECTIONS),
        help=f"comma list of sections (default all: {','.join(s.name for s in SECTIONS)})",
    )
    parser.add_argument("--quick", action="store_true", help="tiny settings: checks that it works")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="where suite.md/.json go")
    parser.add_argument(
        "--database",
        default="pglockkit_bench_suite",
        help="database the suite creates on the server, works in and drops (default %(default)s)",
    )
    return parser


def _target(args: argparse.Namespace) -> tuple[str, str]:
    if args.dsn:
        return args.dsn, "--dsn"
    if os.environ.get(DSN_ENV):
        return os.environ[DSN_ENV], f"${DSN_ENV}"
    from pglockkit import embedded

    return embedded.start(), "embedded"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        parser.error(f"--sections: unknown {unknown}; sections are {', '.join(BY_NAME)}")
    dsn, target_name = _target(args)
    with psycopg.connect(dsn, autocommit=True) as conn:
        version = conn.execute("SELECT version()").fetchone()[0]
        short = conn.execute("SHOW server_version").fetchone()[0]
    env = environment("bench", argv, target_name, version)
    env["server_short"] = short
    env["load_start"] = _load()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    sections: dict[str, dict] = {}
    rows: list[Row] = []
    # A database of the suite's own on the target server: other users of the server's databases
    # (a test that uninstalls pglockkit, a demo) cannot pull the schema from under a run.
    bench_dsn = peers.dsn_for(dsn, args.database)
    with psycopg.connect(dsn, autocommit=True) as admin:
        peers.create_database(admin, args.database)
    try:
        for name in names:
            section = BY_NAME[name]
            section_argv = list(section.quick_argv if args.quick else section.argv)
            output = args.output_dir / f"suite-{name}.json"
            with contextlib.suppress(ValueError):  # shown relative to the current directory when inside it
                output = output.resolve().relative_to(Path.cwd())
            section_argv += ["--output", str(output)]
            module_args = section.module.build_parser().parse_args(section_argv)
            _log(f"== {name}: python -m {section.module.__name__} {shlex.join(section_argv)}")
            started = time.perf_counter()
            data = section.module.run(bench_dsn, module_args, target_name, section_argv)
            seconds = time.perf_counter() - started
            over = not args.quick and seconds > section.budget_s
            flag = " OVER BUDGET" if over else ""
            _log(f"== {name}: {seconds:.0f} s (budget {section.budget_s:.0f} s){flag}")
            markdown = data.pop("markdown")
            sections[name] = {
                "seconds": round(seconds, 3),
                "budget_s": section.budget_s,
                "over": over,
                "argv": section_argv,
                "markdown": markdown,
                "data": data,
            }
            rows += SUMMARY[name](data)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            peers.drop_database(admin, args.database)
    env["load_end"] = _load()
    report = render(env, sections, rows)
    document = {
        "environment": env,
        "quick": args.quick,
        "summary": [dict(zip(("section", "measure", "result", "target"), r, strict=True)) for r in rows],
        "sections": sections,
    }
    (args.output_dir / "suite.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    (args.output_dir / "suite.md").write_text(report, encoding="utf-8")
    print(report, end="")
    _log(f"wrote {args.output_dir / 'suite.md'} and suite.json")
    return 0
