"""pglockkit on ``psycopg.AsyncConnection``, for async code (agent frameworks, web handlers).

The same operations, names and arguments as ``pglockkit.locks``, ``leases``, ``queue`` and
``runs``, awaited. Each one runs the call description the sync function runs
(``pglockkit._calls``): the SQL, argument checks, result decoding, error translation and log
records are the same by construction.

>>> import pglockkit.aio as aio  # doctest: +SKIP
>>> async with await aio.connect(dsn) as conn:
...     async with conn.transaction():
...         await aio.xact_lock(conn, "billing", "invoice:7", timeout=0.2)
>>> async with aio.sole_writer(dsn, "graphs", "restock_plan") as mine:
...     if mine:
...         await graph.ainvoke(state)
"""

from __future__ import annotations

from typing import TypeVar

from pglockkit._calls import Job
from pglockkit.connection import aconnect as connect
from pglockkit.connection import aset_server_keepalives as set_server_keepalives
from pglockkit.leases_async import (
    Lease,
    acquire_lease,
    check_fence,
    leases,
    prune_leases,
    release_lease,
    renew_lease,
)
from pglockkit.locks_async import (
    lock_rows,
    namespaces,
    register_namespace,
    resource_key,
    sole_writer,
    try_xact_lock,
    xact_lock,
    xact_lock_all,
)
from pglockkit.queue_async import (
    cancel,
    claim,
    complete,
    complete_many,
    enqueue,
    enqueue_many,
    extend,
    extend_many,
    fail,
    jobs,
    pause,
    rate_limits,
    release,
    remove_rate_limit,
    resume,
    set_rate_limit,
)
from pglockkit.retry_async import retry
from pglockkit.runs_async import finish_run, prune_runs, run_once, runs, singleton, start_run
from pglockkit.scheduling_async import cron_next, schedule, schedules, tick_schedules, unschedule
from pglockkit.worker.driver_async import Worker

T = TypeVar("T")

__all__ = [
    "Job",
    "Lease",
    "Worker",
    "acquire_lease",
    "cancel",
    "check_fence",
    "claim",
    "complete",
    "complete_many",
    "connect",
    "cron_next",
    "enqueue",
    "enqueue_many",
    "extend",
    "extend_many",
    "fail",
    "finish_run",
    "jobs",
    "leases",
    "lock_rows",
    "namespaces",
    "pause",
    "prune_leases",
    "prune_runs",
    "rate_limits",
    "register_namespace",
    "release",
    "release_lease",
    "remove_rate_limit",
    "renew_lease",
    "resource_key",
    "resume",
    "retry",
    "run_once",
    "runs",
    "schedule",
    "schedules",
    "set_rate_limit",
    "set_server_keepalives",
    "singleton",
    "sole_writer",
    "start_run",
    "tick_schedules",
    "try_xact_lock",
    "unschedule",
    "xact_lock",
    "xact_lock_all",
]


# --- queue ----------------------------------------------------------------------------------
