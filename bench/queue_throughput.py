"""Job queue throughput: pglockkit's claim/complete against baselines measured in the same run.

What is measured
----------------
Every call is its own autocommit statement on a psycopg 3 connection (``prepare=True``); every
client thread has its own connection. Only ratios between numbers measured in the same run mean
anything: absolute jobs/s depend on the machine, and on a small machine the Python client threads
share the CPUs with the server.

1. claim + complete vs bare SQL (``--clients``, default 1 and 4). Each loop claims one job and
   completes it: ``SELECT * FROM pglockkit.claim_job(queue, worker, '5 minutes', 1)`` then
   ``SELECT pglockkit.complete_job(id, token)``, against the two statements they wrap: an
   ``UPDATE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING`` the columns claim_job
   returns (id, queue, payload, attempt, max_attempts, token, lease_expires_at) and an
   ``UPDATE ... SET status = 'done'``, on two tables:

   * ``bench_shape_jobs``, the same table shape: ``CREATE TABLE ... (LIKE pglockkit.jobs INCLUDING
     ALL)``, so the same columns, constraints and indexes. The ratio against it is what the
     functions cost (argument checks, the probe for concurrency keys and expired leases, the call).
     Issue target: ratio >= 0.8.
   * ``bench_bare_jobs``, a minimal table: the same columns, its primary key and one partial index
     on ``(queue, priority DESC, run_at, id) WHERE status = 'queued'``. The ratio against it adds
     what pglockkit's other indexes and constraints cost (leases, dedup keys, finished jobs).

2. Scaling (``--workers``, default 1, 2, 4, 8, 16 threads). Each job's "work" is a
   ``time.sleep(--work-ms / 1000)`` between claim and complete, so the swarm's parallelism shows.
   Baseline: the design that serializes a swarm, one global advisory lock around each unit of work
   (``pg_advisory_lock(42)``, sleep, ``pg_advisory_unlock(42)``). Reported: throughput per worker
   count and effective parallelism, throughput(N) / throughput(1). The queue should keep rising
   (until the CPUs run out); the global lock stays flat at about 1 / work time.

3. Backlog independence (one client, as in 1): claim + complete with (a) ``--backlog-small``
   pending jobs, (b) ``--backlog-large`` pending jobs, (c) ``--backlog-small`` pending jobs plus
   ``--backlog-large`` finished (``done``) jobs of the same queue, (d) ``--backlog-small`` pending
   jobs plus ``--backlog-large`` jobs of the same queue due a day later at a higher priority (in
   the ready index, which is ordered by priority, they come before the due jobs). Each case is
   alone in the table (earlier bench rows deleted, table vacuumed), filled by a direct ``INSERT
   ... SELECT generate_series`` into ``pglockkit.jobs`` (this needs the table owner), ``VACUUM
   ANALYZE`` and ``CHECKPOINT`` (if the role may: otherwise the checkpointer flushes the fill
   during the first runs, which then compete with it for the disk). Before each run the queue is
   topped up to its backlog, vacuumed and checkpointed again. The cases need different table
   states, so they run one after another, not interleaved: (a) then (b), (a) then (c), (a) then
   (d), each compared with the (a) just before it (the machine drifts over minutes). Issue
   target: (b), (c) and (d) within 20% of (a).

4. Batch claim (``--batches``, default 1, 10, 100; one client): ``claim_job(..., batch)`` then
   ``complete_jobs(ids, tokens)`` in one call, jobs/s and ratio against batch 1 (which also uses
   ``complete_jobs``, so the ratio isolates batching).

In sections 1, 2 and 4 the designs alternate run by run (order rotated each run), so drift of
the machine hits all of them. Before every run the queues are topped up (1, 2, 4: to the same
size for every design, at least 1.5 times what the fastest run so far consumed) and the job
tables vacuumed and analysed (``VACUUM ANALYZE``), so each run starts from the same kind of state
and autovacuum is unlikely to start in the middle of a run. A run that empties its queue is
discarded and repeated with more jobs (in section 3 it is an error). Throughput = jobs completed /
wall time from the common start to the last worker's finish; 10 warm-up iterations per thread (not
timed) prepare the plans.

Reproduce
---------
::

    python -m bench.queue_throughput --embedded      # or --dsn DSN; defaults about 3-4 min on 2 cores
    python -m bench.queue_throughput --embedded --sections 1,4 --seconds 3 --runs 5
    python -m bench.queue_throughput --embedded --sections 1 --sync-commit off   # CPU cost only

Without ``--dsn`` or ``--embedded`` the DSN is ``$PGLOCKKIT_DSN``, else libpq's ``PG*`` variables.
pglockkit is installed (migrations applied) if missing. The markdown report goes to stdout,
progress to stderr, and every run to ``bench/results/queue_throughput.json``. At the end the
benchmark deletes its jobs (queues ``bench%``) and drops its tables.
"""

from __future__ import annotations

import argparse
import json
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
from psycopg.conninfo import make_conninfo

import pglockkit
from bench.common import add_target_arguments, environment, int_list, positive, spread, target

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "queue_throughput.json"
APPLICATION_NAME = "pglockkit bench queue_throughput"
WARMUP_ITERATIONS = 10  # per thread, before the barrier: plans prepared, caches warm
BARRIER_TIMEOUT_S = 120.0
ENQUEUE_BATCH = 10_000
MIN_FILL = 20_000  # pending jobs per queue before a run of sections 1, 2 and 4, at least
MAX_ATTEMPTS = 4  # per run, when a queue runs dry
GLOBAL_LOCK_KEY = 42
SECTIONS = {1: "claim_complete", 2: "scaling", 3: "backlog", 4: "batch"}

KIT_CLAIM = "SELECT * FROM pglockkit.claim_job(%s, %s, interval '5 minutes', %s::integer)"
KIT_COMPLETE = "SELECT pglockkit.complete_job(%s::bigint, %s::bigint)"
KIT_COMPLETE_MANY = "SELECT pglockkit.complete_jobs(%s::bigint[], %s::bigint[])"
KIT_ENQUEUE = "SELECT cardinality(pglockkit.enqueue_jobs(%s, array_fill('{}'::jsonb, ARRAY[%s::integer])))"
# Fast fills for section 3, as the table owner: no function call per job.
DIRECT_PENDING = """
INSERT INTO pglockkit.jobs (queue, run_at, created_at)
SELECT %s, now(), now() FROM generate_series(1, %s)
"""
DIRECT_DONE = """
INSERT INTO pglockkit.jobs (queue, status, attempt, worker, run_at, created_at, started_at, finished_at)
SELECT %s, 'done', 1, 'bench', now(), now(), now(), now() FROM generate_series(1, %s)
"""
DIRECT_LATER = """
INSERT INTO pglockkit.jobs (queue, priority, run_at, created_at)
SELECT %s, 10, now() + interval '1 day', now() FROM generate_series(1, %s)
"""

BARE_SETUP = """
DROP TABLE IF EXISTS bench_bare_jobs;
DROP SEQUENCE IF EXISTS bench_bare_tokens;
CREATE SEQUENCE bench_bare_tokens AS bigint;
CREATE TABLE bench_bare_jobs (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue             text        NOT NULL,
    payload           jsonb       NOT NULL DEFAULT '{}',
    priority          integer     NOT NULL DEFAULT 0,
    run_at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    status            text        NOT NULL DEFAULT 'queued',
    attempt           integer     NOT NULL DEFAULT 0,
    max_attempts      integer     NOT NULL DEFAULT 5,
    worker            text,
    token             bigint,
    lease_expires_at  timestamptz,
    dedup_key         text,
    last_error        text,
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    started_at        timestamptz,
    finished_at       timestamptz
);
CREATE INDEX bench_bare_jobs_ready ON bench_bare_jobs (queue, priority DESC, run_at, id)
    WHERE status = 'queued';
DROP TABLE IF EXISTS bench_shape_jobs;
CREATE TABLE bench_shape_jobs (LIKE pglockkit.jobs INCLUDING ALL);
"""
BARE_DROP = (
    "DROP TABLE IF EXISTS bench_bare_jobs; DROP TABLE IF EXISTS bench_shape_jobs; "
    "DROP SEQUENCE IF EXISTS bench_bare_tokens"
)
BARE_TABLES = {"bare": "bench_bare_jobs", "shape": "bench_shape_jobs"}  # Queue.kind -> table
# What claim_job and complete_job do, as bare statements ({table}: one of BARE_TABLES).
BARE_CLAIM = """
UPDATE {table} SET status = 'running', attempt = attempt + 1, token = nextval('bench_bare_tokens'),
       lease_expires_at = clock_timestamp() + interval '5 minutes', worker = %s,
       started_at = clock_timestamp()
 WHERE id = (SELECT id FROM {table}
              WHERE queue = %s AND status = 'queued' AND run_at <= clock_timestamp()
              ORDER BY priority DESC, run_at, id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, queue, payload, attempt, max_attempts, token, lease_expires_at
"""
BARE_COMPLETE = """
UPDATE {table} SET status = 'done', finished_at = clock_timestamp(), lease_expires_at = NULL
 WHERE id = %s AND token = %s AND status = 'running'
"""
BARE_ENQUEUE = "INSERT INTO {table} (queue) SELECT %s FROM generate_series(1, %s)"

LOCK_SQL = f"SELECT pg_advisory_lock({GLOBAL_LOCK_KEY})"
UNLOCK_SQL = f"SELECT pg_advisory_unlock({GLOBAL_LOCK_KEY})"

CLEANUP_JOBS = "DELETE FROM pglockkit.jobs WHERE queue LIKE 'bench%'"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _connect(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True, application_name=APPLICATION_NAME)


# ---------------------------------------------------------------------------------------------
# Queues and designs
# ---------------------------------------------------------------------------------------------


@dataclass
class Queue:
    """A queue the benchmark consumes; ``pending`` is tracked here (every claim is completed)."""

    name: str
    kind: str  # "pglockkit" (enqueue_jobs), "direct" (INSERT into pglockkit.jobs), "bare" or "shape"
    pending: int = 0

    def top_up(self, conn: psycopg.Connection, target: int) -> int:
        """Add jobs until ``target`` are pending; returns how many were added."""
        missing = target - self.pending
        if missing <= 0:
            return 0
        if self.kind == "pglockkit":
            left = missing
            while left > 0:
                n = min(ENQUEUE_BATCH, left)
                added = conn.execute(KIT_ENQUEUE, (self.name, n)).fetchone()[0]
                if added != n:
                    raise RuntimeError(f"enqueue_jobs added {added} jobs, expected {n}")
                left -= n
        elif self.kind == "direct":
            conn.execute(DIRECT_PENDING, (self.name, missing))
        elif self.kind in BARE_TABLES:
            conn.execute(BARE_ENQUEUE.format(table=BARE_TABLES[self.kind]), (self.name, missing))
        else:
            raise ValueError(f"unknown queue kind {self.kind!r}")
        self.pending += missing
        return missing


Step = Callable[[psycopg.Connection, str, bool], int]  # (conn, worker, timed) -> jobs done


@dataclass(frozen=True)
class Design:
    """What one worker thread does per iteration. ``step`` returns the jobs (units) it finished;
    fewer than ``batch`` means the queue ran dry."""

    name: str
    step: Step
    queue: Queue | None = None
    batch: int = 1


def kit_design(name: str, queue: Queue, work_s: float = 0.0) -> Design:
    """claim_job(batch 1) then complete_job, optionally sleeping ``work_s`` in between."""

    def step(conn: psycopg.Connection, worker: str, timed: bool) -> int:
        rows = conn.execute(KIT_CLAIM, (queue.name, worker, 1), prepare=True).fetchall()
        if not rows:
            return 0
        if work_s and timed:
            time.sleep(work_s)
        job_id, token = rows[0][0], rows[0][5]
        if not conn.execute(KIT_COMPLETE, (job_id, token), prepare=True).fetchone()[0]:
            raise RuntimeError(f"complete_job({job_id}, {token}) returned false: stale claim")
        return 1

    return Design(name, step, queue)


def kit_batch_design(name: str, queue: Queue, batch: int) -> Design:
    """claim_job(batch) then complete_jobs(ids, tokens) in one call."""

    def step(conn: psycopg.Connection, worker: str, timed: bool) -> int:
        rows = conn.execute(KIT_CLAIM, (queue.name, worker, batch), prepare=True).fetchall()
        if not rows:
            return 0
        ids = [r[0] for r in rows]
        tokens = [r[5] for r in rows]
        done = conn.execute(KIT_COMPLETE_MANY, (ids, tokens), prepare=True).fetchone()[0]
        if done != len(rows):
            raise RuntimeError(f"complete_jobs completed {done} of {len(rows)} claims")
        return len(rows)

    return Design(name, step, queue, batch)


def bare_design(name: str, queue: Queue, work_s: float = 0.0) -> Design:
    """The bare UPDATE ... SKIP LOCKED claim and UPDATE complete on the queue's table."""
    claim_sql = BARE_CLAIM.format(table=BARE_TABLES[queue.kind])
    complete_sql = BARE_COMPLETE.format(table=BARE_TABLES[queue.kind])

    def step(conn: psycopg.Connection, worker: str, timed: bool) -> int:
        row = conn.execute(claim_sql, (worker, queue.name), prepare=True).fetchone()
        if row is None:
            return 0
        if work_s and timed:
            time.sleep(work_s)
        if conn.execute(complete_sql, (row[0], row[5]), prepare=True).rowcount != 1:
            raise RuntimeError(f"bare complete of job {row[0]} matched no row")
        return 1

    return Design(name, step, queue)


def global_lock_design(name: str, work_s: float) -> Design:
    """One advisory lock around every unit of work serialises the swarm."""

    def step(conn: psycopg.Connection, worker: str, timed: bool) -> int:
        conn.execute(LOCK_SQL, prepare=True)
        try:
            if timed:
                time.sleep(work_s)
        finally:
            if not conn.execute(UNLOCK_SQL, prepare=True).fetchone()[0]:
                raise RuntimeError("pg_advisory_unlock: lock was not held")
        return 1

    return Design(name, step)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One timed run of one design."""

    rate: float  # jobs (units) per second, all threads together
    jobs: int  # completed in the timed window
    consumed: int  # including warm-up
    elapsed_s: float
    dry: bool


def run_once(dsn: str, design: Design, threads: int, seconds: float) -> Run:
    """``threads`` workers, each on its own connection: warm up, start together, loop for ``seconds``."""
    barrier = threading.Barrier(threads)
    dry = threading.Event()
    results: list[tuple[int, int, float, float] | None] = [None] * threads
    errors: list[BaseException] = []

    def work(index: int) -> None:
        worker = f"w{index}"
        try:
            with _connect(dsn) as conn:
                consumed = 0
                for _ in range(WARMUP_ITERATIONS):
                    n = design.step(conn, worker, False)
                    consumed += n
                    if n < design.batch:
                        dry.set()
                        break
                barrier.wait(BARRIER_TIMEOUT_S)
                jobs = 0
                started = time.perf_counter()
                deadline = started + seconds
                while not dry.is_set() and time.perf_counter() < deadline:
                    n = design.step(conn, worker, True)
                    jobs += n
                    if n < design.batch:
                        dry.set()
                results[index] = (jobs, consumed + jobs, started, time.perf_counter())
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    done = [r for r in results if r is not None]
    jobs = sum(r[0] for r in done)
    elapsed = max(r[3] for r in done) - min(r[2] for r in done)
    return Run(
        rate=jobs / elapsed,
        jobs=jobs,
        consumed=sum(r[1] for r in done),
        elapsed_s=elapsed,
        dry=dry.is_set(),
    )


@dataclass
class Filler:
    """Keeps the queues of a section filled to a common size, enough for the fastest run so far."""

    seconds: float
    target: int = MIN_FILL

    def before(self, conn: psycopg.Connection, queues: Sequence[Queue]) -> None:
        for q in queues:
            q.top_up(conn, self.target)

    def _enough(self, run: Run, threads: int, batch: int) -> int:
        return math.ceil(1.5 * run.rate * self.seconds) + 2 * WARMUP_ITERATIONS * threads * batch

    def after(self, run: Run, threads: int, batch: int) -> None:
        self.target = max(self.target, self._enough(run, threads, batch))

    def dry(self, run: Run, threads: int, batch: int) -> None:
        self.target = max(2 * self.target, self._enough(run, threads, batch))


def vacuum(conn: psycopg.Connection, tables: Sequence[str]) -> None:
    conn.execute(f"VACUUM ANALYZE {', '.join(tables)}")


def checkpoint(conn: psycopg.Connection) -> bool:
    """Write out dirty pages now (needs superuser or pg_checkpoint), so that a large fill is not
    flushed by the checkpointer during the next runs, competing with their commits. False if the
    role may not."""
    try:
        conn.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege:
        return False
    return True


def measure(
    dsn: str,
    conn: psycopg.Connection,
    design: Design,
    threads: int,
    seconds: float,
    prepare_run: Callable[[], None],
    label: str,
    on_dry: Callable[[Run, int, int], None] | None,
) -> Run:
    """One recorded run: prepare (top up, vacuum), run; a run that ran dry is repeated."""
    for _attempt in range(MAX_ATTEMPTS):
        prepare_run()
        run = run_once(dsn, design, threads, seconds)
        if design.queue is not None:
            design.queue.pending -= run.consumed
        if not run.dry:
            _log(f"{label} {design.name}: {run.rate:,.0f} jobs/s ({run.jobs} jobs in {run.elapsed_s:.2f} s)")
            return run
        if on_dry is None:
            raise RuntimeError(
                f"{label} {design.name}: the queue ran dry during the run "
                f"({run.consumed:,} jobs claimed): raise the backlog or lower --seconds"
            )
        _log(f"{label} {design.name}: queue ran dry, repeating with more jobs")
        on_dry(run, threads, design.batch)
    raise RuntimeError(f"{label} {design.name}: the queue ran dry {MAX_ATTEMPTS} times")


def _rotated(items: Sequence[Any], by: int) -> list[Any]:
    shift = by % len(items)
    return list(items[shift:]) + list(items[:shift])


def interleaved(
    dsn: str,
    conn: psycopg.Connection,
    designs: Sequence[Design],
    threads: int,
    seconds: float,
    runs: int,
    tables: Sequence[str],
    filler: Filler,
    label: str,
) -> dict[str, list[Run]]:
    """``runs`` rounds; each round runs every design once, in an order rotated round by round."""
    queues = [d.queue for d in designs if d.queue is not None]
    out: dict[str, list[Run]] = {d.name: [] for d in designs}

    def prepare_run() -> None:
        filler.before(conn, queues)
        vacuum(conn, tables)

    for r in range(runs):
        for design in _rotated(designs, r):
            run = measure(
                dsn, conn, design, threads, seconds, prepare_run, f"{label} run {r + 1}/{runs}", filler.dry
            )
            filler.after(run, threads, design.batch)
            out[design.name].append(run)
    return out


def _median(runs: Sequence[Run]) -> float:
    return statistics.median(r.rate for r in runs)


def _paired(cand: Sequence[Run], base: Sequence[Run]) -> list[float]:
    return [c.rate / b.rate for c, b in zip(cand, base, strict=True)]


def reset_jobs(conn: psycopg.Connection) -> int:
    """Delete every bench job (queues ``bench%``) and vacuum; returns how many were deleted."""
    deleted = conn.execute(CLEANUP_JOBS).rowcount
    vacuum(conn, ["pglockkit.jobs"])
    return deleted


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def section_claim_complete(dsn: str, conn: psycopg.Connection, args: argparse.Namespace) -> list[dict]:
    reset_jobs(conn)
    conn.execute(BARE_SETUP)
    try:
        kit_q = Queue("bench_q", "pglockkit")
        shape_q, bare_q = Queue("bench_q", "shape"), Queue("bench_q", "bare")
        designs = [
            kit_design("pglockkit", kit_q),
            bare_design("bare SQL, same shape", shape_q),
            bare_design("bare SQL, minimal table", bare_q),
        ]
        filler = Filler(args.seconds)
        rows = []
        for clients in args.clients:
            runs = interleaved(
                dsn,
                conn,
                designs,
                clients,
                args.seconds,
                args.runs,
                ["pglockkit.jobs", *BARE_TABLES.values()],
                filler,
                f"[1] clients={clients}",
            )
            kit, shape = runs["pglockkit"], runs["bare SQL, same shape"]
            bare = runs["bare SQL, minimal table"]
            paired, paired_min = _paired(kit, shape), _paired(kit, bare)
            rows.append(
                {
                    "clients": clients,
                    "pglockkit_jobs_s": _median(kit),
                    "shape_jobs_s": _median(shape),
                    "bare_jobs_s": _median(bare),
                    "ratio": _median(kit) / _median(shape),
                    "run_ratio_min": min(paired),
                    "run_ratio_max": max(paired),
                    "ratio_minimal": _median(kit) / _median(bare),
                    "run_ratio_minimal_min": min(paired_min),
                    "run_ratio_minimal_max": max(paired_min),
                    "fill_target": filler.target,
                    "pglockkit_runs": [asdict(r) for r in kit],
                    "shape_runs": [asdict(r) for r in shape],
                    "bare_runs": [asdict(r) for r in bare],
                }
            )
    finally:
        conn.execute(BARE_DROP)
    return rows


def section_scaling(dsn: str, conn: psycopg.Connection, args: argparse.Namespace) -> list[dict]:
    reset_jobs(conn)
    work_s = args.work_ms / 1000
    queue = Queue("bench_scale", "pglockkit")
    designs = [kit_design("queue", queue, work_s), global_lock_design("global lock", work_s)]
    filler = Filler(args.seconds)
    rows = []
    for workers in args.workers:
        runs = interleaved(
            dsn,
            conn,
            designs,
            workers,
            args.seconds,
            args.runs,
            ["pglockkit.jobs"],
            filler,
            f"[2] workers={workers}",
        )
        rows.append(
            {
                "workers": workers,
                "queue_jobs_s": _median(runs["queue"]),
                "global_lock_units_s": _median(runs["global lock"]),
                "queue_runs": [asdict(r) for r in runs["queue"]],
                "global_lock_runs": [asdict(r) for r in runs["global lock"]],
            }
        )
    base = rows[0]
    for row in rows:
        row["queue_parallelism"] = row["queue_jobs_s"] / base["queue_jobs_s"]
        row["global_lock_parallelism"] = row["global_lock_units_s"] / base["global_lock_units_s"]
        row["queue_vs_global_lock"] = row["queue_jobs_s"] / row["global_lock_units_s"]
    return rows


def _table_state(conn: psycopg.Connection) -> dict[str, Any]:
    rows, size = conn.execute(
        "SELECT count(*), pg_total_relation_size('pglockkit.jobs') FROM pglockkit.jobs"
    ).fetchone()
    return {"table_rows": rows, "table_mb": size / 2**20}


def section_backlog(dsn: str, conn: psycopg.Connection, args: argparse.Namespace) -> dict[str, Any]:
    small, large = args.backlog_small, args.backlog_large
    cases = [  # (key, label, queue, pending jobs, done jobs, jobs due a day later at a higher priority)
        ("a", f"{small:,} pending", Queue("bench_backlog_small", "direct"), small, 0, 0),
        ("b", f"{large:,} pending", Queue("bench_backlog_large", "direct"), large, 0, 0),
        ("c", f"{small:,} pending + {large:,} done", Queue("bench_backlog_done", "direct"), small, large, 0),
        (
            "d",
            f"{small:,} pending + {large:,} due a day later at a higher priority",
            Queue("bench_backlog_later", "direct"),
            small,
            0,
            large,
        ),
    ]

    def run_case(key: str, label: str, queue: Queue, pending: int, done: int, later: int) -> dict[str, Any]:
        reset_jobs(conn)
        queue.pending = 0  # (a) runs more than once: its jobs went with the reset
        started = time.perf_counter()
        if done:
            conn.execute(DIRECT_DONE, (queue.name, done))
        if later:
            conn.execute(DIRECT_LATER, (queue.name, later))
        queue.top_up(conn, pending)
        vacuum(conn, ["pglockkit.jobs"])
        flushed = checkpoint(conn)
        fill_s = time.perf_counter() - started
        state = _table_state(conn)
        _log(
            f"[3] case {key} ({label}): filled in {fill_s:.1f} s, {state['table_mb']:.0f} MB"
            + ("" if flushed else " (no CHECKPOINT: the role may not; runs share the disk with its flush)")
        )
        design = kit_design("pglockkit", queue)

        def prepare_run() -> None:
            queue.top_up(conn, pending)
            vacuum(conn, ["pglockkit.jobs"])
            checkpoint(conn)

        runs = [
            measure(dsn, conn, design, 1, args.seconds, prepare_run, f"[3] case {key} run {r + 1}", None)
            for r in range(args.runs)
        ]
        return {
            "case": key,
            "label": label,
            "pending_at_start": pending,
            "done_rows": done,
            "later_rows": later,
            "fill_s": fill_s,
            **state,
            "jobs_s": _median(runs),
            "jobs_per_run_max": max(r.jobs for r in runs),
            "runs": [asdict(r) for r in runs],
        }

    # The machine's speed drifts over the minutes the cases take (other load, the disk), and the
    # cases cannot be interleaved (each needs its own table state). So (a) is measured again right
    # before each of the others, and each is compared with that (a).
    small_case, *large_cases = cases
    baselines, rows = [], []
    for case in large_cases:
        baselines.append(run_case(*small_case))
        row = run_case(*case)
        row["a_before_jobs_s"] = baselines[-1]["jobs_s"]
        row["ratio_vs_a"] = row["jobs_s"] / row["a_before_jobs_s"]
        rows.append(row)
    reset_jobs(conn)
    a_row = {**baselines[0], "runs": [run for b in baselines for run in b["runs"]], "ratio_vs_a": 1.0}
    a_row["jobs_s"] = statistics.median(b["jobs_s"] for b in baselines)
    a_row["jobs_per_run_max"] = max(b["jobs_per_run_max"] for b in baselines)
    rows.insert(0, a_row)
    return {"backlog_small": small, "backlog_large": large, "cases": rows}


def section_batch(dsn: str, conn: psycopg.Connection, args: argparse.Namespace) -> list[dict]:
    reset_jobs(conn)
    designs = [
        kit_batch_design(f"batch {b}", Queue(f"bench_batch_{b}", "pglockkit"), b) for b in args.batches
    ]
    filler = Filler(args.seconds)
    runs = interleaved(
        dsn, conn, designs, 1, args.seconds, args.runs, ["pglockkit.jobs"], filler, "[4] clients=1"
    )
    base = runs[designs[0].name]
    rows = []
    for d in designs:
        mine = runs[d.name]
        paired = _paired(mine, base)
        rows.append(
            {
                "batch": d.batch,
                "jobs_s": _median(mine),
                "claims_s": _median(mine) / d.batch,
                "ratio_vs_first": _median(mine) / _median(base),
                "run_ratio_min": min(paired),
                "run_ratio_max": max(paired),
                "runs": [asdict(r) for r in mine],
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _run_rates(runs: Sequence[dict]) -> list[float]:
    return [r["rate"] for r in runs]


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def render_markdown(env: dict[str, Any], settings: dict[str, Any], results: dict[str, Any]) -> str:
    lines = [
        "# pglockkit job queue throughput",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- server: {env['server_version']} ({env['target']})",
        f"- machine: {env['platform']}, {env['machine']}, {env['cpu']}, nproc {env['nproc']}",
        f"- client: Python {env['python']}, psycopg {env['psycopg']}, pglockkit {env['pglockkit']}",
        f"- settings: {settings['seconds']:g} s per run, {settings['runs']} runs, synchronous_commit "
        f"{settings.get('sync_commit', 'on')}; each call one autocommit "
        "statement (prepared); jobs/s as median (min-max) of runs",
        "",
        "Only the ratios are meant to be compared; absolute rates depend on the machine.",
    ]
    if "claim_complete" in results:
        lines += [
            "",
            "## 1. claim + complete vs bare SQL",
            "",
            "One job per loop: `claim_job(q, w, '5 minutes', 1)` + `complete_job(id, token)` vs the "
            "statements they wrap, `UPDATE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING` "
            "claim_job's columns + `UPDATE ... SET status = 'done'`, on a table of the same shape "
            "(`LIKE pglockkit.jobs INCLUDING ALL`: same constraints and indexes) and on a minimal table "
            "(one partial index). Runs interleaved. Ratios pglockkit/bare of the medians (per-run paired "
            "range); issue target >= 0.8 against the same shape.",
            "",
            "| clients | pglockkit jobs/s | bare, same shape | ratio (per-run range) | >= 0.8 "
            "| bare, minimal table | ratio (per-run range) |",
            "|--:|--:|--:|--:|:-:|--:|--:|",
        ]
        for r in results["claim_complete"]:
            lines.append(
                f"| {r['clients']} | {spread(_run_rates(r['pglockkit_runs']))} "
                f"| {spread(_run_rates(r['shape_runs']))} "
                f"| {r['ratio']:.2f} ({r['run_ratio_min']:.2f}-{r['run_ratio_max']:.2f}) "
                f"| {_yes(r['ratio'] >= 0.8)} "
                f"| {spread(_run_rates(r['bare_runs']))} "
                f"| {r['ratio_minimal']:.2f} "
                f"({r['run_ratio_minimal_min']:.2f}-{r['run_ratio_minimal_max']:.2f}) |"
            )
    if "scaling" in results:
        lines += [
            "",
            f"## 2. Scaling: {settings['work_ms']:g} ms of simulated work per job",
            "",
            f"Queue: claim, `sleep({settings['work_ms'] / 1000:g})`, complete. Global lock: "
            f"`pg_advisory_lock({GLOBAL_LOCK_KEY})`, sleep, `pg_advisory_unlock({GLOBAL_LOCK_KEY})`. "
            "Parallelism = throughput / throughput with 1 worker (ideal = workers). Runs interleaved.",
            "",
            "| workers | queue jobs/s | queue parallelism | global lock units/s | global lock parallelism "
            "| queue / global lock |",
            "|--:|--:|--:|--:|--:|--:|",
        ]
        for r in results["scaling"]:
            lines.append(
                f"| {r['workers']} | {spread(_run_rates(r['queue_runs']))} | {r['queue_parallelism']:.2f} "
                f"| {spread(_run_rates(r['global_lock_runs']))} | {r['global_lock_parallelism']:.2f} "
                f"| {r['queue_vs_global_lock']:.2f} |"
            )
    if "backlog" in results:
        b = results["backlog"]
        lines += [
            "",
            "## 3. Backlog independence (1 client, claim + complete)",
            "",
            "Each case alone among the bench rows of `pglockkit.jobs`, filled directly, vacuumed and "
            "checkpointed; the queue is topped up to its backlog (pending count at run start), vacuumed and "
            "checkpointed before each run. Cases run one after another (each needs its own table state); "
            "(a) runs again right before each of (b), (c), (d), which are compared with that (a), so that "
            "the machine's drift over the minutes in between does not enter the ratio. Row (a): all its "
            "runs. Issue target: ratio vs (a) within 0.8-1.2.",
            "",
            "| case | backlog | table rows | table MB | jobs/s | (a) just before, jobs/s | ratio vs (a) "
            "| within 20% |",
            "|---|---|--:|--:|--:|--:|--:|:-:|",
        ]
        for r in b["cases"]:
            before = f"{r['a_before_jobs_s']:,.0f}" if "a_before_jobs_s" in r else "-"
            lines.append(
                f"| {r['case']} | {r['label']} | {r['table_rows']:,} | {r['table_mb']:.0f} "
                f"| {spread(_run_rates(r['runs']))} | {before} | {r['ratio_vs_a']:.2f} "
                f"| {'-' if r['case'] == 'a' else _yes(0.8 <= r['ratio_vs_a'] <= 1.2)} |"
            )
        most = max(r["jobs_per_run_max"] for r in b["cases"])
        if most > b["backlog_small"] / 2:
            lines += [
                "",
                f"Note: a run claimed up to {most:,} jobs, more than half of the small backlog: the "
                "pending count fell noticeably during runs of case (a) and (c).",
            ]
    if "batch" in results:
        lines += [
            "",
            "## 4. Batch claim (1 client)",
            "",
            "`claim_job(q, w, '5 minutes', batch)` + `complete_jobs(ids, tokens)` in one call, for every "
            "batch size (batch 1 too). Runs interleaved. Ratio of the medians vs the first batch size "
            "(per-run paired range).",
            "",
            "| batch | jobs/s | claim+complete pairs/s | ratio (per-run range) |",
            "|--:|--:|--:|--:|",
        ]
        for r in results["batch"]:
            lines.append(
                f"| {r['batch']} | {spread(_run_rates(r['runs']))} | {r['claims_s']:,.0f} "
                f"| {r['ratio_vs_first']:.2f} ({r['run_ratio_min']:.2f}-{r['run_ratio_max']:.2f}) |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _sections(text: str) -> list[int]:
    values = int_list(text)
    unknown = [v for v in values if v not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; sections are 1, 2, 3, 4")
    return sorted(set(values))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.queue_throughput",
        description="Job queue throughput as ratios against baselines measured in the same run.",
    )
    add_target_arguments(parser)
    parser.add_argument("--seconds", type=positive(float), default=2.0, help="length of one run (default 2)")
    parser.add_argument("--runs", type=positive(int), default=3, help="runs per design (default 3)")
    parser.add_argument(
        "--sections",
        type=_sections,
        default=sorted(SECTIONS),
        help="comma list of sections (default 1,2,3,4)",
    )
    parser.add_argument("--clients", type=int_list, default=[1, 4], help="section 1 clients (default 1,4)")
    parser.add_argument(
        "--workers", type=int_list, default=[1, 2, 4, 8, 16], help="section 2 workers (default 1,2,4,8,16)"
    )
    parser.add_argument(
        "--work-ms", type=positive(float), default=5.0, help="section 2 simulated work per job (default 5)"
    )
    parser.add_argument(
        "--backlog-small", type=positive(int), default=10_000, help="section 3 small backlog (default 10000)"
    )
    parser.add_argument(
        "--backlog-large",
        type=positive(int),
        default=1_000_000,
        help="section 3 large backlog and done rows (default 1000000)",
    )
    parser.add_argument("--batches", type=int_list, default=[1, 10, 100], help="section 4 (default 1,10,100)")
    parser.add_argument(
        "--sync-commit",
        choices=["on", "off"],
        default="on",
        help="synchronous_commit of every bench connection (default on: durable commits, which wait for "
        "the WAL flush; off compares the server's CPU cost)",
    )
    parser.add_argument(
        "--output", type=Path, default=RESULTS_PATH, help=f"JSON path (default {RESULTS_PATH})"
    )
    return parser


def run(dsn: str, args: argparse.Namespace, target_name: str, argv: Sequence[str]) -> dict[str, Any]:
    """Measure the sections in ``args``; returns the JSON document, with the report under "markdown"."""
    if any(b > 1000 for b in args.batches):
        raise ValueError("--batches: claim_job takes batch 1 to 1000")
    pglockkit.install(dsn)
    names = ("seconds", "runs", "sections", "clients", "workers", "work_ms", "backlog_small", "backlog_large")
    settings: dict[str, Any] = {k: getattr(args, k) for k in (*names, "batches", "sync_commit")}
    if args.sync_commit == "off":
        dsn = make_conninfo(dsn, options="-c synchronous_commit=off")
    results: dict[str, Any] = {}
    runners = {1: section_claim_complete, 2: section_scaling, 3: section_backlog, 4: section_batch}
    started = time.perf_counter()
    with _connect(dsn) as conn:
        version = conn.execute("SELECT version()").fetchone()[0]
        try:
            for number in args.sections:
                t0 = time.perf_counter()
                results[SECTIONS[number]] = runners[number](dsn, conn, args)
                _log(f"section {number} done in {time.perf_counter() - t0:.0f} s")
        finally:
            conn.execute(BARE_DROP)
            deleted = reset_jobs(conn)
            _log(f"cleanup: deleted {deleted:,} bench jobs, dropped bench_bare_jobs and bench_shape_jobs")
    settings["total_s"] = round(time.perf_counter() - started, 1)
    env = environment("bench.queue_throughput", argv, target_name, version)
    return {
        "environment": env,
        "settings": settings,
        "results": results,
        "markdown": render_markdown(env, settings, results),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(b > 1000 for b in args.batches):
        parser.error("--batches: claim_job takes batch 1 to 1000")
    dsn, target_name = target(args)
    data = run(dsn, args, target_name, argv)
    print(data.pop("markdown"))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    _log(f"wrote {args.output} ({data['settings']['total_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
