"""Where pglockkit connects: DSN resolution and connections with TCP keepalives."""

from __future__ import annotations

import os
from typing import Any

import psycopg

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
    kwargs.setdefault("prepare_threshold", None)
    params: dict[str, Any] = dict(KEEPALIVES)
    if application_name:
        params["application_name"] = application_name
    params.update(kwargs)
    return psycopg.connect(dsn, autocommit=autocommit, **params)
