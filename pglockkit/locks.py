"""Advisory-lock helpers: thin wrappers over the SQL functions, with structured logging.

Every function here is one SQL call. Lock keys, ordering, timeouts and errors are decided in SQL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from pglockkit.connection import connect, set_server_keepalives
from pglockkit.errors import LockTimeout, PoolerDetected, translated

log = logging.getLogger("pglockkit.locks")

Timeout = float | timedelta | None


def _interval(timeout: Timeout) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    return timedelta(seconds=timeout)


def _event(event: str, ns: str, resource: object, key: int | None, **fields: object) -> None:
    data = {"event": event, "namespace": ns, "resource": resource, "key": key, **fields}
    text = " ".join(f"{k}={v}" for k, v in data.items() if v is not None)
    log.info("%s", text, extra={"pglockkit": data})


def _require_transaction(conn: psycopg.Connection, what: str) -> None:
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise ValueError(
            f"{what} takes a transaction-level lock, which an autocommit statement would release "
            "at once: call it inside `with conn.transaction():`"
        )


def register_namespace(
    conn: psycopg.Connection,
    name: str,
    id: int | None = None,
    description: str | None = None,
    lock_timeout: Timeout = None,
) -> int:
    """Register (idempotently) a lock namespace; returns its id.

    >>> register_namespace(conn, "billing", description="invoices")  # doctest: +SKIP
    16218
    """
    with translated():
        row = conn.execute(
            "SELECT pglockkit.register_namespace(%s, %s, %s, %s)",
            (name, id, description, _interval(lock_timeout)),
        ).fetchone()
    return row[0]


def namespaces(conn: psycopg.Connection) -> list[dict]:
    """The namespace registry, ordered by id."""
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(
            "SELECT id, name, description, owner, lock_timeout, created_at "
            "FROM pglockkit.namespaces ORDER BY id"
        )
        return cur.fetchall()


def try_xact_lock(conn: psycopg.Connection, ns: str, resource: str | int) -> bool:
    """Take a transaction-level lock if free; False at once otherwise.

    >>> with conn.transaction():  # doctest: +SKIP
    ...     if try_xact_lock(conn, "cron", "nightly"):
    ...         record_run(conn)
    """
    _require_transaction(conn, "try_xact_lock")
    with translated():
        got = conn.execute("SELECT pglockkit.try_xact_lock(%s, %s)", (ns, resource)).fetchone()[0]
    _event("acquired" if got else "skipped", ns, resource, None, scope="xact")
    return got


def xact_lock(conn: psycopg.Connection, ns: str, resource: str | int, timeout: Timeout = None) -> int:
    """Take a transaction-level lock, waiting at most ``timeout`` (seconds or timedelta).

    Without a timeout the namespace's default applies, else the server's ``lock_timeout``.
    Raises ``LockTimeout`` (55P03) when the wait runs out. Returns the key.

    >>> with conn.transaction():  # doctest: +SKIP
    ...     xact_lock(conn, "billing", "invoice:42", timeout=2)
    ...     conn.execute("UPDATE invoices SET ...")
    """
    _require_transaction(conn, "xact_lock")
    started = time.monotonic()
    try:
        with translated():
            key = conn.execute(
                "SELECT pglockkit.xact_lock(%s, %s, %s)", (ns, resource, _interval(timeout))
            ).fetchone()[0]
    except LockTimeout as exc:
        if timeout is not None:
            exc.retry_after = _interval(timeout).total_seconds()
        _event(
            "timeout", ns, resource, None, scope="xact", wait_ms=round((time.monotonic() - started) * 1000, 1)
        )
        raise
    _event("acquired", ns, resource, key, scope="xact", wait_ms=round((time.monotonic() - started) * 1000, 1))
    return key


def xact_lock_all(
    conn: psycopg.Connection, ns: str, resources: Sequence[str] | Sequence[int], timeout: Timeout = None
) -> list[int]:
    """Lock many resources for the transaction, in ascending key order (no deadlocks between
    callers), within one ``timeout`` for the whole call. Returns the keys in the order taken.
    """
    _require_transaction(conn, "xact_lock_all")
    resources = list(resources)
    array_type = "bigint[]" if resources and all(isinstance(r, int) for r in resources) else "text[]"
    started = time.monotonic()
    with translated():
        keys = conn.execute(
            sql.SQL("SELECT pglockkit.xact_lock_all(%s, %s::{}, %s)").format(sql.SQL(array_type)),
            (ns, resources, _interval(timeout)),
        ).fetchone()[0]
    _event(
        "acquired",
        ns,
        f"{len(keys)} resources",
        None,
        scope="xact",
        wait_ms=round((time.monotonic() - started) * 1000, 1),
    )
    return keys


def lock_rows(conn: psycopg.Connection, table: str, ids: Sequence[int], timeout: Timeout = None) -> int:
    """Lock rows ``FOR UPDATE`` by id in ascending order; returns how many exist.

    ``table`` is a table name as SQL would resolve it (``'orders'``, ``'"Mixed Case"'``,
    ``'shop.orders'``): it is passed as a ``regclass``, never spliced into SQL text.
    """
    _require_transaction(conn, "lock_rows")
    with translated():
        return conn.execute(
            "SELECT pglockkit.lock_rows(%s::regclass, %s::bigint[], %s)",
            (table, list(ids), _interval(timeout)),
        ).fetchone()[0]


@contextmanager
def sole_writer(
    dsn: str,
    ns: str,
    resource: str | int,
    *,
    application_name: str | None = None,
    keepalives: dict[str, int] | None = None,
) -> Iterator[bool]:
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

    >>> with sole_writer(dsn, "graphs", "restock_plan") as mine:  # doctest: +SKIP
    ...     if mine:
    ...         graph.invoke(state)
    """
    conn = connect(dsn, autocommit=True, application_name=application_name or f"pglockkit sole_writer {ns}")
    try:
        _refuse_pooler(conn)
        set_server_keepalives(conn, keepalives)
        started = time.monotonic()
        with translated():
            key, got = conn.execute(
                "SELECT pglockkit.lock_key(%s, %s), pglockkit.try_lock(%s, %s)",
                (ns, resource, ns, resource),
            ).fetchone()
        if got:
            _event(
                "acquired",
                ns,
                resource,
                key,
                scope="session",
                backend_pid=conn.info.backend_pid,
                wait_ms=round((time.monotonic() - started) * 1000, 1),
            )
        else:
            holders = conn.execute("SELECT pglockkit._lock_holders(%s)", (key,)).fetchone()[0]
            _event("skipped", ns, resource, key, scope="session", held_by_pid=holders)
        acquired_at = time.monotonic()
        try:
            yield got
        finally:
            if got:
                _release(conn, ns, resource, key, acquired_at)
    finally:
        conn.close()


def _refuse_pooler(conn: psycopg.Connection) -> None:
    """Raise ``PoolerDetected`` unless ``conn`` reaches the server directly.

    PostgreSQL's BackendKeyData carries the pid of the backend serving the connection; a pooler
    (PgBouncer) or proxy answers the startup itself with a key of its own, so the pid differs."""
    client_pid = conn.info.backend_pid
    server_pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    if client_pid != server_pid:
        raise PoolerDetected(
            "sole_writer needs a direct connection to PostgreSQL, but a connection pooler or proxy "
            f"was detected (client-side pid {client_pid}, server pid {server_pid}): a session lock "
            "taken through it can stay on a server session that serves other clients. Pass a DSN "
            "that reaches PostgreSQL directly (not PgBouncer), or use xact_lock inside a transaction.",
            client_pid=client_pid,
            server_pid=server_pid,
        )


def _release(conn: psycopg.Connection, ns: str, resource: str | int, key: int, acquired_at: float) -> None:
    hold_ms = round((time.monotonic() - acquired_at) * 1000, 1)
    try:
        with translated():
            conn.execute("SELECT pglockkit.unlock(%s, %s)", (ns, resource))
    except psycopg.OperationalError:
        # The session is gone (killed backend, network): the server released the lock with it.
        _event("released", ns, resource, key, scope="session", hold_ms=hold_ms, by="session end")
        return
    _event("released", ns, resource, key, scope="session", hold_ms=hold_ms)
