"""pglockkit: coordination primitives for PostgreSQL, as SQL functions with a thin Python layer.

The SQL functions in schema ``pglockkit`` are the product; this package installs them and wraps
them for Python callers.
"""

from pglockkit.connection import connect, resolve_dsn
from pglockkit.errors import (
    Deadlock,
    DependentObjects,
    InvalidArgument,
    LimitExceeded,
    LockNotHeld,
    LockTimeout,
    NamespaceConflict,
    NotOwner,
    PayloadNotDecodable,
    PglockkitError,
    PoolerDetected,
    PreReleaseInstall,
    RetryableError,
    SerializationFailure,
    StaleToken,
    UnknownJob,
    UnknownNamespace,
    UnknownObject,
    UnknownRun,
)
from pglockkit.install import install, status, uninstall
from pglockkit.keys import lock_key, namespace_id
from pglockkit.leases import Lease, acquire_lease, check_fence, prune_leases, release_lease, renew_lease
from pglockkit.locks import (
    lock_rows,
    namespaces,
    register_namespace,
    sole_writer,
    try_xact_lock,
    xact_lock,
    xact_lock_all,
)
from pglockkit.queue import Job
from pglockkit.retry import backoff, retry
from pglockkit.runs import finish_run, prune_runs, run_once, singleton, start_run
from pglockkit.scheduling import cron_next, schedule, schedules, tick_schedules, unschedule
from pglockkit.worker import Worker

__version__ = "0.1.0"

__all__ = [
    "Deadlock",
    "DependentObjects",
    "InvalidArgument",
    "Job",
    "Lease",
    "LimitExceeded",
    "LockNotHeld",
    "LockTimeout",
    "NamespaceConflict",
    "NotOwner",
    "PayloadNotDecodable",
    "PglockkitError",
    "PoolerDetected",
    "PreReleaseInstall",
    "RetryableError",
    "SerializationFailure",
    "StaleToken",
    "UnknownJob",
    "UnknownNamespace",
    "UnknownObject",
    "UnknownRun",
    "Worker",
    "acquire_lease",
    "backoff",
    "check_fence",
    "connect",
    "cron_next",
    "finish_run",
    "install",
    "lock_key",
    "lock_rows",
    "namespace_id",
    "namespaces",
    "prune_leases",
    "prune_runs",
    "register_namespace",
    "release_lease",
    "renew_lease",
    "resolve_dsn",
    "retry",
    "run_once",
    "schedule",
    "schedules",
    "singleton",
    "sole_writer",
    "start_run",
    "status",
    "tick_schedules",
    "try_xact_lock",
    "uninstall",
    "unschedule",
    "xact_lock",
    "xact_lock_all",
]
