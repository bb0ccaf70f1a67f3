"""Where pglockkit connects: DSN resolution and connections with TCP keepalives."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import psycopg

from pglockkit import _calls
from pglockkit._calls import SERVER_KEEPALIVES as SERVER_KEEPALIVES

# A host that vanishes without closing its socket leaves its session, and every session lock it
# holds, alive on the server until TCP notices. These settings make the client side notice within
# about idle + interval * count = 10 + 5 * 3 = 25 s; the server side is governed by the server's
# tcp_keepalives_* settings.
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}

# The server side (SERVER_KEEPALIVES, set by set_server_keepalives) is defined with the SQL
# that sets it, in pglockkit._calls.

DSN_ENV = "PGLOCKKIT_DSN"


def resolve_dsn(dsn: str | None = None, *, embedded: bool = False, data_dir: str | None = None) -> str:
    """The DSN to use: ``dsn``, else the embedded server's, else ``$PGLOCKKIT_DSN``, else ``""``.

    An empty DSN lets libpq read its own environment (``PGHOST``, ``PGDATABASE``, ...).
    """
    if dsn:
        return dsn
    if embedded:
        from pglockkit import embedded as _embedded

        return _embedded.dsn(data_dir)
    return os.environ.get(DSN_ENV, "")


def connect(
    dsn: str = "", *, autocommit: bool = False, application_name: str | None = None, **kwargs: Any
) -> psycopg.Connection:
    """A psycopg connection with TCP keepalives on (ignored for Unix sockets).

    Client-side prepared statements are off (``prepare_threshold=None``): psycopg prepares a
    query after its 5th run, and PgBouncer before 1.21 in transaction mode sends the next run to
    another server session, where it fails ("prepared statement ... does not exist / already
    exists"). The kit's calls are one-line function calls whose plans the server caches anyway.
    """
    return psycopg.connect(dsn, autocommit=autocommit, **connect_params(application_name, kwargs))


async def aconnect(
    dsn: str = "", *, autocommit: bool = False, application_name: str | None = None, **kwargs: Any
) -> psycopg.AsyncConnection:
    """``pglockkit.aio.connect``: ``connect`` for async code, TCP keepalives on, client-side
    prepared statements off."""
    return await psycopg.AsyncConnection.connect(
        dsn, autocommit=autocommit, **connect_params(application_name, kwargs)
    )


def connect_params(application_name: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``connect``'s keyword arguments for psycopg (shared with ``pglockkit.aio.connect``)."""
    params: dict[str, Any] = {**KEEPALIVES, "prepare_threshold": None}
    if application_name:
        params["application_name"] = application_name
    params.update(kwargs)
    return params


def set_server_keepalives(conn: psycopg.Connection, window: dict[str, int] | None = None) -> None:
    """Have the server drop this session (and its session locks) when the client host vanishes:
    sets the session's ``tcp_keepalives_*`` (default ``SERVER_KEEPALIVES``; any subset may be
    given) and ``tcp_user_timeout`` to the same window, idle + interval * count seconds. It also
    sets ``idle_session_timeout`` to 0, so that a server, database or role that ends idle
    sessions does not end this one (and free its locks) while it waits, idle, for the work its
    locks protect. Session, not transaction, settings: use it on direct connections that hold
    session locks, never through a pooler (they would stay on a server session that others use)."""
    _calls.run(conn, _calls.server_keepalives(window))


async def aset_server_keepalives(conn: psycopg.AsyncConnection, window: dict[str, int] | None = None) -> None:
    """``pglockkit.aio.set_server_keepalives``: ``set_server_keepalives`` on an async connection."""
    await _calls.arun(conn, _calls.server_keepalives(window))


def sever(conn: psycopg.Connection | psycopg.AsyncConnection) -> None:
    """Shut the connection's socket down, from any thread: a call blocked on it (a frozen backend,
    a partition with the query in flight, where no keepalive probe is sent) fails at once with
    ``OperationalError`` instead of waiting for TCP to give up. The connection is broken after
    it; close it once the call has returned. Does nothing to a closed connection."""
    with contextlib.suppress(OSError, psycopg.Error):
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
