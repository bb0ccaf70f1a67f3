"""What the demo runs and what it measures: names, SQL, settings and the results of a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from psycopg import sql

NAMESPACE = "demo"
SCHEMA = "pglockkit_demo"
LEASE = "demo:shared-refresh"
GLOBAL_RESOURCE = "global"
DESIGNS = ("global", "queue", "sharded")
TITLES = {"global": "global lock", "queue": "queue (SKIP LOCKED)", "sharded": "sharded keys + lease"}
PHASES = {
    "global": "every unit under ONE advisory lock: xact_lock('demo', 'global'), work, commit",
    "queue": "units are jobs: claim_job (FOR UPDATE SKIP LOCKED), work, complete_job in that transaction",
    "sharded": "xact_lock('demo', 'tenant:' || t) per unit (t random); a shared refresh (a unit too), "
    "done by one agent only, behind a lease",
}
APPLICATION_NAME = "pglockkit demo"

SETUP = sql.SQL("""
DROP SCHEMA IF EXISTS {schema} CASCADE;
CREATE SCHEMA {schema};
CREATE TABLE {schema}.units (step integer NOT NULL, agent integer NOT NULL, tenant integer,
                             done_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {schema}.refreshes (step integer NOT NULL, holder text NOT NULL, token bigint NOT NULL,
                                 done_at timestamptz NOT NULL DEFAULT clock_timestamp());
""").format(schema=sql.Identifier(SCHEMA))
DROP = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA))
INSERT_UNIT = sql.SQL("INSERT INTO {}.units (step, agent, tenant) VALUES (%s, %s, %s)").format(
    sql.Identifier(SCHEMA)
)
INSERT_REFRESH = sql.SQL("INSERT INTO {}.refreshes (step, holder, token) VALUES (%s, %s, %s)").format(
    sql.Identifier(SCHEMA)
)
LIVE_LOCKS = """
SELECT key, count(*) FILTER (WHERE granted) AS holding, count(*) FILTER (WHERE NOT granted) AS waiting,
       array_agg(pid ORDER BY pid) FILTER (WHERE granted) AS holder_pids,
       extract(epoch FROM max(wait_time))::float8 AS longest_wait_s, count(*) OVER () AS keys
  FROM pglockkit.advisory_locks WHERE namespace = %s
 GROUP BY key ORDER BY waiting DESC, holding DESC LIMIT 1
"""
REPORT = """
SELECT key, samples, samples_with_waiters, max_waiters, avg_waiters::float8,
       extract(epoch FROM longest_wait)::float8, namespace_sessions::float8, namespace_parallelism::float8
  FROM pglockkit.contention_report(clock_timestamp() - %s::timestamptz) WHERE namespace = %s
"""


class NotInstalled(RuntimeError):
    """The target database lacks pglockkit (or its contention history)."""


# ---------------------------------------------------------------------------------------------
# Settings and results
# ---------------------------------------------------------------------------------------------


@dataclass
class Settings:
    """What to run. ``steps`` are the agent counts of the sweep; 1 is always measured first."""

    agents: int = 16
    steps: list[int] = field(default_factory=lambda: default_steps(16))
    seconds: float = 3.0
    work_ms: float = 50.0
    tenants: int = 64
    sample_every: float = 0.25
    refresh_every: float = 0.5
    lease_ttl: float = 5.0


def default_steps(agents: int) -> list[int]:
    """1, 2, 4, ... below ``agents``, then ``agents``."""
    steps, n = [], 1
    while n < agents:
        steps.append(n)
        n *= 2
    return [*steps, agents]


@dataclass
class Live:
    """The busiest ``demo`` key in ``pglockkit.advisory_locks``, read live during a step."""

    at_s: float
    key: int
    resource: str
    holding: int
    waiting: int
    holder_pids: list[int]
    longest_wait_s: float | None
    keys: int


@dataclass
class Report:
    """``contention_report`` for namespace ``demo`` over a step's window."""

    keys: int = 0
    top_key: int | None = None
    top_resource: str | None = None
    samples: int = 0
    samples_with_waiters: int = 0
    max_waiters: int = 0
    avg_waiters: float = 0.0
    longest_wait_s: float | None = None
    sessions: float | None = None
    parallelism: float | None = None


@dataclass
class Step:
    design: str
    agents: int
    seconds: float
    jobs: int
    jobs_s: float
    longest_wait_s: float
    rows_written: int
    parallelism: float = 0.0
    samples_taken: int = 0
    live: Live | None = None
    report: Report = field(default_factory=Report)
    refreshes: int = 0
    refreshers: list[str] = field(default_factory=list)
    queue_ran_dry: bool = False
