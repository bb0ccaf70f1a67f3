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
Ids = dict[str, tuple[int, float]]  # namespace -> (id, learnt at)

_lock = threading.Lock()
# The read path is two plain dict lookups: connection -> (its database, the ids of that database)
# -> namespace. Keyed by id(conn), not by a weak reference to it (a WeakKeyDictionary lookup is
# Python code that makes a weakref on every call): a finalizer drops the entry when the connection
# is collected, before its id can be reused. Connections to one database share one dict of ids.
_by_conn: dict[int, tuple[Database, Ids]] = {}
_databases: dict[Database, Ids] = {}


def cached_id(conn: Any, ns: str) -> int | None:
    """The id of namespace ``ns`` in ``conn``'s database, or None if unknown or due for a refresh."""
    # No lock: each lookup is one dict read, atomic with or without the GIL; this is every lock
    # call's path. Writers take the lock because pruning reads and deletes many entries.
    known = _by_conn.get(id(conn))
    entry = None if known is None else known[1].get(ns)
    if entry is None or time.monotonic() - entry[1] > REFRESH_S:
        return None
    return entry[0]


def learn(conn: Any, ns: str, ns_id: int, db_oid: int, server_started: Any) -> None:
    """Record what a SQL lock call on ``conn`` returned: ``ns``'s id, and which database that is."""
    info = conn.info
    database = (info.host, info.port, info.dbname, db_oid, server_started)
    now = time.monotonic()
    key = id(conn)
    with _lock:
        known = _by_conn.get(key)
        if known is None or known[0] != database:
            if known is None:
                weakref.finalize(conn, _forget, key)
            known = _by_conn[key] = (database, _databases.setdefault(database, {}))
        known[1][ns] = (ns_id, now)
        if sum(len(d) for d in _databases.values()) > MAX_ENTRIES:
            for database_ids in _databases.values():
                for name in [n for n, (_, at) in database_ids.items() if now - at > REFRESH_S]:
                    del database_ids[name]
            in_use = {id(ids) for _, ids in _by_conn.values()}
            for gone in [d for d, ids in _databases.items() if not ids and id(ids) not in in_use]:
                del _databases[gone]


def _forget(key: int) -> None:
    with _lock:
        _by_conn.pop(key, None)
