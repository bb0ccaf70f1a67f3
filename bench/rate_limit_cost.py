"""What rate limits cost claim_job: claim + complete with limits on some keys vs none, same run.

What is measured
----------------
Every call is its own autocommit statement on a psycopg 3 connection (``prepare=True``); every
client thread has its own connection. Each loop claims one job and completes it
(``claim_job(queue, worker, '5 minutes', 1)``, then ``complete_job(id, token)``), for ``--seconds``,
with 1 and 4 clients (``--clients``). Three queues, alternating run by run (order rotated each
run), each topped up to the same size and ``VACUUM ANALYZE``d before every run:

* ``none``: every job has a rate key, one of 8 (``k0`` .. ``k7``, interleaved), and no key has a
  limit: the claim path of a queue without limits (the fast path, plus a check of the job's key);
* ``some``: the same jobs, and 2 of the 8 keys have a limit set so high (1,000,000 per second,
  burst 1,000,000) that it never throttles: what the rate bookkeeping itself costs, a quarter of
  the claims going through it. Issue 17's target: ``some`` / ``none`` >= 0.9;
* ``plain``: jobs without a rate key in a queue without limits, the headline case of
  ``bench.queue_throughput`` (for reference: ``none`` / ``plain`` is what a rate key costs when
  nothing limits it).

Only ratios between numbers measured in the same run mean anything. Throughput = jobs completed /
wall time from the common start to the last client's finish; 10 warm-up iterations per client.

Reproduce
---------
::

    python -m bench.rate_limit_cost --embedded      # or --dsn DSN; about 40 s with the defaults
    python -m bench.rate_limit_cost --dsn DSN --seconds 3 --runs 7 --clients 1,4
    python -m bench.rate_limit_cost --dsn DSN --sync-commit off   # the server's CPU cost only

The markdown report goes to stdout, progress to stderr, every run to
``bench/results/rate_limit_cost.json``. It needs a role that may call ``set_rate_limit``
(``pglockkit_admin``); it deletes its jobs and limits (queues ``bench_rl_%``) at the end.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, environment, int_list, positive, report, spread, target

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "rate_limit_cost.json"
CASES = ("none", "some", "plain")
KEYS = 8
LIMITED = ("k0", "k1")
CLAIM = "SELECT id, token FROM pglockkit.claim_job(%s, %s, '5 minutes', 1)"
COMPLETE = "SELECT pglockkit.complete_job(%s, %s)"


def _queue(case: str) -> str:
    return f"bench_rl_{case}"


def setup(conn: psycopg.Connection) -> None:
    cleanup(conn)
    for key in LIMITED:
        conn.execute(
            "SELECT pglockkit.set_rate_limit(%s, %s, 1000000, '1 second', 1000000)", (_queue("some"), key)
        )


def cleanup(conn: psycopg.Connection) -> None:
    conn.execute("DELETE FROM pglockkit.jobs WHERE queue LIKE 'bench\\_rl\\_%'")
    for queue, key in conn.execute(
        "SELECT queue, key FROM pglockkit.rate_limits WHERE queue LIKE 'bench\\_rl\\_%'"
    ).fetchall():
        conn.execute("SELECT pglockkit.remove_rate_limit(%s, %s)", (queue, key))


def top_up(conn: psycopg.Connection, case: str, size: int) -> None:
    queue = _queue(case)
    have = conn.execute(
        "SELECT count(*) FROM pglockkit.jobs WHERE queue = %s AND status = 'queued'", (queue,)
    ).fetchone()[0]
    if have < size:
        rate_key = "NULL" if case == "plain" else f"'k' || (g %% {KEYS})"
        conn.execute(
            f"SELECT pglockkit.enqueue_job(%s, '{{}}', rate_key => {rate_key}) FROM generate_series(1, %s) g",
            (queue, size - have),
        )
    conn.execute("DELETE FROM pglockkit.jobs WHERE queue = %s AND status = 'done'", (queue,))
    conn.execute("VACUUM ANALYZE pglockkit.jobs")


def one_run(dsn: str, case: str, clients: int, seconds: float, sync_commit: str) -> tuple[float, bool]:
    """(jobs/s, drained): ``clients`` threads claim and complete for ``seconds``."""
    queue = _queue(case)
    done = [0] * clients
    drained = [False]
    barrier = threading.Barrier(clients + 1)
    ends = [0.0] * clients

    def client(n: int) -> None:
        with psycopg.connect(dsn, autocommit=True, options=f"-c synchronous_commit={sync_commit}") as conn:
            for _ in range(10):  # warm-up: the plans
                row = conn.execute(CLAIM, (queue, f"w{n}"), prepare=True).fetchone()
                if row:
                    conn.execute(COMPLETE, row, prepare=True)
            barrier.wait()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                row = conn.execute(CLAIM, (queue, f"w{n}"), prepare=True).fetchone()
                if row is None:
                    drained[0] = True
                    break
                conn.execute(COMPLETE, row, prepare=True)
                done[n] += 1
            ends[n] = time.monotonic()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.monotonic()
    for t in threads:
        t.join()
    return sum(done) / (max(ends) - start), drained[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rate_limit_cost", description=__doc__.splitlines()[0]
    )
    add_target_arguments(parser)
    parser.add_argument("--seconds", type=positive(float), default=2.0, help="per run and case (2)")
    parser.add_argument("--runs", type=positive(int), default=3, help="runs per client count (3)")
    parser.add_argument("--clients", type=int_list, default=[1, 4], help="client counts (1,4)")
    parser.add_argument("--jobs", type=positive(int), default=20000, help="queue size before each run")
    parser.add_argument(
        "--sync-commit",
        choices=["on", "off"],
        default="on",
        help="synchronous_commit of the clients (on); off leaves the server's CPU cost",
    )
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    return parser


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    pglockkit.install(dsn)
    rows = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
        setup(conn)
        try:
            for clients in args.clients:
                rates: dict[str, list[float]] = {c: [] for c in CASES}
                ratios: list[float] = []
                size = args.jobs
                for r in range(args.runs):
                    order = CASES[r % 3 :] + CASES[: r % 3]
                    while True:
                        got = {}
                        for case in order:
                            top_up(conn, case, size)
                            got[case] = one_run(dsn, case, clients, args.seconds, args.sync_commit)
                        if not any(drained for _, drained in got.values()):
                            break
                        size *= 2  # a run that empties its queue measures nothing: again, bigger
                        print(f"[rate_limit_cost] a queue ran dry: {size} jobs per run", file=sys.stderr)
                    for case in CASES:
                        rates[case].append(got[case][0])
                    ratios.append(got["some"][0] / got["none"][0])
                    print(
                        f"[rate_limit_cost] {clients} client(s), run {r + 1}: "
                        + ", ".join(f"{c} {got[c][0]:,.0f}/s" for c in CASES),
                        file=sys.stderr,
                    )
                rows.append(
                    {
                        "clients": clients,
                        "jobs_s": rates,
                        "some_over_none": ratios,
                        "none_over_plain": [
                            n / p for n, p in zip(rates["none"], rates["plain"], strict=True)
                        ],
                    }
                )
        finally:
            cleanup(conn)
    env = environment("bench.rate_limit_cost", argv, target_name, version)
    lines = [
        "# Rate limits: claim + complete with limits on some keys vs none",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']})",
        f"- machine: {env['platform']}, {env['cpu']}, nproc {env['nproc']}",
        f"- settings: {args.seconds:g} s per run and case, {args.runs} runs, synchronous_commit "
        f"{args.sync_commit}, 8 rate keys, "
        f"{len(LIMITED)} limited at 1,000,000/s (never throttling)",
        "",
        "| clients | plain jobs/s | none jobs/s | some jobs/s | some / none (target >= 0.9) | none / plain |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        j = r["jobs_s"]
        lines.append(
            f"| {r['clients']} | {spread(j['plain'])} | {spread(j['none'])} | {spread(j['some'])} | "
            f"{spread(r['some_over_none'], '.2f')} | {spread(r['none_over_plain'], '.2f')} |"
        )
    settings = {
        "seconds": args.seconds,
        "runs": args.runs,
        "clients": args.clients,
        "jobs": args.jobs,
        "sync_commit": args.sync_commit,
    }
    return {"environment": env, "settings": settings, "rows": rows, "markdown": "\n".join(lines)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    sys.exit(main())
