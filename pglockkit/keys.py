"""Lock keys computed locally, bit for bit the same as ``pglockkit.lock_key`` in SQL.

The formula is pglockkit's contract with every client::

    text resource:    key = (ns_id << 48) | (1 << 47) | h47(resource)
                      h47 = first 6 bytes of sha256(UTF-8 bytes of resource), big-endian, >> 1
    integer resource: key = (ns_id << 48) | id        with 0 <= id < 2**47

A namespace registered without an explicit id gets ``namespace_id(name)``.
"""

from __future__ import annotations

import hashlib

NS_ID_MIN, NS_ID_MAX = 1, 32767
INT_RESOURCE_LIMIT = 1 << 47
_TEXT_FLAG = 1 << 47


def namespace_id(name: str) -> int:
    """The id that ``register_namespace(name)`` derives when given none.

    >>> namespace_id("pglockkit")
    12870
    """
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:2], "big") % NS_ID_MAX + 1


def lock_key(ns_id: int, resource: str | int) -> int:
    """The advisory-lock key of ``resource`` in the namespace with id ``ns_id``.

    >>> lock_key(1, "restock_plan")
    458487468674308
    >>> lock_key(3, 42)
    844424930132010
    """
    if isinstance(ns_id, bool) or not isinstance(ns_id, int):
        raise TypeError(f"namespace id must be an int, got {type(ns_id).__name__}")
    if not NS_ID_MIN <= ns_id <= NS_ID_MAX:
        raise ValueError(f"namespace id {ns_id} is out of range ({NS_ID_MIN}..{NS_ID_MAX})")
    if isinstance(resource, str):
        if "\x00" in resource:
            raise ValueError("a resource cannot contain NUL: PostgreSQL text cannot hold it")
        digest = hashlib.sha256(resource.encode("utf-8")).digest()
        return (ns_id << 48) | _TEXT_FLAG | (int.from_bytes(digest[:6], "big") >> 1)
    if isinstance(resource, bool) or not isinstance(resource, int):
        raise TypeError(f"resource must be str or int, got {type(resource).__name__}")
    if not 0 <= resource < INT_RESOURCE_LIMIT:
        raise ValueError(f"integer resource {resource} is out of range (0 <= id < 2**47)")
    return (ns_id << 48) | resource


def pg_locks_ids(key: int) -> tuple[int, int]:
    """``(classid, objid)`` under which ``pg_locks`` shows a bigint advisory lock (objsubid 1)."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF
