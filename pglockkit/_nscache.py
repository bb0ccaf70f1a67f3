"""Namespace ids cached per process, so that the lock helpers take a free lock in one round trip.

``try_xact_lock`` and ``xact_lock`` compute a key locally (``keys.lock_key``) from the namespace's
id and send a statement that tries it (``pglockkit._calls``). The id is learnt from the SQL call
(``pglockkit.xact_lock`` or ``try_xact_lock``) that a helper makes when it has no id, or one older
than ``REFRESH_S``: that call is the one it made before the cache, so a miss costs no extra round
trip, and every error of an unknown namespace or bad input is the server's own.

Ids are kept per database: host, port and dbname of the connection, and the database's oid and the
server's start time, which the learning call returns. A connection's first lock call is always the
SQL one, so a database dropped and created again under the same name (test suites do this), or
another server on the same port, never gets the ids cached for the old one.

Thread-safe, and never blocks for I/O or holds its lock across a call: the sync and async
helpers share it.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

# How long a cached id is used before the next lock call asks the server again. It bounds how long
# this process keeps locking under an id that changed by hand (a namespace deleted, or re-registered
# with another id) or that came from a registration later rolled back. 5 s costs one SQL call per
# namespace and database every 5 s, nothing next to thousands of locks a second, and is shorter
# than any deploy or migration that re-registers namespaces. Tests set it lower.
REFRESH_S = 5.0
MAX_ENTRIES = 4096  # past this, entries older than REFRESH_S are dropped when one is added

Database = tuple[Any, ...]

_lock = threading.Lock()
_databases: weakref.WeakKeyDictionary[Any, Database] = weakref.WeakKeyDictionary()  # connection -> database
_ids: dict[tuple[Database, str], tuple[int, float]] = {}  # (database, namespace) -> (id, learnt at)


def cached_id(conn: Any, ns: str) -> int | None:
    """The id of namespace ``ns`` in ``conn``'s database, or None if unknown or due for a refresh."""
    # No lock: each lookup is one dict read, atomic with or without the GIL; this is every lock
    # call's path. Writers take the lock because pruning reads and deletes many entries.
    database = _databases.get(conn)
    entry = None if database is None else _ids.get((database, ns))
    if entry is None or time.monotonic() - entry[1] > REFRESH_S:
        return None
    return entry[0]


def learn(conn: Any, ns: str, ns_id: int, db_oid: int, server_started: Any) -> None:
    """Record what a SQL lock call on ``conn`` returned: ``ns``'s id, and which database that is."""
    info = conn.info
    database = (info.host, info.port, info.dbname, db_oid, server_started)
    now = time.monotonic()
    with _lock:
        _databases[conn] = database
        _ids[(database, ns)] = (ns_id, now)
        if len(_ids) > MAX_ENTRIES:
            for key in [k for k, (_, at) in _ids.items() if now - at > REFRESH_S]:
                del _ids[key]
