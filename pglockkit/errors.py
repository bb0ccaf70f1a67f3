"""pglockkit's exceptions, mapped from SQLSTATE so callers never parse message text.

Every class keeps the psycopg error it came from as ``__cause__`` and exposes ``sqlstate``
and the server's ``detail`` and ``hint``; the message ends with the detail (a lock timeout's
"Held by pid N."), as psycopg's own does.
"""

from __future__ import annotations

import psycopg


class PglockkitError(Exception):
    """Base class. ``sqlstate`` is the server's code, or None for client-side errors."""

    sqlstate: str | None = None

    def __init__(
        self, message: str, *, sqlstate: str | None = None, hint: str | None = None, detail: str | None = None
    ):
        super().__init__(f"{message}\nDETAIL: {detail}" if detail else message)
        if sqlstate is not None:
            self.sqlstate = sqlstate
        self.hint = hint
        self.detail = detail


class InvalidArgument(PglockkitError, ValueError):
    """Bad input: a NULL (22004), an invalid value (22023) or one out of range (22003)."""


class LimitExceeded(InvalidArgument):
    """An argument over a size limit (54000): a job payload over ``max_payload_bytes``."""

    sqlstate = "54000"


class PayloadNotDecodable(PglockkitError, ValueError):
    """A claimed job's payload is valid jsonb that this client's JSON loader cannot decode (an
    integer over Python's 4,300 digits, arrays nested past the recursion limit), raised by
    ``pglockkit.queue.claim`` after the claim. ``jobs`` are the claimed jobs (the undecodable
    payloads as ``pglockkit._calls.UndecodablePayload``): fail or release them, or they wait for
    their lease. A worker fails such a job instead, and runs the others."""

    def __init__(self, message: str, *, jobs: list):
        super().__init__(message)
        self.jobs = jobs


class UnknownObject(PglockkitError, LookupError):
    """Something named by the call does not exist (42704). The server's error says where it
    looked (its schema and table fields); the subclasses below are chosen from that."""

    sqlstate = "42704"


class UnknownNamespace(UnknownObject):
    """The lock namespace is not registered (42704, table pglockkit.namespaces)."""


class UnknownJob(UnknownObject):
    """No job has this id (42704, table pglockkit.jobs): it never existed, or it finished and was
    pruned. Its claim is gone; there is nothing left to complete, fail, extend or release."""


class UnknownRun(UnknownObject):
    """No singleton run has this id (42704, table pglockkit.runs): ``finish_run`` was given an id
    that ``start_run`` never returned here."""


class NamespaceConflict(PglockkitError):
    """The namespace name or id is already registered differently (23505)."""

    sqlstate = "23505"


class LockNotHeld(PglockkitError):
    """Releasing a lock this session does not hold (55000)."""

    sqlstate = "55000"


class StaleToken(PglockkitError):
    """A fencing check failed (PK001): the lease changed hands, expired or was released.
    The writer must stop; retrying with the same token can never succeed."""

    sqlstate = "PK001"


class PoolerDetected(PglockkitError):
    """A session lock was asked for through a connection pooler or proxy (client-side, no SQLSTATE).

    The server pid in the protocol's BackendKeyData (``conn.info.backend_pid``) differs from
    ``pg_backend_pid()``: something between client and server answered the startup itself, as
    PgBouncer does in every pool mode. ``client_pid`` and ``server_pid`` are the two pids."""

    def __init__(self, message: str, *, client_pid: int, server_pid: int):
        super().__init__(message)
        self.client_pid = client_pid
        self.server_pid = server_pid


class DependentObjects(PglockkitError):
    """``uninstall`` refused (2BP01): objects outside pglockkit's schemas depend on it.
    ``objects`` names each, with what of pglockkit it uses. Nothing was changed."""

    sqlstate = "2BP01"

    def __init__(self, objects: list[str]):
        listed = "".join(f"\n  {o}" for o in objects)
        super().__init__(
            f"uninstall refused: {len(objects)} object(s) outside pglockkit depend on it; "
            f"nothing was changed:{listed}",
            hint="drop or change them first, or uninstall with cascade (`pglockkit uninstall --yes "
            "--cascade`) to drop them with pglockkit",
        )
        self.objects = objects


class PreReleaseInstall(PglockkitError):
    """``install`` refused: the database holds pglockkit from a pre-release build, whose
    migrations this version does not know (they were folded into the baseline). Uninstall it and
    install again (client-side, no SQLSTATE)."""


class NotOwner(PglockkitError):
    """``install``, ``uninstall`` or ``status`` run by a role that does not own schema pglockkit
    (42501), e.g. a worker's app role on a database installed by another role. The message names
    the owner, the role that must run it."""

    sqlstate = "42501"


class RetryableError(PglockkitError):
    """A failure that a retry of the whole transaction can cure."""

    retry_after: float = 0.05


class LockTimeout(RetryableError):
    """A lock was not granted within its timeout (55P03). ``retry_after`` is a suggested pause."""

    sqlstate = "55P03"
    retry_after = 0.5


class Deadlock(RetryableError):
    """The server broke a deadlock by aborting this transaction (40P01)."""

    sqlstate = "40P01"


class SerializationFailure(RetryableError):
    """A serializable transaction conflicted with another (40001)."""

    sqlstate = "40001"


_BY_SQLSTATE: dict[str, type[PglockkitError]] = {
    "22004": InvalidArgument,
    "22023": InvalidArgument,
    "22003": InvalidArgument,
    "54000": LimitExceeded,
    "42704": UnknownObject,
    "23505": NamespaceConflict,
    "55000": LockNotHeld,
    "PK001": StaleToken,
    "55P03": LockTimeout,
    "40P01": Deadlock,
    "40001": SerializationFailure,
}


# 42704 by the table the server looked in (the error's SCHEMA and TABLE fields).
_UNKNOWN_BY_TABLE: dict[tuple[str, str], type[UnknownObject]] = {
    ("pglockkit", "namespaces"): UnknownNamespace,
    ("pglockkit", "jobs"): UnknownJob,
    ("pglockkit", "runs"): UnknownRun,
}


def from_psycopg(exc: psycopg.Error) -> PglockkitError | psycopg.Error:
    """The pglockkit exception for a psycopg error, or the error itself if none maps."""
    cls = _BY_SQLSTATE.get(exc.sqlstate or "")
    if cls is None:
        return exc
    diag = exc.diag
    if cls is UnknownObject:
        cls = _UNKNOWN_BY_TABLE.get((diag.schema_name or "", diag.table_name or ""), UnknownObject)
    primary = diag.message_primary  # without it, str(exc) has the detail already
    detail = diag.message_detail if primary else None
    mapped = cls(primary or str(exc), sqlstate=exc.sqlstate, hint=diag.message_hint, detail=detail)
    mapped.__cause__ = exc
    return mapped


class translated:
    """Context manager: re-raise psycopg errors with a known SQLSTATE as pglockkit errors."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, psycopg.Error):
            mapped = from_psycopg(exc)
            if mapped is not exc:
                raise mapped from exc
        return False
