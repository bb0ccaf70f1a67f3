"""A worker lane's connection: the running job's savepoint (or transaction) is made just before
its handler's first statement, and the handler may not end the worker's transaction.

Lane connections are in autocommit mode (the lane sends BEGIN itself), so a handler that sends
``COMMIT`` or ``ROLLBACK`` as SQL leaves the connection idle, and its next statements would each
commit on their own. Every statement of a handler first checks that the job's transaction is
still open; one that finds it ended marks the connection, and the job fails however the handler
goes on; the statement itself is refused, so nothing after the end is written (in autocommit, it
would be at once). Not seen: statements sent in one pipeline, or in one string, with the COMMIT
(the connection is not idle between them); the job still fails, but they are written.

One source: this module as written is the connection of ``pglockkit.aio.Worker``'s lanes, and
``tools/async_to_sync.py`` writes ``pglockkit.worker.connection`` (``pglockkit.Worker``'s) from
it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from pglockkit._calls import Call

ENDED_BY_HANDLER = (
    "the handler ended the worker's transaction (COMMIT or ROLLBACK sent as SQL); its later "
    "statements are refused and the job fails"
)
NOT_YOURS_TO_END = (
    "a handler must not commit or roll back the worker's transaction: its writes commit with the "
    "job's completion; use `with conn.transaction():` for a savepoint of its own"
)


class AsyncLaneConnection(psycopg.AsyncConnection):
    """A lane's connection. Before the handler's first statement (any cursor, ``transaction()``
    or ``pipeline()``), it creates the running job's savepoint, so that a handler that does not
    use its connection costs no round trip, and one that does can be rolled back alone."""

    pending_savepoint: Call[None] | None = None
    in_job = False  # a handler is running: commit() and rollback() are refused
    ended_by_handler = False  # a statement of the handler found the job's transaction ended

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cursor_factory = _AsyncLaneCursor
        self.server_cursor_factory = _AsyncLaneServerCursor

    async def commit(self) -> None:
        if self.in_job:
            raise psycopg.ProgrammingError(NOT_YOURS_TO_END)
        await super().commit()

    async def rollback(self) -> None:
        if self.in_job:
            raise psycopg.ProgrammingError(NOT_YOURS_TO_END)
        await super().rollback()

    def start_job(self, savepoint: Call[None] | None) -> None:
        self.pending_savepoint, self.in_job, self.ended_by_handler = savepoint, True, False

    async def savepoint_now(self) -> None:
        """Make the running job's savepoint (or BEGIN) if it is still to be made; refuse a
        statement once the handler has ended the job's transaction."""
        if self.pending_savepoint is not None:
            call, self.pending_savepoint = self.pending_savepoint, None
            async with psycopg.AsyncCursor(self) as cur:
                await cur.execute(call.query)
        elif self.in_job and self.pgconn.transaction_status == TransactionStatus.IDLE:
            self.ended_by_handler = True
            raise psycopg.ProgrammingError(ENDED_BY_HANDLER)

    @asynccontextmanager
    async def transaction(self, *args: Any, **kwargs: Any) -> AsyncIterator[psycopg.AsyncTransaction]:
        await self.savepoint_now()
        async with super().transaction(*args, **kwargs) as tx:
            yield tx

    @asynccontextmanager
    async def pipeline(self) -> AsyncIterator[psycopg.AsyncPipeline]:
        await self.savepoint_now()
        async with super().pipeline() as p:
            yield p


class _AsyncLaneCursor(psycopg.AsyncCursor):
    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        await self.connection.savepoint_now()  # type: ignore[attr-defined]
        return await super().execute(*args, **kwargs)

    async def executemany(self, *args: Any, **kwargs: Any) -> None:
        await self.connection.savepoint_now()  # type: ignore[attr-defined]
        return await super().executemany(*args, **kwargs)

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        await self.connection.savepoint_now()  # type: ignore[attr-defined]
        async for row in super().stream(*args, **kwargs):
            yield row

    @asynccontextmanager
    async def copy(self, *args: Any, **kwargs: Any) -> AsyncIterator[psycopg.AsyncCopy]:
        await self.connection.savepoint_now()  # type: ignore[attr-defined]
        async with super().copy(*args, **kwargs) as copy:
            yield copy


class _AsyncLaneServerCursor(psycopg.AsyncServerCursor):
    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        await self.connection.savepoint_now()  # type: ignore[attr-defined]
        return await super().execute(*args, **kwargs)
