"""Advisory-lock helpers: thin wrappers over the SQL functions, with structured logging.

Every function here runs a call description of ``pglockkit._calls``. ``try_xact_lock`` and
``xact_lock`` compute the key locally from the namespace id cached per process
(``pglockkit._nscache``) and try it with one ``pg_try_advisory_xact_lock``; ``xact_lock`` then
calls the SQL function's wait only if the key is held; ``xact_lock_all`` tries its keys the same
way, in ascending order, and calls the SQL function if one is held. A namespace not cached and bad
input go to the SQL functions. Waits, timeouts and errors are decided in SQL, as for every
function here.

One source: the lock functions of ``pglockkit.aio`` are this module as written (awaited, on an
async connection), and ``tools/async_to_sync.py`` writes ``pglockkit.locks`` from it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import psycopg

from pglockkit import _calls
from pglockkit._calls import Timeout
from pglockkit.connection import aconnect, aset_server_keepalives


async def register_namespace(
    conn: psycopg.AsyncConnection,
    name: str,
    id: int | None = None,
    description: str | None = None,
    lock_timeout: Timeout = None,
) -> int:
    """Register (idempotently) a lock namespace; returns its id.

    >>> await register_namespace(conn, "billing", description="invoices")  # doctest: +SKIP
    3222
    """
    return await _calls.arun(conn, _calls.register_namespace(name, id, description, lock_timeout))


async def namespaces(conn: psycopg.AsyncConnection) -> list[dict]:
    """The namespace registry, ordered by id."""
    return await _calls.arun(conn, _calls.namespaces())


async def resource_key(conn: psycopg.AsyncConnection, ns: str, resource: str | int) -> int:
    """The advisory-lock key of ``resource`` in namespace ``ns`` (by name), as the server computes
    it with ``pglockkit.lock_key``; raises ``UnknownNamespace`` for an unregistered name. (Offline,
    from the namespace id: ``pglockkit.keys.lock_key``.)"""
    return await _calls.arun(conn, _calls.resource_key(ns, resource))


async def try_xact_lock(conn: psycopg.AsyncConnection, ns: str, resource: str | int) -> bool:
    """Take a transaction-level lock if free; False at once otherwise.

    >>> async with conn.transaction():  # doctest: +SKIP
    ...     if await try_xact_lock(conn, "cron", "nightly"):
    ...         await record_run(conn)
    """
    key = _calls.local_key(conn, "try_xact_lock", ns, resource)
    if key is None:
        return await _calls.arun(conn, _calls.try_xact_lock(conn, ns, resource))
    got = await _calls.atry_key(conn, key)
    _calls.lock_event("acquired" if got else "skipped", ns, resource, key, scope="xact")
    return got


async def xact_lock(
    conn: psycopg.AsyncConnection, ns: str, resource: str | int, timeout: Timeout = None
) -> int:
    """Take a transaction-level lock, waiting at most ``timeout`` (seconds or timedelta).

    Without a timeout the namespace's default applies, else the server's ``lock_timeout``.
    Raises ``LockTimeout`` (55P03) when the wait runs out. Returns the key.

    >>> async with conn.transaction():  # doctest: +SKIP
    ...     await xact_lock(conn, "billing", "invoice:42", timeout=2)
    ...     await conn.execute("UPDATE invoices SET ...")
    """
    key = _calls.local_key(conn, "xact_lock", ns, resource, timeout)
    if key is not None and await _calls.atry_key(conn, key):
        _calls.lock_event("acquired", ns, resource, key, scope="xact", wait_ms=0.0)
        return key
    return await _calls.arun(conn, _calls.xact_lock(conn, ns, resource, timeout, held=key))


async def xact_lock_all(
    conn: psycopg.AsyncConnection, ns: str, resources: Sequence[str] | Sequence[int], timeout: Timeout = None
) -> list[int]:
    """Lock many resources for the transaction, in ascending key order (no deadlocks between
    callers), within one ``timeout`` for the whole call. Returns the keys in the order taken.
    """
    resources = list(resources)  # any iterable, read once
    keys = _calls.local_keys(conn, ns, resources, timeout)
    if keys is not None and await _calls.atry_keys(conn, keys):
        _calls.all_acquired(ns, keys, 0.0)
        return keys
    return await _calls.arun(conn, _calls.xact_lock_all(conn, ns, resources, timeout))


async def lock_rows(
    conn: psycopg.AsyncConnection, table: str, ids: Sequence[int], timeout: Timeout = None
) -> int:
    """Lock rows ``FOR UPDATE`` by id in ascending order; returns how many exist.

    ``table`` is a table name as SQL would resolve it (``'orders'``, ``'"Mixed Case"'``,
    ``'shop.orders'``): it is passed as a ``regclass``, never spliced into SQL text.
    """
    return await _calls.arun(conn, _calls.lock_rows(conn, table, ids, timeout))


@asynccontextmanager
async def sole_writer(
    dsn: str,
    ns: str,
    resource: str | int,
    *,
    application_name: str | None = None,
    keepalives: dict[str, int] | None = None,
) -> AsyncIterator[bool]:
    """Yield True if this caller won the session lock ``ns``/``resource``, False if another
    process holds it. Never waits.

    The lock lives on a dedicated connection opened here (never take it from a pool: a pooled
    session keeps the lock after you return it) with TCP keepalives, and is released on exit, or
    by the server when this process dies. If this host vanishes without closing the connection
    (power loss, network partition), the server frees the lock after about idle + interval *
    count seconds of silence: ``keepalives`` overrides ``SERVER_KEEPALIVES`` (10 + 5 * 3 s).

    ``dsn`` must reach PostgreSQL directly. Through a pooler or proxy such as PgBouncer, in
    transaction mode and in session mode alike, this raises ``PoolerDetected`` before any lock is
    taken: the pid the connection reported at startup is not the server's ``pg_backend_pid()``.

    >>> async with sole_writer(dsn, "graphs", "restock_plan") as mine:  # doctest: +SKIP
    ...     if mine:
    ...         await graph.ainvoke(state)
    """
    conn = await aconnect(
        dsn, autocommit=True, application_name=application_name or f"pglockkit sole_writer {ns}"
    )
    try:
        await _calls.arun(conn, _calls.refuse_pooler(conn))
        await aset_server_keepalives(conn, keepalives)
        key, got = await _calls.arun(conn, _calls.try_session_lock(conn, ns, resource))
        if not got:
            await _calls.arun(conn, _calls.lock_holders(ns, resource, key))
        acquired_at = time.monotonic()
        try:
            yield got
        finally:
            if got:
                await _calls.arun(conn, _calls.session_unlock(ns, resource, key, acquired_at))
    finally:
        await conn.close()
