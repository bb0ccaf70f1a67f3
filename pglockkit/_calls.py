"""Every SQL call of the Python layer, described once and run by either driver.

A ``Call`` holds what a wrapper decides: the SQL text and its bound parameters, how the rows
become the result, and which structured log event a success or a failure emits. Argument checks
happen when a call is built. ``run`` executes a call on a ``psycopg.Connection`` (the sync
modules), ``arun`` on a ``psycopg.AsyncConnection`` (``pglockkit.aio``); both translate errors
by SQLSTATE the same way (``pglockkit._run_async``, from which ``pglockkit._run`` is generated;
``Call`` is in ``pglockkit._call``, which they share). Nothing else in the package holds SQL for
these operations.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.adapt import Loader
from psycopg.pq import Format, TransactionStatus
from psycopg.types.json import Jsonb

from pglockkit import _nscache
from pglockkit._call import Call, Rows
from pglockkit._call import nothing as _nothing
from pglockkit._run import run as run
from pglockkit._run import run_pipeline as run_pipeline
from pglockkit._run_async import arun as arun
from pglockkit._run_async import arun_pipeline as arun_pipeline
from pglockkit.errors import InvalidArgument, LockTimeout, PayloadNotDecodable, PoolerDetected, translated
from pglockkit.keys import INT_RESOURCE_LIMIT, lock_key

# The server side of the client's TCP keepalives (pglockkit.connection.KEEPALIVES): the server
# ends the session of a client host that stopped answering, and frees its session locks, after
# about idle + interval * count seconds of silence.
# Servers default to the OS's keepalive timing (two hours on Linux). Any role may set these for its
# own session; pglockkit does so on the connections that hold session locks (sole_writer, run_once,
# `pglockkit once`, leases bound to their session), with tcp_user_timeout set to the same window:
# keepalive probes are only sent while no data is in flight, so a host that vanished before
# acknowledging the server's last reply would otherwise hold its locks for the retransmission
# timeout (about 15 minutes on Linux).
# They have no effect on Unix-socket connections.
SERVER_KEEPALIVES: dict[str, int] = {
    "tcp_keepalives_idle": 10,
    "tcp_keepalives_interval": 5,
    "tcp_keepalives_count": 3,
}


Timeout = float | timedelta | None
AnyConnection = psycopg.Connection | psycopg.AsyncConnection

locks_log = logging.getLogger("pglockkit.locks")
leases_log = logging.getLogger("pglockkit.leases")
runs_log = logging.getLogger("pglockkit.runs")


def statement(text: str) -> Call[None]:
    """A fixed statement with no result (BEGIN, COMMIT, ROLLBACK)."""
    return Call(text, decode=_nothing)


# A worker's transaction stays open while its handlers run, and the server sees it idle in
# transaction whenever a handler waits outside the database (an API, a model, a sleep). A
# server's, database's or role's idle_in_transaction_session_timeout (set against bloat, and by
# managed services) ended the lane's session then: the group rolled back, its jobs came back only
# by their lease, each losing an attempt, and the next group did the same. The worker turns it off
# for its own transactions, as SET LOCAL: it ends with the transaction, so a pooler's server
# session and the worker's other statements keep the server's value. The job's lease, not this
# timeout, tells when a worker has gone silent.
KEEP_OPEN = "SET LOCAL idle_in_transaction_session_timeout = 0"


def begin_worker_transaction() -> Call[None]:
    """BEGIN and ``KEEP_OPEN`` in one statement string (one round trip, outside a pipeline)."""
    return Call(f"BEGIN; {KEEP_OPEN}", decode=_nothing)


def current_xid() -> Call[str]:
    """The open transaction's id (a worker's group), to ask later whether it committed."""
    return Call("SELECT pg_catalog.pg_current_xact_id()::text")


def xact_status(xid: str) -> Call[str | None]:
    """'committed', 'aborted' or 'in progress' (NULL if too old to tell)."""
    return Call("SELECT pg_catalog.pg_xact_status(%s::xid8)", (xid,))


def savepoint(n: int) -> Call[None]:
    return Call(sql.SQL("SAVEPOINT {}").format(sql.Identifier(f"pglockkit_{n}")), decode=_nothing)


def rollback_to(n: int) -> Call[None]:
    return Call(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(sql.Identifier(f"pglockkit_{n}")), decode=_nothing)


def seconds(value: float | timedelta, what: str = "duration") -> timedelta:
    """Seconds (float) or a timedelta, as the interval the SQL functions take. NaN is 22023 and an
    infinite or huge number 22003, as InvalidArgument naming ``what`` (they were a bare ValueError
    or OverflowError naming neither the value nor what it was for)."""
    if isinstance(value, timedelta):
        return value
    try:
        return timedelta(seconds=value)
    except (ValueError, OverflowError) as exc:
        nan = isinstance(value, float) and math.isnan(value)
        problem = "is not a number of seconds" if nan else "seconds is out of range"
        raise InvalidArgument(f"{what} {value!r} {problem}", sqlstate="22023" if nan else "22003") from exc


INT8 = (-(2**63), 2**63 - 1)


def _integer(value: object) -> int | None:
    """``value`` as a Python int if it is an integer (an int, a numpy integer: what
    ``operator.index`` takes), not a bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def int_resource(resource: object) -> object:
    """A lock resource as the SQL functions take it: an int beyond bigint went as a numeric, and
    the call failed with 42883 (no such function) instead of 22003; a bool went as a boolean (42883
    too)."""
    if isinstance(resource, bool):
        raise InvalidArgument("a lock resource is a text or an integer, got bool", sqlstate="22023")
    if isinstance(resource, int) and not INT8[0] <= resource <= INT8[1]:
        raise InvalidArgument(f"integer lock resource {resource} is out of range", sqlstate="22003")
    return resource


def lock_resources(resources: Sequence[object]) -> list:
    """``xact_lock_all``'s resources: all text or all integers (numpy's too, as Python ints). A
    Decimal or float was sent as text ('7'), so it locked another key than the integer 7 that SQL
    clients lock; a bool or a mix failed with an error naming no argument."""
    resources = list(resources)
    if all(isinstance(r, str) for r in resources):
        return resources
    ints = [_integer(r) for r in resources]
    if None in ints:
        odd = {
            type(r).__name__
            for r, i in zip(resources, ints, strict=True)
            if i is None and not isinstance(r, str)
        }
        got = ", ".join(sorted(odd)) or "text and integers mixed"
        raise InvalidArgument(
            f"xact_lock_all takes resources all text or all integers, got {got}", sqlstate="22023"
        )
    for r in ints:
        int_resource(r)
    return ints


def interval(timeout: Timeout) -> timedelta | None:
    return None if timeout is None else seconds(timeout, "timeout")


def _ms(elapsed: float) -> float:
    return round(elapsed * 1000, 1)


# --- locks ----------------------------------------------------------------------------------


INT4 = (-(2**31), 2**31 - 1)


def int4(name: str, value: int | None) -> int | None:
    """An argument of a SQL function that takes ``integer``. psycopg sends a Python int beyond
    int4 as a bigint, and the call then failed with 42883 (no such function, add casts) instead of
    a range error: refused here with 22003, naming the argument."""
    if value is not None and not INT4[0] <= value <= INT4[1]:
        raise InvalidArgument(
            f"{name} {value} is out of range (an integer: at most {INT4[1]:,})", sqlstate="22003"
        )
    return value


def lock_event(event: str, ns: str, resource: object, key: int | None, **fields: object) -> None:
    """The structured record of an acquisition, skip, timeout or release (``record.pglockkit``)."""
    if not locks_log.isEnabledFor(logging.INFO):
        return  # nobody listens: the record is not worth building on every lock call
    data = {"event": event, "namespace": ns, "resource": resource, "key": key, **fields}
    text = " ".join(f"{k}={v}" for k, v in data.items() if v is not None)
    locks_log.info("%s", text, extra={"pglockkit": data})


def require_transaction(conn: AnyConnection, what: str) -> None:
    """Refuse a transaction-level lock that an autocommit statement would release at once."""
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise ValueError(
            f"{what} takes a transaction-level lock, which an autocommit statement would release "
            "at once: call it inside `with conn.transaction():`"
        )


def register_namespace(
    name: str, id: int | None, description: str | None, lock_timeout: Timeout
) -> Call[int]:
    return Call(
        "SELECT pglockkit.register_namespace(%s, %s, %s, %s)",
        (name, int4("id", id), description, interval(lock_timeout)),
    )


NAMESPACE_COLUMNS = ("id", "name", "description", "owner", "lock_timeout", "created_at")


def _dicts(columns: tuple[str, ...]) -> Callable[[Rows], list[dict]]:
    return lambda rows: [dict(zip(columns, row, strict=True)) for row in rows]


def namespaces() -> Call[list[dict]]:
    return Call(
        f"SELECT {', '.join(NAMESPACE_COLUMNS)} FROM pglockkit.namespaces ORDER BY id",
        decode=_dicts(NAMESPACE_COLUMNS),
    )


def sample(retention: timedelta) -> Call[int]:
    return Call("SELECT pglockkit.sample(%s)", (retention,))


def resource_key(ns: str, resource: str | int) -> Call[int]:
    return Call("SELECT pglockkit.lock_key(%s, %s)", (ns, int_resource(resource)))


# The lock helpers' fast path (issue 16): the key is computed here from the namespace id cached
# per process (pglockkit._nscache), and TRY_KEY tries it: a free lock is one round trip that costs
# the server one pg_try_advisory_xact_lock, as a bare call does. The helpers (locks.py, aio.py)
# run it themselves, with no Call: in a loop of lock calls the Python between two round trips
# runs with cold caches, and building a Call and its callbacks cost 5 us there. xact_lock on a
# held key then sends WAIT_KEY, xact_lock's slow path (pglockkit._xact_lock), which checks the key
# against the registry as it is then, waits with the namespace's lock_timeout, and raises 55P03
# naming the holder. Not one CASE statement for both (tried): five parameters instead of one cost
# the client more than the second round trip of a held lock, which waits anyway; and not
# pglockkit.xact_lock itself, whose inlined fast path, its namespace a parameter here, the server
# would set up again for every call (4 us, PG 18).
# Schema-qualified: a caller's search_path cannot put another function before pg_catalog's.
TRY_KEY = "SELECT pg_catalog.pg_try_advisory_xact_lock(%s)"
WAIT_KEY = "SELECT pglockkit._xact_lock(%s, %s, %s)"
# xact_lock_all's fast path, the same way: the distinct keys, computed here, ascending. The server
# tries them in that order and stops at the first one held (an EXISTS stops at its first row), so
# that, as in pglockkit.xact_lock_all, a transaction never holds a key above one it lacks; the SQL
# function then takes them all in order, waiting (a key this transaction holds is taken again at
# once). Server time per transaction of 4 free locks, PG 18: 2 us over 4 bare locks, against 35
# for the PL/pgSQL function, whose expressions are prepared again in every transaction.
TRY_KEYS = (
    "SELECT NOT EXISTS (SELECT FROM pg_catalog.unnest(%s::pg_catalog.int8[]) AS k"
    " WHERE NOT pg_catalog.pg_try_advisory_xact_lock(k))"
)
_MAX_LOCKS = 1000  # pglockkit.xact_lock_all's limit (22023 past it)
# Which database a connection reaches, returned with the SQL lock calls for the namespace-id cache.
DATABASE_IDENTITY = (
    "(SELECT d.oid FROM pg_catalog.pg_database d"
    " WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()),"
    " pg_catalog.pg_postmaster_start_time()"
)
_LONGEST_WAIT = timedelta(days=24)  # _check_timeout's limit: PostgreSQL cannot time a longer wait


def _utf8(conn: AnyConnection) -> bool:
    """Whether text goes to the server and is stored unchanged: sha256 of its UTF-8 bytes, as SQL
    hashes it, is then what the server would hash (or refuse the same way)."""
    info = conn.info
    return info.encoding == "utf-8" and info.parameter_status("server_encoding") == "UTF8"


# Keys of the resources a process locks again and again (a tenant, a graph, a row): sha256 costs
# more than the rest of the helper's Python. Keyed by (id, resource), so no entry can go stale.
# A long text is hashed each time instead: the cache would keep up to 8,192 of them alive, and
# their hash costs more than the call's round trip saves anyway.
_cached_key = functools.lru_cache(maxsize=8192)(lock_key)
_CACHED_TEXT = 256  # characters


def _local_key(conn: AnyConnection, ns: object, resource: object) -> int | None:
    """The key of ``resource`` from the cached id of ``ns``; None where the server must decide: no
    id cached (or it is due for a refresh), or an input the SQL function refuses or might convert
    (these take the SQL call, which raises today's errors)."""
    if type(ns) is not str:
        return None
    if type(resource) is str:
        if "\x00" in resource or not (resource.isascii() or _utf8(conn)):
            return None
    elif type(resource) is not int or not 0 <= resource < INT_RESOURCE_LIMIT:
        return None
    ns_id = _nscache.cached_id(conn, ns)
    if ns_id is None:
        return None
    if type(resource) is str and len(resource) > _CACHED_TEXT:
        return lock_key(ns_id, resource)
    return _cached_key(ns_id, resource)


def _learnt(conn: AnyConnection, ns: str, rows: Rows) -> tuple[Any, ...]:
    """The row of a SQL lock call, after recording what its last three columns tell: the key (whose
    high 16 bits are the namespace id) and the database's identity."""
    row = rows[0]
    key, db_oid, server_started = row[-3:]
    _nscache.learn(conn, ns, key >> 48, db_oid, server_started)
    return row


def local_key(
    conn: AnyConnection, what: str, ns: str, resource: str | int, timeout: Timeout = None
) -> int | None:
    """The key a lock helper tries with TRY_KEY (``try_key``), or None where the SQL function must
    decide (``try_xact_lock`` and ``xact_lock`` below). Refuses an autocommit connection."""
    require_transaction(conn, what)
    if timeout is not None and not _wait_checked_locally(seconds(timeout, "timeout")):
        return None
    return _local_key(conn, ns, resource)


def local_keys(conn: AnyConnection, ns: str, resources: list, timeout: Timeout) -> list[int] | None:
    """The distinct keys, ascending, that ``xact_lock_all`` tries with TRY_KEYS (``try_keys``), or
    None where the SQL function must decide: no id cached, an empty or overlong list, resources of
    both kinds or of another, a timeout it refuses. Refuses an autocommit connection."""
    require_transaction(conn, "xact_lock_all")
    if timeout is not None and not _wait_checked_locally(seconds(timeout, "timeout")):
        return None
    if not 0 < len(resources) <= _MAX_LOCKS:
        return None
    kind = type(resources[0])
    keys = set()
    for resource in resources:
        key = _local_key(conn, ns, resource) if type(resource) is kind else None
        if key is None:
            return None
        keys.add(key)
    return sorted(keys)


def try_keys(conn: psycopg.Connection, keys: list[int]) -> bool:
    with translated():
        return conn.execute(TRY_KEYS, (keys,)).fetchone()[0]


async def atry_keys(conn: psycopg.AsyncConnection, keys: list[int]) -> bool:
    with translated():
        return (await (await conn.execute(TRY_KEYS, (keys,))).fetchone())[0]


def try_key(conn: psycopg.Connection, key: int) -> bool:
    with translated():
        return conn.execute(TRY_KEY, (key,)).fetchone()[0]


async def atry_key(conn: psycopg.AsyncConnection, key: int) -> bool:
    with translated():
        return (await (await conn.execute(TRY_KEY, (key,))).fetchone())[0]


def try_xact_lock(conn: AnyConnection, ns: str, resource: str | int) -> Call[bool]:
    """``pglockkit.try_xact_lock``, with ``lock_key`` for the cache (the helpers try the cached
    key themselves first: ``local_key``)."""
    require_transaction(conn, "try_xact_lock")
    int_resource(resource)

    def decode(rows: Rows) -> bool:
        got, key, *_ = _learnt(conn, ns, rows)
        lock_event("acquired" if got else "skipped", ns, resource, key, scope="xact")
        return got

    return Call(
        f"SELECT pglockkit.try_xact_lock(%s, %s), pglockkit.lock_key(%s, %s), {DATABASE_IDENTITY}",
        (ns, resource, ns, resource),
        decode=decode,
    )


def _wait_checked_locally(wait: timedelta | None) -> bool:
    """A timeout that ``pglockkit.xact_lock`` accepts (it raises 22023 or 22003 for the others)."""
    return wait is None or timedelta(0) < wait <= _LONGEST_WAIT


def xact_lock(
    conn: AnyConnection, ns: str, resource: str | int, timeout: Timeout, held: int | None = None
) -> Call[int]:
    """``pglockkit.xact_lock``, which also teaches the cache; or, for ``held``, the key the helper
    computed and found held, xact_lock's slow path alone (the wait)."""
    require_transaction(conn, "xact_lock")
    int_resource(resource)
    wait = interval(timeout)

    def failed(exc: Exception, elapsed: float) -> int:
        if isinstance(exc, LockTimeout):
            if timeout is not None:
                exc.retry_after = seconds(timeout).total_seconds()
            lock_event("timeout", ns, resource, held, scope="xact", wait_ms=_ms(elapsed))
        raise exc

    def done(key: int, elapsed: float) -> None:
        lock_event("acquired", ns, resource, key, scope="xact", wait_ms=_ms(elapsed))

    if held is not None:
        return Call(WAIT_KEY, (ns, resource, wait), done=done, failed=failed)
    return Call(
        f"SELECT pglockkit.xact_lock(%s, %s, %s), {DATABASE_IDENTITY}",
        (ns, resource, wait),
        decode=lambda rows: _learnt(conn, ns, rows)[0],
        done=done,
        failed=failed,
    )


def xact_lock_all(
    conn: AnyConnection, ns: str, resources: Sequence[str] | Sequence[int], timeout: Timeout
) -> Call[list[int]]:
    """``pglockkit.xact_lock_all``, which also teaches the cache (its keys' high bits are the
    namespace's id); the helpers try ``local_keys`` themselves first."""
    require_transaction(conn, "xact_lock_all")
    resources = lock_resources(resources)
    ints = resources and not isinstance(resources[0], str)

    def decode(rows: Rows) -> list[int]:
        keys, db_oid, server_started = rows[0]
        if keys:
            _nscache.learn(conn, ns, keys[0] >> 48, db_oid, server_started)
        return keys

    def failed(exc: Exception, elapsed: float) -> list[int]:
        if isinstance(exc, LockTimeout):
            if timeout is not None:
                exc.retry_after = seconds(timeout).total_seconds()
            lock_event("timeout", ns, f"{len(resources)} resources", None, scope="xact", wait_ms=_ms(elapsed))
        raise exc

    return Call(
        XACT_LOCK_ALL_INTS if ints else XACT_LOCK_ALL_TEXTS,
        (ns, resources, interval(timeout)),
        decode=decode,
        done=lambda keys, elapsed: all_acquired(ns, keys, _ms(elapsed)),
        failed=failed,
    )


def all_acquired(ns: str, keys: list[int], wait_ms: float) -> None:
    """The log event of an ``xact_lock_all`` that got its locks (fast path or SQL function)."""
    lock_event("acquired", ns, f"{len(keys)} resources", None, scope="xact", wait_ms=wait_ms)


XACT_LOCK_ALL_TEXTS = f"SELECT pglockkit.xact_lock_all(%s, %s::text[], %s), {DATABASE_IDENTITY}"
XACT_LOCK_ALL_INTS = f"SELECT pglockkit.xact_lock_all(%s, %s::bigint[], %s), {DATABASE_IDENTITY}"


def lock_rows(conn: AnyConnection, table: str, ids: Sequence[int], timeout: Timeout) -> Call[int]:
    require_transaction(conn, "lock_rows")
    ids = list(ids)
    integers = [_integer(i) for i in ids]
    if None in integers:  # a Decimal('1.5') or 1.5 went as a bigint, 2: another row
        odd = sorted({type(i).__name__ for i, n in zip(ids, integers, strict=True) if n is None})
        raise InvalidArgument(f"lock_rows takes integer ids, got {', '.join(odd)}", sqlstate="22023")
    return Call(
        "SELECT pglockkit.lock_rows(%s::regclass, %s::bigint[], %s)", (table, integers, interval(timeout))
    )


def refuse_pooler(
    conn: AnyConnection, who: str = "sole_writer", instead: str = "use xact_lock inside a transaction"
) -> Call[None]:
    """Raises ``PoolerDetected`` unless ``conn`` reaches the server directly; the message names
    ``who`` needs the direct connection and what to do ``instead``.

    PostgreSQL's BackendKeyData carries the pid of the backend serving the connection; a pooler
    (PgBouncer) or proxy answers the startup itself with a key of its own, so the pid differs."""
    client_pid = conn.info.backend_pid

    def decode(rows: Rows) -> None:
        server_pid = rows[0][0]
        if client_pid != server_pid:
            raise PoolerDetected(
                f"{who} needs a direct connection to PostgreSQL, but a connection pooler or proxy "
                f"was detected (client-side pid {client_pid}, server pid {server_pid}): a session lock "
                "taken through it can stay on a server session that serves other clients. Pass a DSN "
                f"that reaches PostgreSQL directly (not PgBouncer), or {instead}.",
                client_pid=client_pid,
                server_pid=server_pid,
            )

    return Call("SELECT pg_backend_pid()", decode=decode)


# What `pglockkit once` and run_once say through a pooler: the slot's lock is a session lock.
ONCE_POOLER = ("pglockkit once", "run it where it reaches PostgreSQL directly")
RUN_ONCE_POOLER = ("run_once", "pass a DSN that does")

# What Lease(bind_session=True) says through a pooler: the session key would stay on a pooled
# server session, so the lease would not end with its holder's connection.
BOUND_LEASE = ("Lease(bind_session=True)", "leave bind_session off (the lease then ends with its ttl)")


def server_keepalives(window: dict[str, int] | None) -> Call[None]:
    """``set_server_keepalives``: the session's ``tcp_keepalives_*`` and ``tcp_user_timeout``, and
    ``idle_session_timeout`` off."""
    settings = {**SERVER_KEEPALIVES, **(window or {})}
    unknown = set(settings) - set(SERVER_KEEPALIVES)
    if unknown:
        raise ValueError(f"unknown keepalive settings {sorted(unknown)}; use {sorted(SERVER_KEEPALIVES)}")
    for name, value in settings.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    window_s = (
        settings["tcp_keepalives_idle"]
        + settings["tcp_keepalives_interval"] * settings["tcp_keepalives_count"]
    )
    settings["tcp_user_timeout"] = window_s * 1000  # milliseconds
    # These sessions sit idle for as long as the block or command that their lock protects runs:
    # a server's, database's or role's idle_session_timeout would end them, and free the lock,
    # while it still runs. Any role may turn it off for its own session.
    settings["idle_session_timeout"] = 0
    return Call(
        "SELECT pg_catalog.set_config(k, v, false) FROM unnest(%s::text[], %s::text[]) AS s(k, v)",
        (list(settings), [str(v) for v in settings.values()]),
        decode=_nothing,
    )


def try_session_lock(conn: AnyConnection, ns: str, resource: str | int) -> Call[tuple[int, bool]]:
    """``sole_writer``'s try-lock: (key, got); logs the acquisition (a skip is logged by
    ``lock_holders``, which names the holder)."""
    backend_pid = conn.info.backend_pid
    int_resource(resource)

    def done(result: tuple[int, bool], elapsed: float) -> None:
        key, got = result
        if got:
            lock_event(
                "acquired", ns, resource, key, scope="session", backend_pid=backend_pid, wait_ms=_ms(elapsed)
            )

    return Call(
        "SELECT pglockkit.lock_key(%s, %s), pglockkit.try_lock(%s, %s)",
        (ns, resource, ns, resource),
        decode=lambda rows: (rows[0][0], rows[0][1]),
        done=done,
    )


def lock_holders(ns: str, resource: str | int, key: int) -> Call[str | None]:
    """Who holds ``key``, logged as a skip."""
    return Call(
        "SELECT pglockkit._lock_holders(%s)",
        (key,),
        done=lambda holders, _: lock_event(
            "skipped", ns, resource, key, scope="session", held_by_pid=holders
        ),
    )


def session_unlock(ns: str, resource: str | int, key: int, acquired_at: float) -> Call[None]:
    """Release ``sole_writer``'s lock; a session already gone released it with itself."""

    def hold_ms() -> float:
        return _ms(time.monotonic() - acquired_at)

    def failed(exc: Exception, _: float) -> None:
        if not isinstance(exc, psycopg.OperationalError):
            raise exc
        # The session is gone (a killed backend, the network, a server restart): the server freed
        # the lock with it, at a moment nobody knows, perhaps while the block still ran. Another
        # process may have held the lock meanwhile: a warning, never a quiet "released".
        data = {"event": "lost", "namespace": ns, "resource": resource, "key": key, "scope": "session"}
        locks_log.warning(
            "sole_writer lost its lock %s/%s: %s while it held the lock, which went with it; another "
            "process may have held it before the block ended",
            ns, resource, connection_lost(exc), extra={"pglockkit": {**data, "hold_ms": hold_ms()}},
        )  # fmt: skip

    # By the key it took: the namespace may have been registered again meanwhile (another id), and
    # unlock(ns, resource) would look for another key, held by nobody (55000 after a good block).
    return Call(
        "SELECT pglockkit._unlock(%s, %s, %s)",
        (ns, str(resource), key),
        decode=_nothing,
        done=lambda _, __: lock_event("released", ns, resource, key, scope="session", hold_ms=hold_ms()),
        failed=failed,
    )


# --- leases ---------------------------------------------------------------------------------


def acquire_lease(name: str, holder: str, ttl: float | timedelta, bind_session: bool) -> Call[int | None]:
    return Call("SELECT pglockkit.acquire_lease(%s, %s, %s, %s)", (name, holder, seconds(ttl), bind_session))


def renew_lease(name: str, holder: str, token: int, ttl: float | timedelta) -> Call[bool]:
    return Call("SELECT pglockkit.renew_lease(%s, %s, %s, %s)", (name, holder, token, seconds(ttl)))


def release_lease(name: str, holder: str, token: int) -> Call[bool]:
    return Call("SELECT pglockkit.release_lease(%s, %s, %s)", (name, holder, token))


def check_fence(conn: AnyConnection, name: str, token: int) -> Call[None]:
    # It holds the lease's row until the transaction ends: that is what fences the write after it.
    require_transaction(conn, "check_fence")
    return Call("SELECT pglockkit.check_fence(%s, %s)", (name, token), decode=_nothing)


def prune_leases(older_than: float | timedelta) -> Call[int]:
    return Call("SELECT pglockkit.prune_leases(%s)", (seconds(older_than),))


LEASE_COLUMNS = ("name", "holder", "token", "live", "expires_in", "session_bound")


def leases() -> Call[list[dict]]:
    return Call(
        "SELECT name, holder, token, live, date_trunc('milliseconds', expires_in), session_bound "
        "FROM pglockkit.lease_status ORDER BY name",
        decode=_dicts(LEASE_COLUMNS),
    )


def lease_acquire_event(name: str, holder: str, token: int | None) -> None:
    state = "acquired" if token is not None else "busy"
    leases_log.info("lease %s name=%s holder=%s token=%s", state, name, holder, token)


def lease_lost_event(name: str, holder: str, token: int | None, reason: str) -> None:
    leases_log.warning("lease lost name=%s holder=%s token=%s reason=%s", name, holder, token, reason)


def lease_release_event(name: str, holder: str, token: int | None) -> None:
    leases_log.info("lease released name=%s holder=%s token=%s", name, holder, token)


def renewal_error(exc: Exception) -> str:
    """``lost_reason`` of a renewal that raised."""
    return f"renewal failed: {exc.__class__.__name__}: {str(exc).strip()}"


def lease_release_wait(seconds: float) -> Call[None]:
    """How long a leaving lease's release may wait for its row: the rest of the ttl (a session
    setting: the lease's connection is its own, and closed after the release)."""
    # At most what the server can time (2^31 - 1 ms, about 24.8 days): a ttl of a month gave "invalid
    # value for parameter lock_timeout", and the lease was not released at all.
    ms = min(max(1, math.ceil(seconds * 1000)), 2**31 - 1)
    return Call("SELECT set_config('lock_timeout', %s, false)", (f"{ms}ms",), decode=_nothing)


def lease_release_timed_out(name: str) -> None:
    leases_log.warning(
        "lease %s not released: its row stayed locked for the rest of its ttl (a transaction that ran "
        "check_fence on it is still open: the one around this block?); it expires at its ttl",
        name,
    )


RENEWAL_REFUSED = "renewal refused: the lease expired or changed hands"
RENEWAL_UNANSWERED = "no renewal answered within the ttl"


# --- queue ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """A claimed job. ``token`` is the fencing token of this claim; ``concurrency_key`` the job's
    key (None if it has none)."""

    id: int
    queue: str
    payload: Any
    attempt: int
    max_attempts: int
    token: int
    lease_expires_at: datetime
    concurrency_key: str | None = None


Job.__module__ = "pglockkit.queue"  # its public home


def enqueue(
    queue: str,
    payload: Any,
    *,
    run_at: datetime | None,
    delay: float | timedelta | None,
    priority: int,
    dedup_key: str | None,
    max_attempts: int,
    concurrency_key: str | None,
    concurrency_limit: int | None,
    rate_key: str | None = None,
) -> Call[int]:
    if run_at is not None and delay is not None:
        raise ValueError("give run_at or delay, not both")
    when = "now()" if run_at is None and delay is None else "%(run_at)s"
    if delay is not None:
        when = "clock_timestamp() + %(delay)s"
    return Call(
        f"SELECT pglockkit.enqueue_job(%(queue)s, %(payload)s, {when}, %(priority)s, %(dedup)s, %(max)s, "
        "%(ckey)s, %(climit)s, %(rkey)s)",
        {
            "queue": queue,
            "payload": Jsonb({} if payload is None else payload),
            "run_at": run_at,
            "delay": None if delay is None else seconds(delay),
            "priority": int4("priority", priority),
            "dedup": dedup_key,
            "ckey": concurrency_key,
            "climit": int4("concurrency_limit", concurrency_limit),
            "rkey": rate_key,
            "max": int4("max_attempts", max_attempts),
        },
    )


def enqueue_many(
    queue: str, payloads: Sequence[Any], priority: int, max_attempts: int, rate_key: str | None = None
) -> Call[list[int]]:
    return Call(
        "SELECT pglockkit.enqueue_jobs(%s, %s::jsonb[], now(), %s, %s, %s)",
        (
            queue,
            [Jsonb(p) for p in payloads],
            int4("priority", priority),
            int4("max_attempts", max_attempts),
            rate_key,
        ),
    )


class UndecodablePayload:
    """A claimed job's payload that PostgreSQL stored and the client's JSON loader cannot decode
    (an integer over Python's 4,300-digit limit, arrays nested past the recursion limit):
    ``error`` is what the loader raised. A worker fails the job with it; its handler never runs."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error

    def __repr__(self) -> str:
        return f"<undecodable payload: {first_line(self.error)}>"


class _TolerantJsonbLoader(Loader):
    """The jsonb loader in use (json.loads, or what set_json_loads gave, globally or to the
    connection), returning an ``UndecodablePayload`` where it raises: one bad payload made the
    whole claim's fetch raise after the claim had committed, and its batch went back only by
    lease, an attempt burnt."""

    def __init__(self, oid: int, context: Any = None):
        super().__init__(oid, context)
        adapters = self.connection.adapters if self.connection is not None else psycopg.adapters
        self._load = adapters.get_loader(oid, Format.TEXT)(oid, context).load

    def load(self, data: Any) -> Any:
        try:
            return self._load(data)
        except Exception as exc:  # ValueError, RecursionError: whatever the loads raised
            return UndecodablePayload(exc)


def _tolerant_payloads(cur: Any) -> None:
    cur.adapters.register_loader("jsonb", _TolerantJsonbLoader)


def _jobs(rows: Rows) -> list[Job]:
    return [Job(*row) for row in rows]


def _decoded_jobs(rows: Rows) -> list[Job]:
    jobs = _jobs(rows)
    bad = [job for job in jobs if isinstance(job.payload, UndecodablePayload)]
    if bad:
        raise PayloadNotDecodable(
            f"job {bad[0].id}'s payload cannot be decoded here ({first_line(bad[0].payload.error)}); "
            f"this claim holds {len(jobs)} job(s) until their lease ends: fail or release each "
            "(the error's jobs)",
            jobs=jobs,
        )
    return jobs


def claim(
    queue: str, worker: str, lease: float | timedelta, batch: int, *, tolerant: bool = False
) -> Call[list[Job]]:
    """``tolerant`` (a worker's claim): a payload the JSON loader cannot decode comes as an
    ``UndecodablePayload``; else the claim raises ``PayloadNotDecodable``."""
    return Call(
        "SELECT id, queue, payload, attempt, max_attempts, token, lease_expires_at, concurrency_key "
        "FROM pglockkit.claim_job(%s, %s, %s, %s)",
        (queue, worker, seconds(lease), int4("batch", batch)),
        decode=_jobs if tolerant else _decoded_jobs,
        adapt=_tolerant_payloads,
    )


def complete(job: Job) -> Call[bool]:
    return Call("SELECT pglockkit.complete_job(%s, %s)", (job.id, job.token))


def complete_many(jobs: Sequence[Job]) -> Call[int]:
    return Call(
        "SELECT pglockkit.complete_jobs(%s::bigint[], %s::bigint[])",
        ([j.id for j in jobs], [j.token for j in jobs]),
    )


def lock_jobs(jobs: Sequence[Job]) -> Call[None]:
    """Lock these claims' job rows in id order, waiting for each (``_lock_jobs``)."""
    return Call(
        "SELECT pglockkit._lock_jobs(%s::bigint[], %s::bigint[])",
        ([j.id for j in jobs], [j.token for j in jobs]),
        decode=_nothing,
    )


def fail(job: Job, error: str, retry_in: float | timedelta | None) -> Call[str]:
    return Call(
        "SELECT pglockkit.fail_job(%s, %s, %s, %s)",
        (job.id, job.token, error, None if retry_in is None else seconds(retry_in)),
    )


def extend(job: Job, lease: float | timedelta) -> Call[bool]:
    return Call("SELECT pglockkit.extend_job(%s, %s, %s)", (job.id, job.token, seconds(lease)))


def extend_many(jobs: Sequence[Job], lease: float | timedelta) -> Call[int]:
    return Call(
        "SELECT pglockkit.extend_jobs(%s::bigint[], %s::bigint[], %s)",
        ([j.id for j in jobs], [j.token for j in jobs], seconds(lease)),
    )


def release(job: Job) -> Call[bool]:
    return Call("SELECT pglockkit.release_job(%s, %s)", (job.id, job.token))


def cancel(job_id: int) -> Call[bool]:
    return Call("SELECT pglockkit.cancel_job(%s)", (job_id,))


def set_rate_limit(queue: str, key: str, rate: int, per: float | timedelta, burst: int) -> Call[None]:
    return Call(
        "SELECT pglockkit.set_rate_limit(%s, %s, %s, %s, %s)",
        (queue, key, int4("rate", rate), seconds(per), int4("burst", burst)),
        decode=_nothing,
    )


def _schema_before(exc: Exception, _elapsed: float) -> None:
    """A call's ``failed`` for a function that a database installed before it lacks: None."""
    if getattr(exc, "sqlstate", None) == "42883":  # undefined_function
        return None
    raise exc


def connection_slots() -> Call[tuple[int, int]]:
    """The connections this session's role may hold on the server (``max_connections``, less
    ``superuser_reserved_connections`` for a role that is not a superuser), and
    ``max_connections``."""
    return Call(
        "SELECT current_setting('max_connections')::int - CASE WHEN r.rolsuper THEN 0"
        " ELSE current_setting('superuser_reserved_connections')::int END,"
        " current_setting('max_connections')::int"
        " FROM pg_catalog.pg_roles r WHERE r.rolname = current_user",
        decode=lambda rows: tuple(rows[0]),
    )


def next_rate_token(queue: str) -> Call[float | None]:
    """Seconds until a rate-limited key of ``queue`` that has due jobs gets its next token; None
    when no due job waits for one (or the database predates the function: 0016)."""
    return Call(
        "SELECT extract(epoch FROM pglockkit.next_rate_token(%s))::float8", (queue,), failed=_schema_before
    )


def remove_rate_limit(queue: str, key: str) -> Call[bool]:
    return Call("SELECT pglockkit.remove_rate_limit(%s, %s)", (queue, key))


RATE_LIMIT_COLUMNS = ("queue", "key", "rate", "per", "burst", "next_allowed_at", "tokens", "waiting")


def rate_limits(queue: str | None) -> Call[list[dict]]:
    return Call(
        f"SELECT {', '.join(RATE_LIMIT_COLUMNS)} FROM pglockkit.rate_limits "
        "WHERE %s::text IS NULL OR queue = %s ORDER BY queue, key",
        (queue, queue),
        decode=_dicts(RATE_LIMIT_COLUMNS),
    )


def pause_queue(queue: str) -> Call[bool]:
    return Call("SELECT pglockkit.pause_queue(%s)", (queue,))


def resume_queue(queue: str) -> Call[bool]:
    return Call("SELECT pglockkit.resume_queue(%s)", (queue,))


JOB_LIST_COLUMNS = ("id", "status", "priority", "attempts", "run_at", "worker", "payload", "last_error")


def jobs(queue: str, status: str | None, limit: int) -> Call[list[dict]]:
    return Call(
        "SELECT id, status, priority, attempt || '/' || max_attempts, "
        # As text: a run_at of +-infinity (stored before enqueue refused it) has no Python datetime.
        "date_trunc('seconds', run_at)::text, worker, left(payload::text, 40), left(last_error, 40) "
        "FROM pglockkit.list_jobs(%s, %s, %s)",
        (queue, status, int4("limit", limit)),
        decode=_dicts(JOB_LIST_COLUMNS),
    )


# --- runs -----------------------------------------------------------------------------------


def start_run(job: str, slot: str, holder: str) -> Call[int | None]:
    return Call("SELECT pglockkit.start_run(%s, %s, %s)", (job, slot, holder))


def finish_run(run_id: int, ok: bool, detail: str | None) -> Call[bool]:
    return Call("SELECT pglockkit.finish_run(%s, %s, %s)", (run_id, ok, detail))


def prune_runs(older_than: float | timedelta) -> Call[int]:
    return Call("SELECT pglockkit.prune_runs(%s)", (seconds(older_than),))


RUN_COLUMNS = ("id", "job", "slot", "holder", "status", "attempt", "started_at", "duration", "detail")


def runs(job: str | None, limit: int) -> Call[list[dict]]:
    return Call(
        "SELECT id, job, slot, holder, status, attempt, date_trunc('seconds', started_at) AS started_at, "
        "date_trunc('milliseconds', duration), detail FROM pglockkit.run_history "
        "WHERE %s::text IS NULL OR job = %s ORDER BY run_history.started_at DESC, id DESC LIMIT %s",
        (job, job, limit),
        decode=_dicts(RUN_COLUMNS),
    )


def run_event(
    event: str, job: str, slot: str, run_id: int | None, error: BaseException | None = None
) -> None:
    """``run_once``'s log lines: skipped, started, failed, succeeded, and unrecorded (a failure
    whose session was gone when it was to be recorded: ``error``)."""
    if event == "skipped":
        runs_log.info("run skipped job=%s slot=%s (already ran or running elsewhere)", job, slot)
    elif event == "unrecorded":
        runs_log.warning(
            "run job=%s slot=%s id=%s ended and was not recorded (%s): the next run_once of the "
            "slot may run it again",
            job, slot, run_id, error or "this session no longer holds the slot",
        )  # fmt: skip
    else:
        runs_log.info("run %s job=%s slot=%s id=%s", event, job, slot, run_id)


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` makes a coroutine without running anything: an ``async def``, a
    ``functools.partial`` of one, an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or (
        callable(fn) and inspect.iscoroutinefunction(type(fn).__call__)
    )


def check_flavour(fn: object, what: str, twin: str, *, coroutine: bool) -> None:
    """A TypeError naming the twin (``pglockkit.aio.X`` or ``pglockkit.X``), before anything runs,
    if ``fn`` is not of ``what``'s flavour. A sync helper given a coroutine function would call it,
    get a coroutine and never await it (its body would not run, or run later, outside what the
    helper holds); an async one given a plain function would run it and fail to await its result."""
    if coroutine and not is_async_callable(fn):
        raise TypeError(
            f"{what} awaits a coroutine function (an async def, or a functools.partial of one), "
            f"not {fn!r}: use {twin} for a plain function"
        )
    if not coroutine and is_async_callable(fn):
        raise TypeError(f"{what} takes a plain function, not the coroutine function {fn!r}: use {twin}")


def first_line(exc: BaseException) -> str:
    """An error's first line (psycopg adds libpq's lines, a DETAIL or a CONTEXT below), or its
    class's name if it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def outlived(conn: Any) -> bool:
    """Whether ``conn`` outlived the ``OperationalError`` it raised: a statement cancelled by a
    statement_timeout (57014), a lock_timeout (55P03) or pg_cancel_backend leaves it open and
    usable, where a lost connection leaves it closed or broken."""
    return conn is not None and not conn.closed and not conn.broken


def connection_lost(exc: BaseException) -> str:
    """What a lost connection's error says, on one line."""
    return f"the connection was lost ({first_line(exc)})"


def unrecorded_success(job: str, slot: str, run_id: int, lost: psycopg.OperationalError) -> Exception:
    """What ``run_once`` raises when its body succeeded and the outcome could not be recorded."""
    return psycopg.OperationalError(
        f"run {run_id} of {job}/{slot} succeeded, but the outcome was not recorded: "
        f"{connection_lost(lost)}; the slot may run again"
    )


def sql_text(text: str, encoding: str = "utf-8") -> str:
    """``text`` as the server can store it: a NUL byte, which text cannot hold, written ``\\x00``,
    and what the connection's ``encoding`` cannot carry (a lone surrogate from a file name, a
    character a LATIN1 database lacks) as Python's backslash escapes."""
    return text.replace("\x00", "\\x00").encode(encoding, "backslashreplace").decode(encoding)


def run_failure_detail(exc: BaseException, encoding: str = "utf-8") -> str:
    return sql_text(f"{exc.__class__.__name__}: {exc}", encoding)


# --- schedules ------------------------------------------------------------------------------

SCHEDULE_COLUMNS = (
    "name", "cron", "timezone", "queue", "payload", "priority", "max_attempts", "catch_up",
    "next_run", "last_run", "last_job_id", "last_error",
)  # fmt: skip


def schedule(
    name: str,
    cron: str,
    queue: str,
    payload: Any,
    timezone: str,
    priority: int,
    max_attempts: int,
    catch_up: int,
) -> Call[datetime]:
    return Call(
        "SELECT pglockkit.schedule(%s, %s, %s, %s, %s, %s, %s, %s)",
        (
            name,
            cron,
            queue,
            Jsonb({} if payload is None else payload),
            timezone,
            int4("priority", priority),
            int4("max_attempts", max_attempts),
            int4("catch_up", catch_up),
        ),
    )


def unschedule(name: str) -> Call[bool]:
    return Call("SELECT pglockkit.unschedule(%s)", (name,))


def schedules() -> Call[list[dict]]:
    return Call(
        f"SELECT {', '.join(SCHEDULE_COLUMNS)} FROM pglockkit.schedules ORDER BY name",
        decode=_dicts(SCHEDULE_COLUMNS),
    )


def tick_schedules() -> Call[int]:
    return Call("SELECT pglockkit.tick_schedules()")


def cron_next(cron: str, after: datetime | None, timezone: str) -> Call[datetime]:
    if after is None:
        return Call("SELECT pglockkit.cron_next(%s, clock_timestamp(), %s)", (cron, timezone))
    return Call("SELECT pglockkit.cron_next(%s, %s, %s)", (cron, after, timezone))
